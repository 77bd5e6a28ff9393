"""The captured program (accelerated/cuda/program.py, report.py): replays,
events, refusals, the compilation report, the backend module, the capture
fallback and layer-by-layer debugging."""

import json
import math

import numpy as np
import pytest

from coppelius.conformance.cases import random_state
from coppelius.reference.config import Hyper
from coppelius.reference.params import registry
from coppelius.reference.compilation import STAGES
from coppelius.reference.contract import ReplayError
from coppelius.accelerated.cuda import program as cuda_program
from coppelius.accelerated.cuda.compile import KERNELS, Kernels
from coppelius.accelerated.cuda.layernorm import layernorm_variant
from coppelius.accelerated.cuda.policy import attention_path, logits_chunk_rows
from coppelius.accelerated.cuda.program import available, capture, CupyProgram, DeviceState

from .helpers import CONFIG, B, PRECISIONS, check_bitwise, fresh, windows, run_steps, cupy

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


# ------------------------------------------------------------------ the graph

def test_no_capture_switch_records_no_graph(monkeypatch):
    """(That the eager step gives the captured one's bits is in
    test_program_contract.py.)"""
    monkeypatch.setenv("COPPELIUS_NO_CAPTURE", "1")
    program = capture(CONFIG, Hyper(), "bf16", B, fresh())
    assert program.graph is None and not program.compilation_report()["captured"]


def test_replay_returns_at_once_with_an_event_and_times_the_device():
    program = capture(CONFIG, Hyper(), "bf16", B, fresh())
    program.upload_input(windows(1)[0])
    event = program.replay()
    assert isinstance(event.event, cupy.cuda.Event)
    event.wait()
    loss, seconds = program.replay_timed_and_wait()
    assert math.isfinite(loss) and 0 < seconds < 10
    assert program.state().t == 2


