"""The memory plan (accelerated/cuda/memory_plan.py, step.memory_plan): the
savings, the same bits with and without it, lifetimes, the logits by
chunks, the gradient's segments, recompute, accumulation."""

import dataclasses
import gc
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coppelius.conformance.cases import random_state
from coppelius.conformance.suite import step_rows
from coppelius.reference.config import Config, Hyper, preset
from coppelius.reference.contract import ProgramReset, ReplayError
from coppelius.reference.program import ReferenceProgram
from coppelius.reference.semantic import semantic_graph
from coppelius.accelerated.cuda import policy, step
from coppelius.accelerated.cuda.buffers import gradient_segments
from coppelius.accelerated.cuda.policy import logits_chunk_rows
from coppelius.accelerated.cuda.program import capture
from coppelius.accelerated.cuda.step import memory_plan
from coppelius.accelerated.cuda.cupy_debug import cudnn_from_batch, fused_from_batch

from .helpers import (CONFIG, B, check_close, check_bitwise, fresh, windows, run_steps,
                      check_same_steps, cupy, need_cudnn)

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


# ------------------------------------------------------------------ memory plan


@pytest.mark.parametrize("precision, batch, accumulate", [
    ("fp32", 2, 1), ("bf16", 4, 1), ("bf16", 4, 2)], ids=["fp32", "bf16", "bf16-accumulate"])
def test_recomputing_the_gate_and_up_products_keeps_every_bit(precision, batch, accumulate):
    """recompute=True: the gate and up products computed again in the
    backward (the forward's norm kernel and product) instead of kept per
    layer: the same row losses, G, P, M, V and held-out losses, bit for
    bit, replay after replay; the plan keeps no per-layer gate and up
    buffers, and the production model's (the dry run) is smaller by at
    least L - 2 of them."""
    state = random_state(CONFIG, seed=43, t=3)
    inputs = windows(3, seed=44, batch=batch)
    kept = capture(CONFIG, Hyper(), precision, batch, state.copy(), accumulate)
    again = capture(CONFIG, Hyper(), precision, batch, state.copy(), accumulate,
                                 recompute=True)
    assert again.recompute and not kept.recompute
    assert "recompute" in again.diagnostics()["notes"]["memory_planning"]
    L = CONFIG.n_layer
    names = {b.name for b in again.plan.buffers}
    assert "acts.gu_back" in names and "acts.gu[1]" not in names
    assert again.plan.arena_bytes <= kept.plan.arena_bytes
    big = preset("coppelius")
    plans = [memory_plan(big, Hyper(), precision, 2, recompute=r) for r in (0, 1)]
    big_gu = 2 * big.context * 2 * big.d_ff * 4
    assert plans[1].arena_bytes <= plans[0].arena_bytes - (big.n_layer - 2) * big_gu
    assert again.recorded["products"] == kept.recorded["products"] + accumulate * L
    check_same_steps(kept, again, inputs)
    held_out = windows(1, seed=45, batch=batch)[0]
    check_bitwise("held-out row losses", again.evaluate(held_out), kept.evaluate(held_out))


@pytest.mark.parametrize("precision, batch, path", [
    ("fp32", 2, "materialized"), ("bf16", 2, "materialized"), ("bf16", 4, "fused"),
    ("bf16", 2, "cudnn")], ids=["fp32", "bf16-materialized", "bf16-fused", "bf16-cudnn"])
