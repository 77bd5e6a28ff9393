"""Data parallelism (SPEC 19) on the CPU emulation of the CUDA backend
(dev/cuda/emulate.py): the ranks are threads of one process, each with its
own stream and captured graph, their NCCL the emulator's in-process
stand-in, their control channel real sockets on localhost (the TCP
rendezvous of coppelius/launch.py).

`test_on_the_emulated_backend` runs this file under the emulator in a new
process; there the other tests run (and are skipped elsewhere). They check
the W-rank run against the one-rank run of the same global batch (SPEC 14
tolerances) and against the reference's step, exact resume with the same
W, a W=2 checkpoint resumed on W=1, which contexts each rank trains on, the
order of the gathered row losses, that rank 0 alone writes, the refusal of
a plan on every rank, and that a rank that raises ends the others."""

import os
import shutil
import threading
import time

import numpy as np
import pytest

from tests.support import (EMULATED, inside, on_threads, pattern_stream,
                           run_inside_the_emulator)

def test_on_the_emulated_backend():
    run_inside_the_emulator(__file__, timeout=600)


# ---------------------------------------------------------------- inside the emulator

if EMULATED:
    from coppelius import cli, reference, train
    from coppelius import launch as ranks
    from coppelius.accelerated.cuda import distributed
    from coppelius.accelerated.cuda.program import CupyProgram, capture
    from coppelius.conformance.tolerances import relative_error, tolerance
    from coppelius.reference import results
    from coppelius.reference.binding import load_state
    from coppelius.reference.config import PRESETS, Hyper
    from coppelius.reference.errors import RunError
    from coppelius.reference.params import initialize
    from coppelius.reference.state import State
    from coppelius.reference.stream import open_stream

    CFG = PRESETS["test"]
B = 4  # the global batch: b = 2 contexts per rank


@pytest.fixture
def stream(tmp_path):
    """80 contexts of the test preset, each context's ids recognisable."""
    return pattern_stream(tmp_path / "s.tokens", CFG, 80, noise=0.2)


def train_argv(stream, run_dir, *extra, precision="fp32"):
    return ["train", "--preset", "test", "--backend", "cupy", "--precision", precision,
            "--stream", stream, "--run-dir", str(run_dir), "--checkpoint",
            str(run_dir / "ck.bin"), "--no-sample", "--batch", str(B), "--eval-contexts", "8",
            *extra]


def one_rank(argv):
    return cli.main(argv)


