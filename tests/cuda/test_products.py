"""The step's products through products.py: with COPPELIUS_PRODUCTS=own
(bf16) the forward's x @ W^T products and the backward's dY W products the
rule picks run on the project's own kernel, the gate/up product carries
the SwiGLU in its epilogue and the down product's dX its backward;
the memory plan's dry run records the same commands; the step and the
held-out losses are those of the cuBLAS step (bit for bit on the CPU
stand-ins, where both products are one NumPy operation; within the
operands' rounding on a Hopper GPU, whose kernels sum in other orders).
The kernel itself is checked in tests/cuda/test_gemm_sm90.py."""

import numpy as np
import pytest

from coppelius.conformance.cases import random_state
from coppelius.reference.config import Config, Hyper, preset
from coppelius.accelerated.cuda import gemm, products
from coppelius.accelerated.cuda.program import capture

from .helpers import check_bitwise, cupy, run_steps, windows

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


def _emulated() -> bool:
    # asked when a test runs (tests/support.EMULATED is fixed at its first import)
    return getattr(cupy, "__version__", None) == "emulated"


@pytest.fixture
def own(monkeypatch):
    """The own kernel for every product the rule takes, at the test presets'
    sizes too (the rule's row floor lowered)."""
    if not _emulated() and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the own kernel is sm_90a's")
    monkeypatch.setenv(products.ENV, "own")
    monkeypatch.setattr(products, "MIN_ROWS", 1)


# heads of 64 columns (the rope epilogue's): the test preset's shapes otherwise
E64 = Config(vocab=64, context=16, d_model=128, n_layer=2, n_head=2, d_ff=96, steps=8,
             interval=4)
E64_GQA = Config(vocab=64, context=16, d_model=128, n_layer=2, n_head=2, d_ff=96, steps=8,
                 interval=4, norm="rmsnorm", n_kv_head=1, tied=False)
# d_ff 100: no multiple of 8, so the SwiGLU's register-store variant and no
# fused SwiGLU backward (its outputs' rows are no whole 16 bytes)
F100 = Config(vocab=64, context=16, d_model=128, n_layer=2, n_head=2, d_ff=100, steps=8,
              interval=4, norm="rmsnorm")
CONFIGS = {"test": preset("test"), "test-llama": preset("test-llama"), "E64": E64,
           "E64-gqa": E64_GQA, "test-qwen": preset("test-qwen"), "F100": F100}


@pytest.mark.parametrize("name, recompute", [("test", None), ("test-llama", None),
                                             ("test", "gate-up"), ("test-llama", "block"),
                                             ("E64", None), ("E64-gqa", "block"),
                                             ("test-qwen", None), ("F100", None)])
