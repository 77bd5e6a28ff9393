"""Sharded optimizer state (`--shard-optimizer`, SPEC 23) on the CPU
emulation of the CUDA backend (dev/cuda/emulate.py), two ranks as threads
as in tests/test_data_parallel_emulated.py, which this file borrows its
helpers from; and the option's no-op on a backend without ranks.

Without clipping the sharded step's gradient sum and AdamW are the
unsharded step's, element by element (W = 2: one rounded addition either
way), so its checkpoint is the unsharded run's file, byte for byte; the
norm alone is summed in another order (recorded within tolerance). With
clipping the scale may differ in its last bit: within SPEC 14's
tolerances. Against one rank of the same global batch: SPEC 14's
trajectory tolerance. Then determinism, exact resume, resume across
sharded and unsharded, a failing rank, and a vector of N parameters that
three ranks do not divide (the last shard shorter)."""

import dataclasses
import json
import time

import numpy as np
import pytest

from tests.support import (EMULATED, inside, on_threads, pattern_stream,
                           run_inside_the_emulator)

def test_on_the_emulated_backend():
    run_inside_the_emulator(__file__, timeout=900)


from coppelius import cli  # noqa: E402
from coppelius.reference.binding import load_state  # noqa: E402
from coppelius.reference.config import PRESETS, Hyper  # noqa: E402

CFG = PRESETS["test"]

if EMULATED:
    from coppelius.accelerated.cuda import adamw, distributed
    from coppelius.accelerated.cuda.program import CupyProgram, capture
    from coppelius.conformance.tolerances import relative_error, tolerance
    from coppelius.reference.errors import RunError
    from coppelius.reference.params import initialize, registry
    from coppelius.reference.state import State
    from tests.test_data_parallel_emulated import (B, errors, one_rank, ranks_run, step_rows,
                                                   train_argv)


@pytest.fixture
def stream(tmp_path):
    """80 contexts of the test preset, each context's ids recognisable."""
    return pattern_stream(tmp_path / "s.tokens", CFG, 80, noise=0.2)


def rows_of(path):
    return np.stack([x for _, x in step_rows(path).steps])


def close(a, b, what, precision="fp32"):
    err = relative_error(a, b)[0]
    assert err <= tolerance(what, precision), (what, err)


SHARD = "--shard-optimizer"


@inside
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sharded_run_is_the_unsharded_one_and_agrees_with_one_rank(tmp_path, stream,
                                                                     precision):
    one, whole, sharded = tmp_path / "one", tmp_path / "whole", tmp_path / "sharded"
    extra = ["--until", "4", "--interval", "2"]  # a fresh run: 4 steps, its settings remembered
    assert one_rank(train_argv(stream, one, *extra, precision=precision)) == 0
    assert ranks_run([train_argv(stream, whole, *extra, precision=precision)] * 2) == [0, 0]
    assert ranks_run([train_argv(stream, sharded, *extra, SHARD, precision=precision)] * 2) \
        == [0, 0]
    # the same file as the unsharded run's (no clipping: the same update, element by element)
    assert (sharded / "ck.bin").read_bytes() == (whole / "ck.bin").read_bytes()
    assert rows_of(sharded / "results-0.bin").tobytes() == rows_of(whole / "results-0.bin").tobytes()
    # the norm: every rank's shard's partial sums, in another order than the whole G's
    got, want = step_rows(sharded / "results-0.bin"), step_rows(whole / "results-0.bin")
    assert got.norm_steps.tolist() == want.norm_steps.tolist() == list(range(4))
    close(got.norm_values, want.norm_values, "gradient", precision)
    # against one rank of the same global batch: a trajectory's tolerance
    close(rows_of(sharded / "results-0.bin"), rows_of(one / "results-0.bin"), "trajectory",
          precision)
    A, S = load_state(str(one / "ck.bin"), CFG), load_state(str(sharded / "ck.bin"), CFG)
    assert (S.step, S.contexts) == (A.step, A.contexts) == (4, 4 * B)  # a normal checkpoint
    for name in "PMV":
        close(getattr(S.state, name), getattr(A.state, name), "trajectory", precision)
    assert json.loads((sharded / "run.json").read_text())["options"]["shard_optimizer"] is True