def ranks_run(argvs, timeout=60):
    """Run rank r of len(argvs) with argvs[r] on a thread each: exit statuses."""
    world = len(argvs)
    port = ranks.free_port()
    statuses = [None] * world

    def one(r):
        args = cli.build_parser().parse_args(argvs[r])
        args.argv = argvs[r]
        launch = ranks.Launch(r, world, None, "127.0.0.1", port, "torchrun")
        statuses[r] = train.run_rank(args, launch, hard_exit=False)

    threads = [threading.Thread(target=one, args=(r,), name=f"rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank did not end"
    return statuses


def step_rows(path):
    r = results.read_results(path)
    assert r.stopped is None, r.stopped
    return r


def errors(text):
    return [line for line in text.splitlines() if "error" in line]


@inside
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_ranks_agree_with_one_of_the_same_global_batch(tmp_path, stream, precision):
    a, b = tmp_path / "a", tmp_path / "b"
    extra = ["--steps", "6", "--interval", "3", "--eval-every", "3"]
    assert one_rank(train_argv(stream, a, *extra, precision=precision)) == 0
    assert ranks_run([train_argv(stream, b, *extra, precision=precision)] * 2) == [0, 0]
    one, two = step_rows(a / "results-0.bin"), step_rows(b / "results-0.bin")
    assert [s for s, _ in two.steps] == [s for s, _ in one.steps] == list(range(6))
    got = np.stack([x for _, x in two.steps])  # (S, B, T): every rank's rows, gathered
    want = np.stack([x for _, x in one.steps])
    assert relative_error(got, want)[0] <= tolerance("trajectory", precision)
    ev1, ev2 = [e for e in one.evals], [e for e in two.evals]
    assert [e[0] for e in ev2] == [e[0] for e in ev1] == [3, 6]  # evaluated together
    for x, y in zip(ev1, ev2):  # the parameters of steps 3 and 6: a trajectory's tolerance
        assert relative_error(x[-1], y[-1])[0] <= tolerance("trajectory", precision)
    A, Bst = load_state(str(a / "ck.bin"), CFG), load_state(str(b / "ck.bin"), CFG)
    assert (Bst.step, Bst.contexts) == (A.step, A.contexts) == (6, 6 * B)
    for name in "PMV":
        err = relative_error(getattr(Bst.state, name), getattr(A.state, name))[0]
        assert err <= tolerance("trajectory", precision), (name, err)


@inside
def test_two_rank_resume_is_exact_and_resumes_on_one_rank(tmp_path, stream):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    # W=2: 3 + 3 steps in two invocations against 6 in one: the same bytes
    assert ranks_run([train_argv(stream, a, "--steps", "3", "--interval", "2")] * 2) == [0, 0]
    shutil.copytree(a, c)  # the step-3 checkpoint, for W=1 below
    (c / "run.json").unlink()  # a's run (it names a's checkpoint); the copy is a run of its own
    assert ranks_run([train_argv(stream, a, "--steps", "3")] * 2) == [0, 0]
    assert ranks_run([train_argv(stream, b, "--steps", "6")] * 2) == [0, 0]
    assert (a / "ck.bin").read_bytes() == (b / "ck.bin").read_bytes()
    split = step_rows(a / "results-0.bin").steps + step_rows(a / "results-3.bin").steps
    whole = step_rows(b / "results-0.bin").steps
    assert [s for s, _ in split] == [s for s, _ in whole] == list(range(6))
    for (_, x), (_, y) in zip(split, whole):
        assert x.tobytes() == y.tobytes()
    # the W=2 checkpoint (a checkpoint records no W) goes on on one rank
    assert one_rank(train_argv(stream, c, "--steps", "3")) == 0
    got, want = load_state(str(c / "ck.bin"), CFG), load_state(str(b / "ck.bin"), CFG)
    assert (got.step, got.contexts) == (6, 6 * B)
    assert relative_error(got.state.P, want.state.P)[0] <= tolerance("trajectory", "fp32")
    rows = np.stack([x for _, x in step_rows(c / "results-3.bin").steps])
    assert relative_error(rows, np.stack([x for _, x in whole[3:]]))[0] <= \
        tolerance("trajectory", "fp32")


@inside
def test_each_rank_trains_on_its_contexts(tmp_path, stream, monkeypatch):
    """Rank r, step s: contexts c0 + s*B + r*b + j, j < b (SPEC 19), with
    c0 the contexts the checkpoint consumed."""
    seen = []
    submit = CupyProgram.submit

    def recording(self, tokens):  # the run loop's upload and replay
        submitted = submit(self, tokens)
        seen.append((self.rank, self.replays - 1, self.ids.get().copy()))
        return submitted

    monkeypatch.setattr(CupyProgram, "submit", recording)
    a = tmp_path / "a"
    assert ranks_run([train_argv(stream, a, "--steps", "2")] * 2) == [0, 0]
    seen.clear()
    assert ranks_run([train_argv(stream, a, "--steps", "3")] * 2) == [0, 0]
    s_ = open_stream(stream, CFG.vocab)
    T, b, c0 = CFG.context, B // 2, 2 * B
    assert sorted((r, s) for r, s, _ in seen) == [(r, s) for r in range(2) for s in range(3)]
    for r, s, slot in seen:
        want = s_.contexts(np.arange(c0 + s * B + r * b, c0 + s * B + r * b + b), T)
        assert np.array_equal(slot, want), (r, s)


def _programs(world, hyper, precision, state, batch=None, accumulate=None):
    """One program per rank on threads, with the in-process NCCL: [program]."""
    uid = distributed.new_unique_id()
    out = [None] * world

    def one(r):
        comm = distributed.Communicator(uid, r, world)
        out[r] = capture(CFG, hyper, precision, batch or B, state.copy(),
                                      accumulate, comm=comm)

    on_threads(world, one, timeout=60)
    return out


@inside
@pytest.mark.parametrize("accumulate", [1, 2])
def test_row_losses_are_gathered_in_batch_order(accumulate):
    """Two ranks of B = 4 (b = 2 each, in 1 or 2 micro-batches): every rank
    returns all B rows in batch order -- each rank's own rows in its slice,
    bitwise -- and they, the loss, the gradient and the update agree with
    the reference's step of the whole batch."""
    hyper = Hyper()
    state = State.fresh(initialize(CFG))
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, CFG.vocab, (B, CFG.context + 1))
    programs = _programs(2, hyper, "fp32", state, accumulate=accumulate)
    out = [None, None]

    def step(r):
        p = programs[r]
        p.upload_input(tokens)
        loss = p.replay_and_wait()
        out[r] = (loss, p.row_losses(), p.buffers.rows.get().reshape(B // 2, -1), p.gradients(),
                  p.state())

    on_threads(2, step, timeout=60)
    want = reference.step(CFG, state.copy(), tokens, "fp32", hyper, grads=True)
    for r, (loss, rows, own, G, after) in enumerate(out):
        assert rows.shape == (B, CFG.context)
        assert rows[r * 2:(r + 1) * 2].tobytes() == own.tobytes()  # the rank's own, in place
        assert relative_error(rows, want.row_losses)[0] <= tolerance("row_losses", "fp32")
        assert relative_error(np.float32(loss), want.loss)[0] <= tolerance("loss", "fp32")
        assert relative_error(G, want.grads)[0] <= tolerance("gradient", "fp32")
        assert relative_error(after.P, want.state.P)[0] <= tolerance("update", "fp32")
    # every rank holds the same bits: the same update on the same parameters
    assert out[0][1].tobytes() == out[1][1].tobytes()
    assert out[0][3].tobytes() == out[1][3].tobytes()
    assert out[0][4].P.tobytes() == out[1][4].P.tobytes()
    # the held-out evaluation gathers the same way (SPEC 18)
    got = [None, None]
    on_threads(2, lambda r: got.__setitem__(r, programs[r].evaluate(tokens[::-1])), timeout=60)
    want = reference.row_losses(CFG, out[0][4].P, tokens[::-1], "fp32")
    for r in range(2):
        assert relative_error(got[r], want)[0] <= tolerance("eval", "fp32")


@inside
def test_the_report_shows_the_ranks_and_their_collectives():
    program = _programs(2, Hyper(), "fp32", State.fresh(initialize(CFG)))[0]
    report = program.compilation_report()
    assert (report["world"], report["rank"], report["collectives"]) == (2, 0, 3)
    assert report["batch"] == B and program.micro_batch == B // 2
    notes = {s["stage"]: s for s in report["stages"]}
    assert notes["command_recording"]["state"] == "applied"


@inside
def test_rank_zero_alone_writes(tmp_path, stream):
    """Rank 1 is given run directory and checkpoint paths of its own: after
    a run with a checkpoint, a result file, run.json and held-out
    evaluations, nothing exists there."""
    a, elsewhere = tmp_path / "a", tmp_path / "rank1"
    argv = ["--steps", "4", "--interval", "2", "--eval-every", "2"]
    before = sorted(os.listdir(tmp_path))
    assert ranks_run([train_argv(stream, a, *argv), train_argv(stream, elsewhere, *argv)]) \
        == [0, 0]
    assert sorted(os.listdir(a)) == ["ck.bin", "results-0.bin", "results-0.png", "run.json",
                                     "tb"]
    assert len(os.listdir(a / "tb")) == 1  # rank 0's event file alone
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(a / "tb"))
    events.Reload()
    memory = [e.value for e in events.Scalars("train/device_memory_gib")]  # the CuPy pool's
    assert len(memory) == 4 and min(memory) > 0
    assert [e.step for e in events.Scalars("train/loss")] == [0, 1, 2, 3]
    assert not elsewhere.exists()
    assert sorted(os.listdir(tmp_path)) == sorted(before + ["a"])


@inside
def test_a_refused_plan_is_refused_on_every_rank_in_one_line(tmp_path, stream, capsys):
    a = tmp_path / "a"
    # a batch that does not split over the ranks: rank 0 refuses, rank 1 obeys
    assert ranks_run([train_argv(stream, a, "--steps", "2", "--batch", "3")] * 2) == [2, 2]
    err = capsys.readouterr()
    lines = errors(err.out + err.err)
    assert len(lines) == 1 and "--batch=3: must divide by 2 GPUs" in lines[0], lines
    # another learner on rank 1: rank 1 refuses, rank 0 says so, naming it
    assert ranks_run([train_argv(stream, a, "--steps", "2"),
                      train_argv(stream, a, "--steps", "2", "--lr", "1/1000")]) == [2, 2]
    err = capsys.readouterr()
    lines = errors(err.out + err.err)
    assert len(lines) == 1 and "rank 1: its learner identity" in lines[0], lines
    assert "lr=1/1000" in lines[0] and "lr=3/10000" in lines[0]
    assert not (a / "run.json").exists() and not (a / "ck.bin").exists()


@inside
def test_a_rank_that_raises_ends_every_rank_quickly(tmp_path, stream, monkeypatch, capsys):
    submit = CupyProgram.submit

    def failing(self, tokens):
        if self.rank == 1 and self.replays == 3:
            raise RunError("the injected failure")
        return submit(self, tokens)

    monkeypatch.setattr(CupyProgram, "submit", failing)
    a = tmp_path / "a"
    t0 = time.monotonic()
    statuses = ranks_run([train_argv(stream, a, "--steps", "8", "--interval", "2")] * 2,
                         timeout=30)
    assert time.monotonic() - t0 < 20
    assert statuses == [2, 2]
    err = capsys.readouterr()
    lines = errors(err.out + err.err)
    assert len(lines) == 2, lines  # the failed rank's line, and rank 0's (no --gpus parent here)
    assert any(line.endswith("rank 1: the injected failure") for line in lines), lines
    assert any("stopped: rank 1 failed: the injected failure" in line for line in lines), lines
    ck = load_state(str(a / "ck.bin"), CFG)  # the last published checkpoint, valid
    assert (ck.step, ck.contexts) == (2, 2 * B)


@inside
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path, stream,
                                                                   monkeypatch, capsys):
    """SIGTERM reaches rank 1 alone, after its third step was submitted: its
    vote goes with its next step, every rank reads the summed count with
    that step's records, and all stop after the same step, rank 0
    publishing it."""
    signalled = threading.Event()
    submit = CupyProgram.submit

    def counting(self, tokens):
        submitted = submit(self, tokens)
        if self.rank == 1 and self.replays == 3:
            signalled.set()
        return submitted

    class OnRankOne(train.Stopper):
        @property
        def signum(self):
            mine = threading.current_thread().name == "rank-1"
            return 15 if mine and signalled.is_set() else None

        @signum.setter
        def signum(self, value):
            pass

    monkeypatch.setattr(CupyProgram, "submit", counting)
    monkeypatch.setattr(train, "Stopper", OnRankOne)
    a = tmp_path / "a"
    assert ranks_run([train_argv(stream, a, "--steps", "16", "--interval", "50")] * 2) \
        == [128 + 15] * 2
    ck = load_state(str(a / "ck.bin"), CFG)
    steps = step_rows(a / "results-0.bin").steps
    assert 3 <= ck.step < 16 and len(steps) == ck.step and ck.contexts == ck.step * B
    err = capsys.readouterr().err
    assert err.count(f"stopped by signal 15 after {ck.step} steps") == 1  # rank 0's line