def test_memory_plan_saves_memory_and_keeps_every_bit(precision, batch, path, monkeypatch):
    """Buffers sharing storage by lifetime: the same row losses, G, P, M, V
    and held-out losses, bit for bit, as every buffer in its own storage; the
    device bytes fall by exactly the plan's savings."""
    if path == "cudnn":
        need_cudnn()
    state = random_state(CONFIG, seed=31, t=3)
    inputs = windows(3, seed=32, batch=batch)
    force = cudnn_from_batch(1) if path == "cudnn" else fused_from_batch(4)
    with force:
        planned = capture(CONFIG, Hyper(), precision, batch, state.copy())
        assert planned.acts.path.kind == path, planned.acts.path
        monkeypatch.setenv("COPPELIUS_NO_MEMORY_PLAN", "1")
        unplanned = capture(CONFIG, Hyper(), precision, batch, state.copy())
    assert planned.memory_planned and not unplanned.memory_planned
    saved = planned.plan.savings
    assert saved > 0
    assert unplanned.alloc.bytes - planned.alloc.bytes == saved
    assert planned.compilation_report()["device_bytes"] == planned.alloc.bytes
    rows1, _, s1 = check_same_steps(planned, unplanned, inputs)
    assert s1.t == 6
    held_out = windows(1, seed=33, batch=batch)[0]
    check_bitwise("evaluate", planned.evaluate(held_out), unplanned.evaluate(held_out))
    check_bitwise("row losses after evaluate", planned.row_losses(), rows1[-1])
    memory = json.loads(planned.compilation_debug_report_json("plan"))["memory_analysis"]
    assert memory["materialized"] and memory["materialized_savings_bytes"] == saved
    assert memory["unplanned_bytes"] - memory["planned_bytes"] == saved
    stages = {r.stage: r.state for r in planned.compilation_stages()}
    assert stages["memory_planning"] == "applied"
    off = json.loads(unplanned.compilation_debug_report_json("off"))["memory_analysis"]
    assert not off["materialized"] and "COPPELIUS_NO_MEMORY_PLAN" in off["fallback_reason"]


@pytest.mark.parametrize("precision, batch", [("fp32", 2), ("bf16", 4)])
def test_a_family_members_plan_and_recompute_keep_every_bit(precision, batch, monkeypatch):
    """RMSNorm, the q, k, v biases and the untied head under the memory plan
    and with recompute: the same row losses, G, P, M, V, bit for bit, as
    every buffer in its own storage, and as the gate and up products kept;
    no norm means (RMSNorm has none), the biases' partials planned, the
    head's gradient in the final norm's segment, first written by the
    classifier's first chunk."""
    state = random_state(FAMILY, seed=46, t=3)
    inputs = windows(3, seed=47, config=FAMILY, batch=batch)
    planned = capture(FAMILY, Hyper(), precision, batch, state.copy())
    again = capture(FAMILY, Hyper(), precision, batch, state.copy(), recompute=True)
    names = {b.name: b for b in planned.plan.buffers}
    assert not any("mean" in name for name in names) and "acts.rstd1[0]" in names
    assert names["acts.bias_partials"].candidate
    head = next(c.index for c in planned.plan.commands
                if c.operations == ("lm_head.backward",) and c.launch.get("trans_a"))
    assert names["G.final_norm"].first == head
    assert names["G.tok_embedding"].first > head  # the gather gradient alone, after the layers
    monkeypatch.setenv("COPPELIUS_NO_MEMORY_PLAN", "1")
    unplanned = capture(FAMILY, Hyper(), precision, batch, state.copy())
    assert planned.memory_planned and not unplanned.memory_planned
    rows, G, state1 = check_same_steps(planned, unplanned, inputs)
    rows2, G2, state2 = run_steps(again, inputs)
    check_bitwise("row losses (recompute)", rows2, rows)
    check_bitwise("G (recompute)", G2, G)
    for name in "PMV":
        check_bitwise(f"{name} (recompute)", getattr(state2, name), getattr(state1, name))