@inside
def test_clipped_sharded_runs_agree_and_are_deterministic(tmp_path, stream):
    """--clip small enough to act on every step: the clip scale comes from
    the gathered partials, the same on both ranks and in every run."""
    whole, a, b = tmp_path / "whole", tmp_path / "a", tmp_path / "b"
    extra = ["--steps", "3", "--clip", "1/100"]
    assert ranks_run([train_argv(stream, whole, *extra)] * 2) == [0, 0]
    assert ranks_run([train_argv(stream, a, *extra, SHARD)] * 2) == [0, 0]
    assert ranks_run([train_argv(stream, b, *extra, SHARD)] * 2) == [0, 0]
    assert (a / "ck.bin").read_bytes() == (b / "ck.bin").read_bytes()
    assert rows_of(a / "results-0.bin").tobytes() == rows_of(b / "results-0.bin").tobytes()
    assert step_rows(a / "results-0.bin").norm_values.tobytes() == \
        step_rows(b / "results-0.bin").norm_values.tobytes()
    assert (step_rows(a / "results-0.bin").norm_values > 1 / 100).all()  # it clipped
    W, S = load_state(str(whole / "ck.bin"), CFG), load_state(str(a / "ck.bin"), CFG)
    for name in "PMV":
        close(getattr(S.state, name), getattr(W.state, name), "update")


@inside
def test_resume_is_exact_and_crosses_between_sharded_and_unsharded(tmp_path, stream, capsys):
    """Sharded 2 + 2 steps against 4 in one invocation: the same bytes.
    run.json remembers the switch; --no-shard-optimizer turns it off, and
    the run goes on unsharded from the sharded checkpoint (and the other
    way round), the same bytes as staying sharded: without clipping the
    update is the same either way."""
    split, whole, mixed, back = (tmp_path / n for n in ("split", "whole", "mixed", "back"))
    # remembered when given without --steps (SPEC 9, Reading)
    assert ranks_run([train_argv(stream, split, "--until", "2", SHARD)] * 2) == [0, 0]
    assert ranks_run([train_argv(stream, split, "--steps", "2")] * 2) == [0, 0]  # remembered
    assert ranks_run([train_argv(stream, whole, "--steps", "4", SHARD)] * 2) == [0, 0]
    out = "".join(capsys.readouterr())
    assert out.count("optimizer state sharded (1/2 of M and V a rank)") == 3, out
    assert (split / "ck.bin").read_bytes() == (whole / "ck.bin").read_bytes()
    got = np.concatenate([rows_of(split / "results-0.bin"), rows_of(split / "results-2.bin")])
    assert got.tobytes() == rows_of(whole / "results-0.bin").tobytes()
    # sharded, then unsharded; unsharded, then sharded
    assert ranks_run([train_argv(stream, mixed, "--until", "2", SHARD)] * 2) == [0, 0]
    assert ranks_run([train_argv(stream, mixed, "--until", "4", "--no-shard-optimizer")] * 2) \
        == [0, 0]
    assert json.loads((mixed / "run.json").read_text())["options"]["shard_optimizer"] is False
    assert ranks_run([train_argv(stream, back, "--steps", "2")] * 2) == [0, 0]
    assert ranks_run([train_argv(stream, back, "--steps", "2", SHARD)] * 2) == [0, 0]
    out = "".join(capsys.readouterr())
    assert out.count("optimizer state sharded") == 2, out
    for run in (mixed, back):
        assert (run / "ck.bin").read_bytes() == (whole / "ck.bin").read_bytes(), run
    # and on one rank, where there is nothing to shard: the option is remembered, a no-op
    one = tmp_path / "one"
    assert one_rank(train_argv(stream, one, "--steps", "2", SHARD)) == 0
    assert "sharded" not in "".join(capsys.readouterr())


