"""Recomputation of each layer's whole forward in the backward (recompute
"block", docs/SPEC.md "Reading: recomputation"): only each layer's input
is kept, the backward runs the layer's forward again into buffers every
layer shares, and the step's bits are those of the step that keeps every
activation, for every family preset, attention path and accumulation; the
memory plan, a dry run of that step, is smaller where layers dominate."""

import json

import numpy as np
import pytest

from coppelius.conformance.cases import random_state
from coppelius.reference.config import Hyper, preset
from coppelius.accelerated.cuda.cupy_debug import cudnn_from_batch, fused_from_batch
from coppelius.accelerated.cuda.program import capture
from coppelius.accelerated.cuda.step import memory_plan

from .helpers import check_bitwise, need_cudnn, run_steps, windows

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]

FAMILIES = ["test", "test-llama", "test-qwen", "test-stablelm"]
# (precision, attention path, batch): fp32 has the materialized scores only;
# under bf16 the project's fused kernels and cuDNN's, each forced at a small batch
PATHS = [("fp32", "materialized", 2), ("bf16", "fused", 4), ("bf16", "cudnn", 2)]


def peak_bytes(plan) -> int:
    """The most activation bytes live at any command of the plan's dry
    run, summed again from each buffer's lifetime (a buffer that may not
    share storage lives over the whole step)."""
    n = len(plan.commands)
    live = np.zeros(n + 1, dtype=np.int64)
    for i in plan.activations:
        b = plan.buffers[i]
        first, last = (0, n - 1) if not b.candidate or b.first is None else (b.first, b.last)
        live[first] += b.nbytes
        live[last + 1] -= b.nbytes
    return int(np.cumsum(live).max())


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("precision, path, batch", PATHS, ids=[p[1] for p in PATHS])
def test_recomputing_each_block_keeps_every_bit(name, precision, path, batch):
    """recompute="block": after 2 steps the same row losses (each step's),
    G, P, M, V and held-out losses, bit for bit, as the step that keeps
    every activation; each
    layer's forward runs twice (its products counted again), and the plan
    keeps one buffer of each per-layer activation but the layers' inputs."""
    if path == "cudnn":
        need_cudnn()
    config = preset(name)
    state = random_state(config, seed=51, t=3)
    inputs = windows(2, seed=52, config=config, batch=batch)
    with cudnn_from_batch(1) if path == "cudnn" else fused_from_batch(4):
        kept = capture(config, Hyper(), precision, batch, state.copy())
        again = capture(config, Hyper(), precision, batch, state.copy(), recompute="block")
    assert kept.acts.path.kind == again.acts.path.kind == path
    assert again.recompute == "block" and kept.recompute is None
    assert "recompute block" in again.diagnostics()["notes"]["memory_planning"]
    L = config.n_layer
    names = {b.name for b in again.plan.buffers}
    assert {f"acts.x[{l}]" for l in range(L + 1)} <= names
    buffers = {b.name: b for b in again.plan.buffers}
    loss = next(c.index for c in again.plan.commands if "loss" in c.operations)
    for kept_once in ("y", "qkv", "x_mid", "gu"):  # the forward's, and the backward's own
        assert {f"acts.{kept_once}[0]", f"acts.{kept_once}_back[0]"} <= names
        assert not {f"acts.{kept_once}[1]", f"acts.{kept_once}_back[1]"} & names
        # neither live at the loss: the forward's dies before, the backward's is born after
        assert buffers[f"acts.{kept_once}[0]"].last < loss < buffers[
            f"acts.{kept_once}_back[0]"].first
    # per layer again: the q | k | v, o and gate | up products (and, on the
    # materialized path, the attention's two per batch element and group member)
    assert again.recorded["products"] >= kept.recorded["products"] + 3 * L
    rows1, G1, s1 = run_steps(kept, inputs)
    rows2, G2, s2 = run_steps(again, inputs)
    check_bitwise("row losses", rows2, rows1)
    check_bitwise("G", G2, G1)
    for part in "PMV":
        check_bitwise(part, getattr(s2, part), getattr(s1, part))
    assert s1.t == s2.t == 5
    held_out = windows(1, seed=55, config=config, batch=batch)[0]
    check_bitwise("held-out row losses", again.evaluate(held_out), kept.evaluate(held_out))