@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_holds_the_activations_of_a_micro_batch_and_plans_them(k, monkeypatch):
    """SPEC 19: activations of B/k contexts (fewer bytes than the step of B),
    laid out by the plan by the first pass's lifetimes: the same bits as
    every buffer in its own storage."""
    state = random_state(CONFIG, seed=36, t=2)
    inputs = windows(3, seed=37, batch=4)
    whole = capture(CONFIG, Hyper(), "bf16", 4, state.copy())
    planned = capture(CONFIG, Hyper(), "bf16", 4, state.copy(), accumulate=k)
    assert planned.acts.B == 4 // k and planned.micro_batch == 4 // k
    assert planned.memory_planned and planned.plan.savings > 0
    assert planned.plan.arena_bytes < whole.plan.arena_bytes
    monkeypatch.setenv("COPPELIUS_NO_MEMORY_PLAN", "1")
    unplanned = capture(CONFIG, Hyper(), "bf16", 4, state.copy(), accumulate=k)
    assert not unplanned.memory_planned
    rows1, _, _ = check_same_steps(planned, unplanned, inputs)
    held_out = windows(1, seed=38, batch=4)[0]
    check_bitwise("evaluate", planned.evaluate(held_out), unplanned.evaluate(held_out))
    check_bitwise("row losses after evaluate", planned.row_losses(), rows1[-1])


def test_a_plan_that_ignores_lifetimes_is_caught(monkeypatch):
    """The check above can fail: every buffer that may share storage at
    offset 0 of a small arena (storage shared whatever the lifetimes; the
    pinned ones, the norms' address table among them, each after them)
    changes the results."""
    def overlap_everything(buffers, indices, horizon):
        def aligned(n):
            return -(-n // 256) * 256

        end = aligned(max(buffers[i].nbytes for i in indices if buffers[i].candidate))
        for i in indices:
            if buffers[i].candidate:
                buffers[i].offset = 0
            else:
                buffers[i].offset, end = end, end + aligned(buffers[i].nbytes)
        return end

    state = random_state(CONFIG, seed=34, t=1)
    inputs = windows(1, seed=35)
    good = run_steps(capture(CONFIG, Hyper(), "fp32", B, state.copy()), inputs)
    monkeypatch.setattr(step, "place", overlap_everything)
    bad = run_steps(capture(CONFIG, Hyper(), "fp32", B, state.copy()), inputs)
    assert not np.array_equal(good[0], bad[0])


# a member of the model family (SPEC 21): RMSNorm, q, k, v biases, an untied head
FAMILY = Config(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96, norm="rmsnorm",
                tied=False, qkv_bias=True)


@pytest.mark.parametrize("config, batch, precision", [
    (CONFIG, 2, "fp32"), (CONFIG, 4, "bf16"),
    (Config(vocab=37, context=9, d_model=18, n_layer=2, n_head=3, d_ff=13), 3, "bf16"),
    (preset("coppelius"), 32, "bf16"),
    (FAMILY, 2, "fp32"),
    (dataclasses.replace(preset("llama-124m"), n_kv_head=12, qkv_bias=True), 8, "fp32"),
], ids=["test-fp32", "test-fused", "odd", "coppelius-B32", "family-fp32", "llama-bias-fp32-B8"])
def test_memory_plan_shares_storage_only_between_disjoint_lifetimes(config, batch, precision):
    """The plan itself, made by the dry run (no device memory, so even the
    production model at B=32): two activations whose bytes overlap never
    live at once; pinned buffers (host reads, persistent zeros) share
    nothing; the arena is no smaller than the bytes live at once."""
    plan = memory_plan(config, Hyper(), precision, batch)
    acts = [plan.buffers[i] for i in plan.activations]
    # every activation is touched, but the float32 q | k | v where the own product kernel
    # applies the rope (Hopper's default), the float32 da where the down product's dX
    # carries the SwiGLU backward (the own kernels), and of each layer's float32 gate/up products
    # and its mlp norm output h the ones the step does not keep (h where the products are
    # kept; the products where the SwiGLU backward computes them again from h): those
    # take no bytes of their own
    unused = [b for b in acts if b.first is None]
    layers = range(config.n_layer)
    gu, h = ({f"acts.{name}[{l}]" for l in layers} for name in ("gu", "h_mlp"))
    assert {b.name for b in unused} - {"acts.qkv32", "acts.da"} in (gu, h)
    assert all(b.offset == 0 for b in unused)
    acts = [b for b in acts if b.first is not None]
    for i, a in enumerate(acts):
        for b in acts[i + 1:]:
            if a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes:
                assert a.candidate and b.candidate, (a.name, b.name)
                assert a.last < b.first or b.last < a.first, (a.name, b.name)
    pinned = {b.name for b in acts if not b.candidate}
    assert {"acts.ce", "acts.loss"} <= pinned
    horizon = len(plan.commands)
    live = max(sum(b.nbytes for b in acts if not b.candidate or b.first <= t <= b.last)
               for t in range(horizon))
    assert live <= plan.arena_bytes < plan.unplanned_bytes
    assert plan.savings == plan.unplanned_bytes - plan.arena_bytes
    # every command lowers at least one semantic operation of the step
    names = {o.name for o in semantic_graph(config, batch, precision).operations}
    assert all(c.operations and set(c.operations) <= names for c in plan.commands)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**6), st.integers(1, 10**6))