@inside
def test_a_failing_sharded_rank_ends_both(tmp_path, stream, monkeypatch, capsys):
    submit = CupyProgram.submit

    def failing(self, tokens):
        if self.rank == 1 and self.replays == 3:
            raise RunError("the injected failure")
        return submit(self, tokens)

    monkeypatch.setattr(CupyProgram, "submit", failing)
    a = tmp_path / "a"
    t0 = time.monotonic()
    statuses = ranks_run([train_argv(stream, a, "--steps", "8", "--interval", "2", SHARD)] * 2,
                         timeout=30)
    assert time.monotonic() - t0 < 20
    assert statuses == [2, 2]
    lines = errors("".join(capsys.readouterr()))
    assert any(line.endswith("rank 1: the injected failure") for line in lines), lines
    assert any("stopped: rank 1 failed: the injected failure" in line for line in lines), lines
    ck = load_state(str(a / "ck.bin"), CFG)  # the last published checkpoint: gathered, valid
    assert (ck.step, ck.contexts) == (2, 2 * B)


@inside
def test_ranks_that_disagree_on_sharding_are_refused(tmp_path, stream, capsys):
    """Each rank's step must pair its collectives with the others': a plan
    that shards on one rank alone is refused by every rank, in one line."""
    a = tmp_path / "a"
    assert ranks_run([train_argv(stream, a, "--steps", "2"),
                      train_argv(stream, a, "--steps", "2", SHARD)]) == [2, 2]
    lines = errors("".join(capsys.readouterr()))
    assert len(lines) == 1 and "rank 1: its plan has shard_optimizer True, rank 0's False" \
        in lines[0], lines
    assert not (a / "ck.bin").exists()


def _programs(config, world, precision, state, hyper, shard, batch=None, accumulate=None):
    uid = distributed.new_unique_id()
    out = [None] * world

    def one(r):
        comm = distributed.Communicator(uid, r, world)
        out[r] = capture(config, hyper, precision, batch or world, state.copy(), accumulate,
                         comm=comm, shard=shard)

    on_threads(world, one, timeout=120)
    return out


def _steps(programs, tokens):
    out = [None] * len(programs)

    def run(r):
        p = programs[r]
        for t in tokens:
            p.upload_input(t)
            p.replay_and_wait()
        out[r] = (p.grad_norm(), p.gradients(), p.state(), p.compilation_report())
        p.reset()

    on_threads(len(programs), run, timeout=120)
    return out