def test_the_own_products_give_the_cublas_steps(own, monkeypatch, name, recompute):
    """Also with the backward recomputing the gate/up product (gate-up: it
    stays a product of its own there) or each whole layer (block); heads of
    64 take the rope in the q | k | v product (not with q, k, v biases)."""
    config = CONFIGS[name]
    state = random_state(config, seed=61, t=2)
    inputs = windows(2, seed=62, config=config, batch=4)
    mine = capture(config, Hyper(), "bf16", 4, state.copy(), recompute=recompute)
    monkeypatch.setenv(products.ENV, "cublas")
    theirs = capture(config, Hyper(), "bf16", 4, state.copy(), recompute=recompute)
    assert mine.blas.own and not theirs.blas.own
    named = [c.name for c in mine.plan.commands if c.kind == "product"]
    L = config.n_layer
    # without recompute (F a multiple of 8) the backward computes the gate and
    # up products again in the SwiGLU backward's kernel, and the forward's
    # gate/up kernel stores a alone
    again = recompute is None and config.d_ff % 8 == 0
    forward = products.SWIGLU_A if again else \
        products.SWIGLU if config.d_ff % 8 == 0 else products.SWIGLU_ANY_F
    # per layer: q | k | v, o and down on the own kernel, gate/up fused with the SwiGLU
    assert named.count(forward) == L
    assert sum(n in gemm.VARIANTS and n != forward for n in named) >= 3 * L
    assert not any(c.name == "swiglu_forward" for c in mine.plan.commands)
    fused_rope = config.d_model // config.n_head == 64 and not config.qkv_bias
    assert named.count(products.ROPE[64]) == (L * (2 if recompute == "block" else 1)
                                               if fused_rope else 0)
    assert sum(c.name == "rope_forward" for c in mine.plan.commands) == \
        (0 if fused_rope else sum(c.name == "rope_forward" for c in theirs.plan.commands))
    assert sum(c.name == "swiglu_forward" for c in theirs.plan.commands) == L
    # the backward: the down product's dX with the SwiGLU backward in its
    # epilogue (F a multiple of 8), and the o product's dX by the kn layout
    fused_back = config.d_ff % 8 == 0
    assert named.count(products.DSWIGLU) == (L if fused_back and not again else 0)
    assert sum(n in products.DSWIGLU_AGAIN.values() for n in named) == (L if again else 0)
    assert sum(c.name == "swiglu_backward" for c in mine.plan.commands) == \
        (0 if fused_back else L)
    assert sum(c.name == "swiglu_backward" for c in theirs.plan.commands) == L
    assert named.count(products.BACKWARD_INPUT["bfloat16"]) == L
    assert all(n in ("gemm", "gemm_strided_batched")
               for n in (c.name for c in theirs.plan.commands if c.kind == "product"))
    rows1, G1, s1 = run_steps(theirs, inputs)
    rows2, G2, s2 = run_steps(mine, inputs)
    held_out = windows(1, seed=63, config=config, batch=4)[0]
    if _emulated():
        check_bitwise("row losses", rows2, rows1)
        check_bitwise("G", G2, G1)
        for part in "PMV":
            check_bitwise(part, getattr(s2, part), getattr(s1, part))
        check_bitwise("held-out", mine.evaluate(held_out), theirs.evaluate(held_out))
    else:
        np.testing.assert_allclose(rows2, rows1, rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(mine.evaluate(held_out), theirs.evaluate(held_out),
                                   rtol=2e-3, atol=2e-3)


def test_the_rule_by_precision_device_and_choice(monkeypatch):
    """fp32 and COPPELIUS_PRODUCTS=cublas on cuBLAS; =own on the rule; the
    default (auto) on the rule on a Hopper GPU only (never the stand-ins);
    another value refused by name."""
    from coppelius.reference.errors import ConfigError

    monkeypatch.delenv(products.ENV, raising=False)
    hopper = not _emulated() and cupy.cuda.Device().compute_capability == "90"
    assert products.own_products("bf16") == hopper and not products.own_products("fp32")
    monkeypatch.setenv(products.ENV, "auto")
    assert products.own_products("bf16") == hopper
    monkeypatch.setenv(products.ENV, "own")
    assert products.own_products("bf16") and not products.own_products("fp32")
    monkeypatch.setenv(products.ENV, "cublas")
    assert not products.own_products("bf16")
    monkeypatch.setenv(products.ENV, "mine")
    with pytest.raises(ConfigError, match="COPPELIUS_PRODUCTS='mine'"):
        products.own_products("bf16")


def test_a_product_first_seen_inside_a_capture_is_refused(own):
    """The plan (the tensor maps' upload) cannot be made inside a capture:
    the warm-up step makes it; a product the warm-up did not issue stops
    the capture with an error instead of a broken graph."""
    A = cupy.zeros((64, 64), np.uint16)
    W = cupy.zeros((64, 64), np.uint16)
    C = cupy.zeros((64, 64), np.float32)
    p = products.Products(blas=None, own=True, kernels=gemm.Kernels())
    p.blas = type("NoLog", (), {"log": None, "calls": 0})()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="inside the capture"):
                p.gemm(False, True, 64, 64, 64, A.data.ptr, 64, W.data.ptr, 64, C.data.ptr, 64,
                       ab_type="bfloat16", c_type="float32")
        finally:
            stream.end_capture()


def test_the_gate_up_products_computed_again_keep_h_not_gu(own, monkeypatch):
    """Where the SwiGLU backward computes the gate and up products again
    (products.gate_up_again), the production model's plan (the dry run)
    keeps each layer's h (BT x D operands) and no float32 gate/up product:
    smaller by at least L - 2 of the products less an h each, against the
    same step with the products kept (the rule refused)."""
    from coppelius.accelerated.cuda.step import memory_plan

    big = preset("coppelius")
    again = memory_plan(big, Hyper(), "bf16", 2)
    monkeypatch.setattr(products, "gate_up_again", lambda m, F, k: False)
    kept = memory_plan(big, Hyper(), "bf16", 2)
    BT = 2 * big.context
    per_layer = BT * 2 * big.d_ff * 4 - BT * big.d_model * 2
    assert again.arena_bytes <= kept.arena_bytes - (big.n_layer - 2) * per_layer
    named = [c.name for c in again.commands if c.kind == "product"]
    assert named.count(products.DSWIGLU_AGAIN[True]) == big.n_layer  # 2048 rows
    assert not set(products.DSWIGLU_AGAIN.values()) & {c.name for c in kept.commands}