def test_logits_chunk_rows_rule(rows, vocab):
    """At most LOGITS_CHUNK_BYTES of float32 logits (or one row), whole
    128-row tiles where at least one fits, never more rows than there are."""
    n = logits_chunk_rows(rows, vocab)
    fit = policy.LOGITS_CHUNK_BYTES // (4 * vocab)
    assert 1 <= n <= rows
    assert n == 1 or 4 * vocab * n <= policy.LOGITS_CHUNK_BYTES
    if n < rows:  # a chunk as large as the rule allows
        assert n == (fit - fit % 128 if fit >= 128 else max(fit, 1))


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_the_step_never_holds_whole_logits(batch, monkeypatch):
    """The production model's plan (the dry run: no device memory): the
    float32 logits and their bfloat16 gradient are one chunk of rows each,
    every chunk of rows runs its product, its cross-entropy and its two
    backward products, and at the loss the bytes live are those with the
    whole (BT, V) logits and gradient less all but the chunk's rows (the
    arena, packed around them, shrinks by about as much)."""
    config = preset("coppelius")
    BT, V = batch * config.context, config.vocab
    plan = memory_plan(config, Hyper(), "bf16", batch)
    sizes = {b.name: b.nbytes for b in plan.buffers}
    rows = logits_chunk_rows(BT, V)
    assert sizes["acts.logits"] == rows * V * 4 and rows == min(BT, 2048)
    assert sizes["acts.dlogits"] == rows * V * 2  # bfloat16 operands, one chunk's
    assert not any(plan.buffers[i].nbytes >= BT * V * 2 for i in plan.activations) or rows == BT
    ce = [c for c in plan.commands if c.name == "crossentropy_forward_backward"]
    heads = [c for c in plan.commands if c.operations == ("lm_head",)]
    assert len(ce) == len(heads) == -(-BT // rows)
    assert [c.launch["grid"][0] for c in ce] == [min(rows, BT - r) for r in range(0, BT, rows)]
    backward = [c for c in plan.commands
                if c.operations == ("lm_head.backward",) and c.kind == "product"]
    weights = [c for c in backward if c.launch["trans_a"]]  # G_emb (+)= dlogits^T hf
    inputs = [c for c in backward if not c.launch["trans_a"]]  # dh's rows = dlogits W_emb
    assert [c.launch["k"] for c in weights] == [c.launch["grid"][0] for c in ce]
    assert [c.launch["m"] for c in inputs] == [c.launch["grid"][0] for c in ce]
    monkeypatch.setattr(policy, "LOGITS_CHUNK_BYTES", 4 * BT * V)  # one chunk: whole
    whole = memory_plan(config, Hyper(), "bf16", batch)

    def live_at_the_loss(p):  # bytes live at the first cross-entropy
        t = next(c.index for c in p.commands if c.name == "crossentropy_forward_backward")
        return sum(b.nbytes for b in (p.buffers[i] for i in p.activations)
                   if not b.candidate or b.first is not None and b.first <= t <= b.last)

    assert live_at_the_loss(whole) - live_at_the_loss(plan) == (BT - rows) * V * (4 + 2)
    assert whole.arena_bytes > plan.arena_bytes or rows == BT


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_the_production_plan_is_tight_at_the_loss(batch):
    """The production model's plan (the dry run): none of the buffers that
    only the forward or only the backward uses is live at the loss (the
    step's fullest point: every saved activation and dlogits), and the
    arena is within 1% of the bytes live at once."""
    plan = memory_plan(preset("coppelius"), Hyper(), "bf16", batch)
    by_name = {b.name: b for b in plan.buffers}
    loss = [c.index for c in plan.commands if c.name == "crossentropy_forward_backward"]
    for name in ("acts.a", "acts.h", "acts.qkv32", "acts.att_workspace.forward"):
        if name in by_name and by_name[name].first is not None:  # (qkv32: see below)
            assert by_name[name].last < loss[0], (name, by_name[name].last, loss[0])
    for name in ("acts.a_back", "acts.h_back", "acts.att_workspace.backward", "acts.da",
                 "acts.dgu"):
        if name in by_name and by_name[name].first is not None:  # (da: the own kernels')
            assert by_name[name].first > loss[-1], (name, by_name[name].first, loss[-1])
    acts = [plan.buffers[i] for i in plan.activations if plan.buffers[i].first is not None]
    live = max(sum(b.nbytes for b in acts if not b.candidate or b.first <= t <= b.last)
               for t in range(len(plan.commands)))
    assert plan.arena_bytes <= 1.01 * live, (plan.arena_bytes, live)


@pytest.mark.parametrize("batch", [1, 8])
def test_the_fused_rope_leaves_the_float32_qkv_without_bytes(batch, monkeypatch):
    """With the own products (the rope in the q | k | v product's epilogue)
    no command touches the float32 q | k | v: it lies at offset 0 with no
    bytes of its own (held over the whole step, as an untouched buffer was,
    it cost the own products' step its size over the cuBLAS step's), and
    the arena is no larger than the cuBLAS step's (the plan's dry run, on
    any machine)."""
    from coppelius.accelerated.cuda import products

    config = preset("coppelius")
    monkeypatch.setenv(products.ENV, "cublas")
    theirs = memory_plan(config, Hyper(), "bf16", batch)
    monkeypatch.setenv(products.ENV, "own")
    mine = memory_plan(config, Hyper(), "bf16", batch)
    qkv32 = next(b for b in mine.buffers if b.name == "acts.qkv32")
    assert qkv32.first is None and qkv32.offset == 0
    assert next(b for b in theirs.buffers if b.name == "acts.qkv32").first is not None
    assert not any(c.name == "rope_forward" for c in mine.commands)
    assert mine.arena_bytes <= theirs.arena_bytes, (mine.arena_bytes, theirs.arena_bytes)


@pytest.mark.parametrize("batch", [1, 8])
def test_the_gradient_lives_from_its_first_write_to_adamw(batch):
    """The production model's plan (the dry run): G is no state buffer but
    a segment per layer, the embedding's and the final norm's, each in the
    arena from the command that first writes it (the embedding's: the first
    chunk's unembedding product; a layer's: its down weight's gradient, the
    first of its backward), last touched by AdamW and kept to the step's end
    (the host reads it after the replay); at the first chunk's cross-entropy
    none exists."""
    config = preset("coppelius")
    plan = memory_plan(config, Hyper(), "bf16", batch)
    by_name = {b.name: b for b in plan.buffers}
    assert "G" not in by_name and not by_name["G.table"].candidate  # the table: pinned
    adamw = next(c.index for c in plan.commands if c.name == "adamw_update")
    first_emb = next(c.index for c in plan.commands
                     if c.operations == ("lm_head.backward",) and c.launch.get("trans_a"))
    segments = ["G.tok_embedding"] + [f"G.layers.{l}" for l in range(config.n_layer)] + \
        ["G.final_norm"]
    for name, (start, n) in zip(segments, gradient_segments(config)):
        b = by_name[name]
        assert b.kind == "gradient" and b.candidate and b.nbytes == 4 * n, name
        index = plan.buffers.index(b)
        assert max(t for t, touched in enumerate(plan.touches) if index in touched) == adamw
        assert b.last == len(plan.commands) - 1, (name, b.last)
    assert by_name["G.tok_embedding"].first == first_emb
    for l in range(config.n_layer):
        down = next(c.index for c in plan.commands if c.kind == "product"
                    and c.operations == (f"layers.{l}.mlp.down.backward",)
                    and c.launch.get("trans_a"))
        assert by_name[f"G.layers.{l}"].first == down, l
    loss = next(c.index for c in plan.commands if c.name == "crossentropy_forward_backward")
    assert all(by_name[name].first > loss for name in segments)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_step_by_small_chunks_of_logits(monkeypatch, accumulate):
    """Chunks of 7 rows (the last one shorter) against reference.step, the
    held-out losses and the logits of activations() included; with
    accumulate 2, the chunks of each micro-batch's rows."""
    monkeypatch.setattr(policy, "LOGITS_CHUNK_BYTES", 7 * 4 * CONFIG.vocab)
    state = random_state(CONFIG, seed=23, t=4)
    tokens = windows(1, seed=24)[0]
    program = capture(CONFIG, Hyper(), "bf16", B, state.copy(), accumulate)
    rows = B // accumulate * CONFIG.context
    assert program.acts.logits.shape == (7, CONFIG.vocab) and rows % 7
    assert program.acts.dlogits.shape == (7, CONFIG.vocab)
    seen = program.activations(tokens)
    check_close("activations' logits", seen["logits"], program.logits(tokens[:, :-1]), 1e-2)
    want = ReferenceProgram(CONFIG, Hyper(), "bf16", B, state.copy()).activations(tokens)
    for name in ("dlogits", "final_norm.dout"):
        check_close(f"activations' {name}", seen[name], want[name], 1e-2)
    rows = step_rows(program, CONFIG, Hyper(), "bf16", state, tokens)
    failures = [r for r in rows if not r.passed]
    assert not failures, "\n".join(f"{r.check} {r.tensor}: {r.error:.3e}" for r in failures)
    held_out = windows(1, seed=25)[0]
    # step_rows evaluated after the step: with accumulate 1 that took G's storage
    gradients = program.gradients() if accumulate > 1 else None
    want = ReferenceProgram(CONFIG, Hyper(), "bf16", B, program.state()).evaluate(held_out)
    check_close("held-out row losses", program.evaluate(held_out), want, 1e-2)
    if accumulate == 1:
        # G's segments share the arena with the activations the evaluation used
        with pytest.raises(ReplayError, match="evaluate"):
            program.gradients()
        program.upload_input(tokens)  # the next step's G is readable again
        program.replay_and_wait()
        assert np.isfinite(program.gradients()).all()
    else:
        # G carries the micro-batches' sum in a buffer of its own: the
        # evaluation runs the classifier's chunks without their backward
        check_bitwise("gradients after an evaluation", program.gradients(), gradients)


def test_reset_returns_the_device_memory():
    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    program = capture(CONFIG, Hyper(), "bf16", B, fresh())
    program.upload_input(windows(1)[0])
    program.replay()
    held = pool.used_bytes() - before
    assert held >= program.compilation_report()["device_bytes"]
    program.reset()
    gc.collect()
    assert pool.used_bytes() - before < held / 100, (pool.used_bytes() - before, held)
    with pytest.raises(ProgramReset):
        program.state()