@inside
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_three_ranks_over_a_vector_they_do_not_divide(precision):
    """N = 29,024 over W = 3: shards of S = 9,675 (not a multiple of 4:
    ranks 1 and 2 update one element at a time), the last 9,674 long. Two
    steps sharded against unsharded, the same bits (no clipping); every
    rank's state the same; each rank's report counts its state's bytes."""
    config = dataclasses.replace(CFG, vocab=CFG.vocab + 1)
    N, W = registry(config).total, 3
    S = -(-N // W)
    assert N % W and S % 4 and N - 2 * S < S
    state = State.fresh(initialize(config))
    rng = np.random.default_rng(5)
    tokens = [rng.integers(0, config.vocab, (W, config.context + 1)) for _ in range(2)]
    hyper = Hyper(weight_decay="1/10")
    whole = _steps(_programs(config, W, precision, state, hyper, False), tokens)
    sharded = _steps(_programs(config, W, precision, state, hyper, True), tokens)
    for r in range(W):
        norm, G, after, report = sharded[r]
        assert G.tobytes() == whole[r][1].tobytes()  # the shards' sums, gathered
        for name in "PMV":
            assert getattr(after, name).tobytes() == getattr(whole[r][2], name).tobytes(), name
        assert after.t == 2
        close(np.float32(norm), np.float32(whole[r][0]), "gradient", precision)
        assert norm == sharded[0][0]  # the same norm on every rank
        memory = report["state_memory"]
        assert memory["shard"] == {"offset": r * S, "length": min(S, N - r * S), "size": S}
        Pb = 2 * W * S if precision == "bf16" else 0
        want = {"P": 4 * W * S, "M": 4 * S, "V": 4 * S, "G": 4 * W * S, "Gshard": 4 * S,
                "partials": 4 * W * adamw.NORM_BLOCKS, **({"Pb": Pb} if Pb else {})}
        assert memory["buffers"] == want
        assert memory["bytes_per_rank"] == sum(want.values())
        # P whole and 2/W of M and V: 4 + 8/W bytes a parameter (the master: P's slice)
        assert abs(memory["optimizer_bytes_per_parameter"] - (4 + 8 / W)) < 1e-3
        assert whole[r][3]["state_memory"]["buffers"]["M"] == 4 * N
        assert report["collectives"] == 5 + (precision == "bf16")


@inside
def test_coppelius_program_reports_the_state_bytes_of_its_rank(capsys):
    """`coppelius program` on the CUDA backend (one rank, nothing sharded):
    P, M, V and G whole, 4 bytes an element each, and the bfloat16 operands."""
    assert cli.main(["program", "--backend", "cupy", "--preset", "test", "--batch", "2",
                     "--precision", "bf16"]) == 0
    memory = json.loads(capsys.readouterr().out)["state_memory"]
    N = registry(CFG).total
    assert memory["buffers"] == {"P": 4 * N, "M": 4 * N, "V": 4 * N, "G": 4 * N, "Pb": 2 * N}
    assert (memory["bytes_per_rank"], memory["parameters"]) == (18 * N, N)
    assert memory["optimizer_bytes_per_parameter"] == 12
    assert (memory["sharded"], memory["shard"], memory["world"]) == (False, None, 1)


@inside
def test_sharded_with_accumulation_is_the_unsharded_step():
    """k = 2 micro-batches of each rank's 2 contexts: the gradient summed
    over the passes, then reduce-scattered; the same bits as unsharded."""
    state = State.fresh(initialize(CFG))
    rng = np.random.default_rng(7)
    tokens = [rng.integers(0, CFG.vocab, (4, CFG.context + 1)) for _ in range(2)]
    whole, sharded = (_steps(_programs(CFG, 2, "bf16", state, Hyper(), shard, 4, 2), tokens)
                      for shard in (False, True))
    for r in range(2):
        assert sharded[r][1].tobytes() == whole[r][1].tobytes()
        for name in "PMV":
            assert getattr(sharded[r][2], name).tobytes() == \
                getattr(whole[r][2], name).tobytes(), name


# ---------------------------------------------------------------- backends without ranks

def test_one_rank_of_the_reference_accepts_the_option_as_a_no_op(tmp_path, capsys):
    """No ranks, nothing to shard: the same checkpoint, the option remembered."""
    if EMULATED:
        pytest.skip("outside the emulator")
    stream = pattern_stream(tmp_path / "s.tokens", CFG, 16, noise=0.2)
    runs = {}
    for name, extra in (("with", [SHARD]), ("without", [])):
        run = runs[name] = tmp_path / name
        assert cli.main(["train", "--preset", "test", "--backend", "reference", "--stream",
                         stream, "--run-dir", str(run), "--checkpoint", str(run / "ck.bin"),
                         "--no-sample", "--batch", "2", "--until", "2", *extra]) == 0
    assert (runs["with"] / "ck.bin").read_bytes() == (runs["without"] / "ck.bin").read_bytes()
    assert json.loads((runs["with"] / "run.json").read_text())["options"]["shard_optimizer"]
    assert "shard_optimizer" not in json.loads((runs["without"] / "run.json").read_text())[
        "options"]
    assert "sharded" not in "".join(capsys.readouterr())