def test_a_replaced_state_is_refused():
    """(The refusals every backend shares are in test_program_contract.py.)"""
    program = capture(CONFIG, Hyper(), "fp32", B, fresh())
    program.upload_input(windows(1)[0])
    program.replay_and_wait()
    program.device_state = DeviceState(program.P, program.M, program.V, program.t)
    with pytest.raises(ReplayError, match="replaced"):
        program.replay()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_compilation_report(precision):
    program = capture(CONFIG, Hyper(), precision, B, fresh())
    program.upload_input(windows(1)[0])
    program.replay_and_wait()
    report = program.diagnostics()
    assert report["schema"] == "coppelius.training_compilation.v1"
    assert [s["stage"] for s in report["stages"]] == list(STAGES)
    assert report["captured"] and report["replays"] == 1
    # per chunk of the logits' rows the logits product and its two gradients,
    # 4 linear products per layer and their 8 gradients, and unless attention
    # is fused, per layer and batch element 2 attention products and their 4
    # gradients
    L = CONFIG.n_layer
    path = attention_path(CONFIG, precision, B)
    assert program.acts.path == path
    fused = path.kind != "materialized"
    rows = B * CONFIG.context
    chunks = -(-rows // logits_chunk_rows(rows, CONFIG.vocab))
    assert report["products"] == 3 * chunks + 12 * L + (0 if fused else 6 * L * B)
    assert report["library_calls"] == (2 * L if path.kind == "cudnn" else 0)
    E = CONFIG.head_dim
    attention = {"fused": {f"attention_{part}_e{E}" for part in ("forward", "backward_dq",
                                                                  "backward_dkdv")},
                 "materialized": {"attention_softmax_forward", "attention_softmax_backward"},
                 "cudnn": set()}[path.kind]
    rope = "rope_backward_operand" if program.acts.dqk.dtype == np.uint16 else "rope_backward"
    nc = layernorm_variant(CONFIG.d_model)
    layernorm = {f"layernorm_{part}_{nc}" for part in ("forward", "backward")}
    # (rmsnorm's, the q, k, v biases' and the untied embedding's: a family member's, SPEC 21)
    others = {name for name in KERNELS if not name.startswith(
        ("attention_", "rope_backward", "layernorm_forward_", "layernorm_backward_", "rmsnorm_",
         "linear_bias_"))}
    # k = 1, and clipping off: AdamW's pass sums the norm, no pass of its own
    assert set(report["kernel_names"]) == (others | attention | layernorm | {rope}) - {
        "round_bf16", "adamw_bias_corrections_table", "accumulate_gradient",
        "gradient_sum_squares", "embedding_backward_unseen"}
    assert report["kernels"] == len(report["kernel_names"])
    assert report["graph_nodes"] >= report["kernel_launches"] + report["products"]
    assert report["device_bytes"] >= 4 * 4 * registry(CONFIG).total
    assert report["runtime"]["update_count"] == 1


def test_a_family_members_commands():
    """RMSNorm, q, k, v biases, an untied head (SPEC 21): the rmsnorm
    kernels and not layernorm's, the biases' kernels, the untied
    embedding's zero rows; per layer one q | k | v product over the gathered
    weights, its input gradient one product, its weight gradient three (q,
    k, v are apart in G), so two products more per layer than the fused
    layout's twelve."""
    from coppelius.reference.config import Config

    config = Config(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96,
                    norm="rmsnorm", tied=False, qkv_bias=True)
    program = capture(config, Hyper(), "fp32", B, fresh(config))
    report = program.compilation_report()
    L, rows = config.n_layer, B * config.context
    chunks = -(-rows // logits_chunk_rows(rows, config.vocab))
    assert report["products"] == 3 * chunks + 14 * L + 6 * L * B  # fp32: materialized
    nc = layernorm_variant(config.d_model)
    names = set(report["kernel_names"])
    assert {f"rmsnorm_forward_{nc}", f"rmsnorm_backward_{nc}", "layernorm_param_grads",
            "linear_bias_forward", "linear_bias_backward", "linear_bias_param_grads",
            "linear_bias_gather_weights", "embedding_backward_unseen"} <= names
    assert not any(n.startswith(("layernorm_forward", "layernorm_backward")) for n in names)
    fusion = program.diagnostics()["notes"]["fusion"]
    assert "residual add into the norm" in fusion and "biases added after" in fusion


def test_available_and_backend_module():
    from coppelius import accelerated

    assert available()
    assert accelerated.backend_module("cupy") is cuda_program
    assert accelerated.best_backend() == "cupy"


# ------------------------------------------------------------------ capture fallback

def test_a_capture_refused_inside_the_stream_capture_falls_back(monkeypatch, capfd):
    """The failure inside the stream capture (a launch refused while the
    stream records, as CUDA refuses what a graph cannot hold): the capture
    ends cleanly, the step runs uncaptured with the same bits."""
    state = random_state(CONFIG, seed=36, t=2)
    inputs = windows(2, seed=37)
    rows, G, want = run_steps(capture(CONFIG, Hyper(), "fp32", B, state.copy()),
                              inputs)
    original, record = Kernels.mean_loss, CupyProgram._record
    capturing = []

    def refused_in_capture(self, ce, loss):
        if capturing:  # the stream is recording: half the step is in the graph already
            raise RuntimeError("cudaErrorStreamCaptureUnsupported: operation not permitted "
                               "when stream is capturing")
        return original(self, ce, loss)

    def flagged_record(self):
        capturing.append(True)
        try:
            record(self)
        finally:
            capturing.clear()

    monkeypatch.setattr(Kernels, "mean_loss", refused_in_capture)
    monkeypatch.setattr(CupyProgram, "_record", flagged_record)
    capfd.readouterr()
    program = capture(CONFIG, Hyper(), "fp32", B, state.copy())
    err = capfd.readouterr().err
    assert "capture refused (RuntimeError: cudaErrorStreamCaptureUnsupported" in err
    assert err.count("\n") == 1
    assert program.graph is None and program.capture_refused
    rows2, G2, got = run_steps(program, inputs)
    check_bitwise("row losses", rows2, rows)
    check_bitwise("G", G2, G)
    check_bitwise("P", got.P, want.P)
    assert "capture refused" in program.compilation_report()["notes"]["command_recording"]


# ------------------------------------------------------------------ layer-by-layer debugging

def test_activations_locate_a_broken_kernel_to_its_layer(monkeypatch):
    """A SwiGLU launcher broken in the second layer only: the backend's
    activations against the reference's name layers.1.mlp.h first."""
    from coppelius.conformance.activations import activation_rows, first_divergence
    from coppelius.reference.step import step_activations

    program = capture(CONFIG, Hyper(), "fp32", B, fresh())
    original = Kernels.swiglu_forward
    calls = []

    def broken(self, gu, a):
        original(self, gu, a)
        calls.append(1)
        if len(calls) == 2:  # activations() runs the one forward since the patch: layer 1
            with program.stream:
                a *= np.float32(1.01)

    monkeypatch.setattr(Kernels, "swiglu_forward", broken)
    tokens = windows(1, seed=38)[0]
    rows = activation_rows(CONFIG, program.activations(tokens),
                           step_activations(CONFIG, fresh().P, tokens, "fp32"), "fp32")
    first = first_divergence(rows)
    assert first is not None and first.tensor == "layers.1.mlp.h", first


def test_executable_plan_lists_the_captured_commands():
    program = capture(CONFIG, Hyper(), "bf16", B, fresh())
    report = program.compilation_report()
    plan = json.loads(program.debug_report_json("step"))
    nodes = plan["nodes"]
    assert len(nodes) == report["kernel_launches"] + report["products"] + report["library_calls"]
    assert sorted({n["name"] for n in nodes if n["kind"] == "kernel"}) == report["kernel_names"]
    gemm = next(n for n in nodes if n["kind"] == "product")
    assert gemm["operations"] == ["layers.0.attn.q", "layers.0.attn.k", "layers.0.attn.v"]
    D = CONFIG.d_model
    assert (gemm["launch"]["m"], gemm["launch"]["n"], gemm["launch"]["k"]) == \
        (B * CONFIG.context, 3 * D, D)
    assert "acts.h" in gemm["buffers"] and "acts.qkv32" in gemm["buffers"]


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norm_eps_and_rope_base_reach_the_captured_step(norm):
    """A model whose norm_eps and rope_base are not the defaults (SPEC 21),
    with either norm: the captured program's logits against the
    reference's within SPEC 14's fp32 tolerance, where the defaults' logits
    are far outside it (so the fields reached the step)."""
    from coppelius.conformance.tolerances import relative_error, tolerance
    from coppelius.reference.config import Config
    from coppelius.reference.model import model_forward

    shape = dict(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96, norm=norm)
    config = Config(**shape, norm_eps="1/1000", rope_base=500000)
    state = random_state(config, 3)
    tokens = np.random.default_rng(0).integers(0, config.vocab, (2, config.context))
    program = capture(config, Hyper(), "fp32", 2, state)
    want = model_forward(config, state.P, tokens, "fp32")[0]
    assert relative_error(program.logits(tokens), want)[0] <= tolerance("logits", "fp32")
    default = model_forward(Config(**shape), state.P, tokens, "fp32")[0]
    assert relative_error(default, want)[0] > 100 * tolerance("logits", "fp32")


def test_a_family_field_the_backend_does_not_compute_is_refused_by_name():
    """Each SPEC 21 field outside IMPLEMENTED is refused at capture, naming
    the field, before anything is allocated; the others capture."""
    from coppelius.reference.config import FAMILY_FIELDS, Config
    from coppelius.reference.errors import ConfigError

    shape = dict(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96)
    members = {"norm": dict(norm="rmsnorm"), "norm_eps": dict(norm_eps="1/1000"),
               "n_kv_head": dict(n_kv_head=1), "tied": dict(tied=False),
               "rope_base": dict(rope_base=500000), "rotary": dict(rotary="1/2"),
               "qkv_bias": dict(qkv_bias=True)}
    assert set(members) == set(FAMILY_FIELDS)
    for name, fields in members.items():
        config = Config(**shape, **fields)
        if name in cuda_program.IMPLEMENTED:
            capture(config, Hyper(), "fp32", 1, random_state(config, 3))
            continue
        with pytest.raises(ConfigError, match=rf"cupy: config field {name}="):
            capture(config, Hyper(), "fp32", 1, random_state(config, 3))
    assert {"norm", "norm_eps", "tied", "rope_base", "qkv_bias"} <= set(cuda_program.IMPLEMENTED)


def test_a_row_wider_than_the_norm_kernels_hold_is_refused_by_field_and_limit():
    """SPEC 23: any width up to layernorm.MAX_D (8192) runs; past it the
    capture refuses, naming the field and the limit, before it looks at the
    state or allocates anything."""
    from coppelius.reference.config import Config
    from coppelius.reference.errors import RunError
    from coppelius.accelerated.cuda.layernorm import MAX_D

    assert MAX_D >= 8192
    wide = Config(vocab=64, context=16, d_model=MAX_D + 64, n_layer=1, n_head=(MAX_D + 64) // 64,
                  d_ff=128)
    with pytest.raises(RunError, match=rf"^d_model={MAX_D + 64}: .* at most {MAX_D} features$"):
        capture(wide, Hyper(), "bf16", 1, None)
    assert layernorm_variant(MAX_D) == "w8" and layernorm_variant(1024) == "c8"
    assert layernorm_variant(1025) == "w2" and layernorm_variant(2304) == "w4"


def test_the_bench_says_when_attention_is_not_cudnns(monkeypatch):
    """coppelius bench's line before the table for a CuPy row whose
    attention is not cuDNN's, with the program report's reason (fp32's
    policy; cuDNN's frontend missing); none where cuDNN serves it."""
    from coppelius import bench
    from coppelius.accelerated.cuda import cudnn_attention

    state = random_state(CONFIG, seed=5, t=0)
    fp32 = bench.program_runner("cupy", CONFIG, "fp32", B, state.copy(), warm=[])
    assert fp32.note.startswith("attention materialized, cuDNN's not used: fp32 policy")
    assert bench.program_runner("cupy", CONFIG, "bf16", B, state.copy(), warm=[]).note == ""
    monkeypatch.setattr(cudnn_attention, "unavailable",
                        lambda *args, **kw: "cudnn (the cuDNN frontend) is not importable")
    missing = bench.program_runner("cupy", CONFIG, "bf16", B, state.copy(), warm=[])
    assert missing.note.endswith("cuDNN's not used: cudnn (the cuDNN frontend) is not importable")


def test_train_says_when_attention_is_not_cudnns(tmp_path, capsys):
    """`coppelius train --backend cupy`: one line after the program is
    built where its attention is not cuDNN's (fp32's policy here), none
    where it is (bf16)."""
    from coppelius.cli import main
    from coppelius.reference.config import preset
    from tests.support import pattern_stream

    stream = pattern_stream(tmp_path / "s.tokens", preset("test"), 12, noise=0.1)
    for precision in ("fp32", "bf16"):
        run = tmp_path / precision
        assert main(["train", "--preset", "test", "--backend", "cupy", "--precision", precision,
                     "--batch", "2", "--stream", str(stream), "--run-dir", str(run),
                     "--checkpoint", str(run / "ck.bin"), "--until", "1", "--no-sample",
                     "--eval-every", "0", "--no-tensorboard"]) == 0
        captured = capsys.readouterr()
        lines = [line for line in (captured.out + captured.err).splitlines()
                 if "cuDNN's not used" in line]
        if precision == "fp32":
            assert lines == ["coppelius train: attention materialized, cuDNN's not used: fp32 "
                             "policy: cuDNN's and the fused kernels' attention take bfloat16 "
                             "operands"], lines
        else:
            assert lines == []