@inside
@pytest.mark.parametrize("extra", [[], ["--recompute"], ["--recompute", "block"],
                                   ["--shard-optimizer"]],
                         ids=["kept", "recompute", "block", "sharded"])
def test_bench_times_two_ranks_against_one(capsys, extra):
    from coppelius.bench import distributed as bench_gpus

    port = ranks.free_port()
    argv = ["bench", "--gpus", "2", "--preset", "test", "--batch", "2", "--steps", "2",
            "--warmup", "1", "--precision", "fp32", *extra]
    statuses = [None, None]

    def one(r):
        args = cli.build_parser().parse_args(argv)
        statuses[r] = bench_gpus.bench_rank(args, ranks.Launch(r, 2, None, "127.0.0.1", port,
                                                               "torchrun"), hard_exit=False)

    on_threads(2, one, timeout=60)
    assert statuses == [0, 0]
    out = capsys.readouterr().out.splitlines()
    one_gpu = next(line for line in out if line.startswith("1 GPU "))
    two_gpus = next(line for line in out if line.startswith("2 GPUs "))
    assert one_gpu.split()[2] == "2" and two_gpus.split()[2] == "4"  # b, then B = 2b
    assert any(line.startswith("scaling: ") for line in out)
    header = next(line for line in out if line.startswith("coppelius bench --gpus 2:"))
    assert ("recomputed" in header) == (extra[:1] == ["--recompute"])
    assert ("each layer recomputed" in header) == (extra == ["--recompute", "block"])
    assert ("optimizer state sharded" in header) == (extra == ["--shard-optimizer"])