@pytest.mark.parametrize("precision, batch", [("fp32", 4), ("bf16", 4)])
def test_recomputing_each_block_with_accumulation_keeps_every_bit(precision, batch):
    """SPEC 19's micro-batches (k = 2), each pass recomputing its layers:
    the same bits as the accumulated step that keeps them."""
    config = preset("test-qwen")
    state = random_state(config, seed=53, t=1)
    inputs = windows(2, seed=54, config=config, batch=batch)
    kept = capture(config, Hyper(), precision, batch, state.copy(), 2)
    again = capture(config, Hyper(), precision, batch, state.copy(), 2, recompute="block")
    rows1, G1, s1 = run_steps(kept, inputs)
    rows2, G2, s2 = run_steps(again, inputs)
    check_bitwise("row losses", rows2, rows1)
    check_bitwise("G", G2, G1)
    for part in "PMV":
        check_bitwise(part, getattr(s2, part), getattr(s1, part))


@pytest.mark.parametrize("name, precision, batch", [("tiny", "fp32", 4), ("tiny", "bf16", 8)])
def test_recomputing_each_block_makes_the_plan_smaller(name, precision, batch):
    """Where the layers' activations dominate (4 layers, T = 256): the plan's
    peak, and its arena, with block below both without recompute and with
    gate-up; without recompute the peak holds at least every layer's
    q | k | v operands and y beyond one layer's, which block does not keep."""
    config = preset(name)
    plans = {mode: memory_plan(config, Hyper(), precision, batch, recompute=mode)
             for mode in (None, "gate-up", "block")}
    peaks = {mode: peak_bytes(plan) for mode, plan in plans.items()}
    print(name, precision, batch, {m: (peaks[m], plans[m].arena_bytes) for m in plans})
    assert peaks["block"] < peaks["gate-up"] < peaks[None]
    assert plans["block"].arena_bytes < plans[None].arena_bytes
    BT, op = batch * config.context, 2 if precision == "bf16" else 4
    layer = BT * (config.n_head * config.head_dim + 2 * config.kv_dim + config.d_model) * op
    assert peaks[None] - peaks["block"] >= (config.n_layer - 1) * layer


def test_train_recompute_block_runs_and_gives_the_checkpoint_of_the_run_that_keeps_all(
        tmp_path, capsys):
    """`coppelius train --backend cupy --recompute block`: run.json
    remembers block, the header line says so, and the checkpoint after 2
    steps is byte for byte the one of the same run without recompute."""
    from coppelius.cli import main
    from tests.support import pattern_stream

    stream = pattern_stream(tmp_path / "s.tokens", preset("test"), 12, noise=0.1)
    checkpoints = []
    for name, extra in (("kept", []), ("block", ["--recompute", "block"])):
        run = tmp_path / name
        argv = ["train", "--preset", "test", "--backend", "cupy", "--precision", "bf16",
                "--batch", "2", "--stream", str(stream), "--run-dir", str(run),
                "--checkpoint", str(run / "ck.bin"), "--until", "2", "--no-sample",
                "--eval-every", "0", "--no-tensorboard", *extra]
        assert main(argv) == 0
        captured = capsys.readouterr()
        out = captured.out + captured.err
        assert ("each layer recomputed in the backward" in out) == bool(extra), out
        remembered = json.loads((run / "run.json").read_text())["options"]
        assert remembered.get("recompute") == (extra[1] if extra else None)
        checkpoints.append((run / "ck.bin").read_bytes())
    assert checkpoints[0] == checkpoints[1]
