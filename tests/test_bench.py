"""`coppelius bench` and its PyTorch peer. The peer must be the same model as
the reference (same loss, same gradients, same update), or its timings
compare nothing. No test here asserts a time."""

import dataclasses
import json
import math
import sys
from fractions import Fraction

import pytest

from coppelius import reference
from coppelius.conformance import cases
from coppelius.conformance.tolerances import relative_error, tolerance
from coppelius import bench
from coppelius.reference.params import registry

TEST = reference.preset("test")


def peer_module():
    pytest.importorskip("torch")
    from coppelius.bench import torch_peer

    return torch_peer


# Every member of the family (SPEC 21): the presets, and one that sets every
# field at once with two groups of two query heads (so that query head h's kv
# head h // g differs from h % Hkv), half of each head rotated, a rope base
# and an eps of their own (base 100: at T = 16 and R = 4 a base near 10^4
# turns the second pair by under 0.15 rad, too little to tell bases apart).
MIXED = dataclasses.replace(reference.preset("test-qwen"), n_head=4, n_kv_head=2,
                            rotary=Fraction(1, 2), rope_base=Fraction(100),
                            norm_eps=Fraction(1, 1000000))
FAMILY = {name: reference.preset(name) for name in ("test-llama", "test-qwen", "test-stablelm")}
FAMILY["mixed"] = MIXED
MEMBERS = [pytest.param(c, gqa, id=f"{name}-{gqa}") for name, c in FAMILY.items()
           for gqa in ("sdpa", "repeat")]  # both idioms of query head h with kv head h // g


def check_loss_and_grads(torch_peer, config, batch, gqa):
    state = cases.random_state(config, seed=3, scale=1.0)  # norms away from ones, biases from 0
    tokens = cases.random_windows(config, batch, 1)[0]
    want = reference.step(config, state.copy(), tokens, "fp32", grads=True)
    peer = torch_peer.TorchPeer(config, state.P, gqa=gqa)
    loss, row_losses, G = peer.loss_and_grads(tokens)
    assert loss == pytest.approx(float(want.loss), rel=1e-4)
    assert relative_error(row_losses, want.row_losses)[0] <= tolerance("row_losses", "fp32")
    for spec in registry(config):  # autograd against the hand-written backward, per tensor
        error, *_ = relative_error(G[spec.slice], want.grads[spec.slice])
        assert error <= tolerance("gradient", "fp32"), spec.name


@pytest.mark.parametrize("batch", [1, 2])
def test_torch_peer_is_the_reference_model(batch):
    check_loss_and_grads(peer_module(), TEST, batch, "auto")


@pytest.mark.parametrize("config,gqa", MEMBERS)
def test_torch_peer_is_the_reference_model_of_every_family(config, gqa):
    """Loss, row losses and each tensor's gradient (lm_head, the biases, the
    (Hkv E, D) k and v) of the peer built from the Config, with either
    grouped-query idiom, against the reference's hand-written backward."""
    check_loss_and_grads(peer_module(), config, 2, gqa)


def test_torch_peer_is_not_the_reference_model_with_a_field_dropped():
    """The family checks can fail: the peer built from a config that differs
    in one field is off the reference's loss or gradient by far more than
    the tolerances (each field changes what the model computes)."""
    torch_peer = peer_module()
    state = cases.random_state(MIXED, seed=3, scale=1.0)
    tokens = cases.random_windows(MIXED, 2, 1)[0]
    want = reference.step(MIXED, state.copy(), tokens, "fp32", grads=True)
    for field, value in (("rotary", Fraction(1)), ("rope_base", Fraction(10000)),
                         ("norm_eps", Fraction(1, 100000))):
        peer = torch_peer.TorchPeer(dataclasses.replace(MIXED, **{field: value}), state.P)
        loss, _, G = peer.loss_and_grads(tokens)
        error = relative_error(G, want.grads)[0]
        assert error > 10 * tolerance("gradient", "fp32"), field
    # query head h with kv head h % Hkv instead of h // g: the same shapes, another model
    peer = torch_peer.TorchPeer(MIXED, state.P, gqa="repeat")
    peer.attention = lambda q, k, v: torch_peer.F.scaled_dot_product_attention(
        q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), is_causal=True)
    loss, _, G = peer.loss_and_grads(tokens)
    assert relative_error(G, want.grads)[0] > 10 * tolerance("gradient", "fp32")


@pytest.mark.parametrize("name", list(FAMILY))
def test_torch_peer_update_of_every_family_is_the_references(name):
    """One update of the peer (torch's AdamW: the biases and norms without
    decay, lm_head with it) from a fresh state is the reference's."""
    torch_peer = peer_module()
    config = FAMILY[name]
    state = cases.fresh_state(config)
    tokens = cases.random_windows(config, 2, 1)[0]
    peer = torch_peer.TorchPeer(config, state.P)
    loss = float(peer.step(peer.to_tokens(tokens)))
    result = reference.step(config, state, tokens, "fp32")
    assert loss == pytest.approx(float(result.loss), rel=1e-4)
    P = peer.parameters_flat()
    assert relative_error(P - state.P, result.state.P - state.P)[0] < 5e-4
    assert relative_error(P, result.state.P)[0] <= tolerance("P", "fp32")


def test_torch_peer_refuses_an_unknown_gqa_idiom():
    torch_peer = peer_module()
    with pytest.raises(ValueError, match="gqa 'nonesuch'"):
        torch_peer.TorchPeer(MIXED, cases.fresh_state(MIXED).P, gqa="nonesuch")


@pytest.mark.parametrize("optimizer", ["torch", "hand"])
def test_torch_peer_update_is_adamw_of_the_spec(optimizer):
    torch_peer = peer_module()
    state = cases.fresh_state(TEST)
    windows = cases.random_windows(TEST, 1, 3)
    peer = torch_peer.TorchPeer(TEST, state.P, optimizer=optimizer)
    want = state
    for tokens in windows:  # three updates: bias corrections for t = 1, 2, 3
        loss = float(peer.step(peer.to_tokens(tokens)))
        result = reference.step(TEST, want, tokens, "fp32")
        want = result.state
        assert loss == pytest.approx(float(result.loss), rel=1e-4)
    P = peer.parameters_flat()
    # the update itself (P - P0), which weight decay and bias correction shape:
    # without decay it would be off by ~2e-3, with a wrong c1 by far more
    error, *_ = relative_error(P - state.P, want.P - state.P)
    assert error < 5e-4
    assert relative_error(P, want.P)[0] <= tolerance("P", "fp32")


def test_torch_peer_refuses_bf16_on_the_cpu():
    torch_peer = peer_module()
    with pytest.raises(ValueError, match="CUDA"):
        torch_peer.TorchPeer(TEST, cases.fresh_state(TEST).P, precision="bf16", device="cpu")


def test_flops_per_step_counts_the_usual_estimate():
    c = reference.preset("coppelius")
    # SPEC preset: 57,705,472 parameters; 6 N T + 6 L D T^2 per context
    assert bench.flops_per_step(c, 1) == 6 * 57705472 * 1024 + 6 * 16 * 512 * 1024 ** 2
    assert bench.flops_per_step(c, 8) == 8 * bench.flops_per_step(c, 1)
    # untied: the embedding is a gather, lm_head the product; N = every weight but the
    # embedding's V D, counted from the preset's fields: per layer q, o (D^2), k, v
    # (Hkv E D), gate, up, down (D F), two RMSNorm weights (D); the final norm, lm_head
    c = reference.preset("llama-124m")
    V, D, F, L, KV = 32768, 768, 2048, 12, 4 * 64
    N = L * (2 * D * D + 2 * KV * D + 3 * D * F + 2 * D) + D + V * D
    assert bench.flops_per_step(c, 2) == 2 * (6 * N * 1024 + 6 * L * D * 1024 ** 2)


def timing(name, device, precision, ms, batch=1, memory=math.nan, preset="test"):
    # fake timings: the table's arithmetic is checked against these numbers
    return bench.Timing(name, device, precision, batch, list(ms), list(ms), "host", memory,
                        "fake", 1.0, 16 * batch, preset, 1e9 * batch)


def test_batch_list_keeps_the_order_and_drops_repeats():
    from coppelius.cli import build_parser

    args = build_parser().parse_args(["bench", "--batch", "8", "--batch", "1", "--batch", "8"])
    assert args.batch == [8, 1, 8]
    assert bench.batch_list(args.batch, 1) == [8, 1]
    assert bench.batch_list(None, 4) == [4]  # none given: the model file's batch, else 1
    with pytest.raises(bench.ConfigError, match="--batch=0"):
        bench.batch_list([1, 0], 1)


def test_ratios_are_against_the_fastest_peer_of_the_same_batch_and_precision():
    GiB = 2.0 ** 30
    rows = [
        timing("cupy", "cuda", "bf16", [4.0, 5.0, 6.0], batch=1, memory=2 * GiB),  # median 5
        timing(bench.EAGER, "cuda", "bf16", [50.0], batch=1, memory=6 * GiB),
        timing(bench.COMPILED, "cuda", "bf16", [4.0], batch=1, memory=4 * GiB),
        timing("cupy", "cuda", "bf16", [19.0], batch=8, memory=5 * GiB),
        timing(bench.EAGER, "cuda", "bf16", [47.0], batch=8, memory=10 * GiB),  # no compiled
        timing("cupy", "cuda", "fp32", [16.0], batch=1, memory=3 * GiB),  # no fp32 peer
    ]
    table = bench.compare(rows)
    by = {(r["implementation"], r["batch"], r["precision"]): r for r in table}
    r = by["cupy", 1, "bf16"]
    assert r["x_peer_time"] == pytest.approx(5.0 / 4.0)
    assert r["x_peer_memory"] == pytest.approx(0.5)
    assert r["peer"] == "torch.compile + graph cuda bf16" and not r["peer_fallback"]
    assert r["tokens_per_s"] == pytest.approx(16 / 5e-3)
    assert r["tflops"] == pytest.approx(1e9 / 5e-3 / 1e12)
    assert r["peak_memory_bytes"] == 2 * GiB and r["min_ms"] == 4.0
    assert by[bench.EAGER, 1, "bf16"]["x_peer_time"] == pytest.approx(12.5)
    assert by[bench.COMPILED, 1, "bf16"]["x_peer_time"] == 1.0
    # B = 8: the eager peer is the strongest there; B = 1's peers are not used
    assert by["cupy", 8, "bf16"]["x_peer_time"] == pytest.approx(19.0 / 47.0)
    assert by["cupy", 8, "bf16"]["x_peer_memory"] == pytest.approx(0.5)
    assert by["cupy", 1, "fp32"]["peer"] is None
    assert by["cupy", 1, "fp32"]["x_peer_time"] is None

    lines = bench.format_table(table).splitlines()
    assert lines[0].split()[:3] == ["implementation", "B", "precision"]
    assert len(lines) == 1 + len(rows)
    cupy_b1 = lines[1].split()
    assert cupy_b1[:4] == ["cupy", "1", "bf16", "cuda"]
    assert cupy_b1[-3:] == ["1.25", "0.50", "1.0000"]  # x peer ms, x peer mem, loss
    assert cupy_b1[-4] == "2048.0"  # peak MiB
    assert lines[-1].split()[-3:-1] == ["-", "-"]


def test_rows_without_a_peer_of_their_kind_compare_with_the_cpu_baseline():
    rows = [timing(bench.EAGER, "cpu", "fp32", [10.0, 30.0, 20.0]),  # median 20
            timing("reference", "cpu", "bf16", [40.0]), timing("mlx", "gpu", "fp32", [5.0]),
            timing("reference (coppelius)", "cpu", "fp32", [9000.0], preset="coppelius")]
    table = bench.compare(rows)
    assert [r["x_peer_time"] for r in table] == [1.0, 2.0, 0.25, None]
    assert [r["peer_fallback"] for r in table] == [False, True, True, False]
    assert table[1]["x_peer_memory"] is None  # the CPU peer has no device memory
    lines = bench.format_table(table).splitlines()
    assert "2.00*" in lines[2].split() and "0.25*" in lines[3].split()


def run_bench(capsys, *argv):
    from coppelius.cli import main

    status = main(["bench", *argv])
    captured = capsys.readouterr()
    return status, captured.out.splitlines(), captured.err


def table_rows(out):
    """The table: the lines after its header line, which come last; the
    name (22 columns, may hold spaces), then the other columns."""
    i = next(i for i, line in enumerate(out) if line.startswith("implementation"))
    return [[line[:22].strip()] + line[22:].split() for line in out[i + 1:]]


def test_bench_command_prints_the_table_last_and_writes_its_rows(capsys, tmp_path):
    path = tmp_path / "bench.json"
    status, out, err = run_bench(capsys, "--preset", "test", "--steps", "2", "--batch", "1",
                                 "--batch", "2", "--json", str(path))
    assert status == 0 and "Traceback" not in err
    assert out[0].startswith("coppelius bench: preset test, B=1,2, T=16, 2 timed steps")
    rows = table_rows(out)
    names = [r[0] for r in rows]
    assert names[0] == "reference"
    from coppelius import accelerated

    for name in accelerated.available_backends():
        assert name in names
    try:
        import torch  # noqa: F401

        assert bench.EAGER in names  # the CPU peer
        assert any(line.startswith(bench.COMPILED) and "not timed" in line for line in out)
    except ImportError:
        assert any(line.startswith("PyTorch peers: not timed") for line in out)
    assert sorted({int(r[1]) for r in rows}) == [1, 2]
    written = json.loads(path.read_text())
    assert len(written["rows"]) == len(rows)
    for line, row in zip(rows, written["rows"]):
        assert line[0] == row["implementation"] and int(line[1]) == row["batch"]
        assert float(line[4]) == pytest.approx(row["median_ms"], abs=5e-4)
        assert len(row["ms"]) == 2 and row["tokens"] == 16 * row["batch"]
    # every implementation trained the same model on the same inputs from the same bits
    for batch in (1, 2):
        losses = [r["loss"] for r in written["rows"] if r["batch"] == batch
                  and r["implementation"] in ("reference", bench.EAGER)]
        assert max(losses) - min(losses) < 1e-4 * max(losses)


def test_bench_times_a_family_member_beside_the_peer(capsys, tmp_path):
    """A family member (SPEC 21) from --preset and --model: the reference and
    the CPU peer train it from the same bits on the same inputs (the same
    loss), and the peer's row is the ratios' baseline."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the peers are CUDA ones")
    model = tmp_path / "model.toml"  # MIXED over test-qwen
    model.write_text('n_head = 4\nn_kv_head = 2\nrotary = "1/2"\nrope_base = 100\n'
                     'norm_eps = "1/1000000"\n')
    for argv in (["--preset", "test-stablelm"], ["--preset", "test-qwen", "--model", str(model)]):
        path = tmp_path / "bench.json"
        status, out, err = run_bench(capsys, *argv, "--steps", "1", "--warmup", "0",
                                     "--batch", "2", "--json", str(path))
        assert status == 0 and "Traceback" not in err
        rows = {(r["implementation"], r["device"]): r for r in json.loads(path.read_text())["rows"]}
        ref, peer = rows["reference", "cpu"], rows[bench.EAGER, "cpu"]
        assert ref["loss"] == pytest.approx(peer["loss"], rel=1e-4)
        assert ref["peer"] == f"{bench.EAGER} cpu fp32" and peer["x_peer_time"] == 1.0
        assert ref["x_peer_time"] == pytest.approx(ref["median_ms"] / peer["median_ms"])
    assert bench.preset_name(MIXED) == "custom" and ref["preset"] == "custom"


def stub_backend(monkeypatch, implemented):
    """A backend named 'stub', available here, that computes only the family
    fields `implemented` (and is the reference otherwise)."""
    import types

    from coppelius import accelerated
    from coppelius.reference import program

    module = types.ModuleType("coppelius_stub_backend")
    module.available, module.capture, module.IMPLEMENTED = (lambda: True), program.capture, \
        implemented
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(accelerated.BACKENDS, "stub", module.__name__)


def test_a_backend_that_does_not_compute_the_model_is_one_line(capsys, monkeypatch):
    """Chosen by default, a backend that refuses a family field is a line and
    the rest is timed; named by --backend, it is refused in one line, exit 2,
    before any work."""
    stub_backend(monkeypatch, ("norm_eps", "rope_base"))
    status, out, err = run_bench(capsys, "--preset", "test-llama", "--steps", "1", "--warmup",
                                 "0", "--no-peer")
    assert status == 0 and "Traceback" not in err
    assert "stub: not timed: stub: config field norm='rmsnorm' (SPEC 21) is not implemented " \
           "here yet" in out
    names = [r[0] for r in table_rows(out)]
    assert "reference" in names and "stub" not in names
    status, out, err = run_bench(capsys, "--preset", "test-llama", "--backend", "stub")
    assert status == 2 and out == [] and "ready" not in err
    assert err.strip() == "coppelius bench: error: stub: config field norm='rmsnorm' (SPEC 21) " \
                          "is not implemented here yet"
    stub_backend(monkeypatch, ("norm", "n_kv_head", "tied"))  # computes test-llama: timed
    status, out, err = run_bench(capsys, "--preset", "test-llama", "--steps", "1", "--warmup",
                                 "0", "--no-peer", "--backend", "stub")
    assert status == 0 and [r[0] for r in table_rows(out)] == ["reference", "stub"]


def test_bench_recompute_times_each_backend_both_ways(capsys):
    """--recompute and --recompute block: rows '<backend> recompute' and
    '<backend> recompute block' beside each accelerated backend's (none for
    the reference, which ignores both), ending at the same printed loss (the
    bits are checked in each backend's own tests); a bad mode is one line."""
    from coppelius import accelerated

    status, out, err = run_bench(capsys, "--preset", "test", "--steps", "2", "--no-peer",
                                 "--recompute", "--recompute", "block")
    assert status == 0 and "Traceback" not in err
    rows = {r[0]: r for r in table_rows(out)}
    assert not {"reference recompute", "reference recompute block"} & set(rows)
    for name in accelerated.available_backends():
        if name != "reference":
            for label in ("recompute", "recompute block"):
                assert rows[f"{name} {label}"][-1] == rows[name][-1]  # the loss, as printed
    with pytest.raises(SystemExit) as exit:
        run_bench(capsys, "--preset", "test", "--recompute", "layer")
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.strip().splitlines()) == 1 and "'layer'" in err


def test_one_at_a_time_steps_each_implementation_alone_with_the_same_rows(capsys, monkeypatch):
    """--one-at-a-time: every implementation is measured with no other
    alive (a model too large for all of them on the device at once); the
    rows and their losses are those of the interleaved run."""
    args = ("--preset", "test", "--steps", "2", "--warmup", "1", "--no-peer", "--recompute")
    status, out, err = run_bench(capsys, *args)
    assert status == 0, err
    together = {r[0]: r[-1] for r in table_rows(out)}
    alive = []
    measure = bench.measure
    monkeypatch.setattr(bench, "measure", lambda runners, inputs: (
        alive.append(len(runners)), measure(runners, inputs))[1])
    status, out, err = run_bench(capsys, *args, "--one-at-a-time")
    assert status == 0, err
    alone = {r[0]: r[-1] for r in table_rows(out)}
    assert alone == together
    assert alive == [1] * len(together)  # (one row where only the reference is available)


def test_bench_tiny_runs_end_to_end_on_the_cpu(capsys):
    status, out, err = run_bench(capsys, "--preset", "tiny", "--steps", "2", "--warmup", "1")
    assert status == 0 and "Traceback" not in err
    rows = table_rows(out)
    assert rows and all(r[1] == "1" and float(r[4]) > 0 for r in rows)


def test_a_peer_that_cannot_run_is_one_line(capsys, monkeypatch):
    def refuse(kind, *args):
        raise RuntimeError(f"{kind} failed to compile\nmore detail on a second line")

    monkeypatch.setattr(bench, "peer_plan", lambda *a: (
        [(bench.EAGER, "cuda", "bf16"), (bench.COMPILED, "cuda", "bf16")], []))
    monkeypatch.setattr(bench, "peer_runner", refuse)
    status, out, err = run_bench(capsys, "--preset", "test", "--steps", "1", "--batch", "1",
                                 "--batch", "2", "--no-reference", "--backend", "reference")
    assert status == 0 and "Traceback" not in err
    lines = [line for line in out if "not timed" in line]
    assert lines == [f"{bench.EAGER}, B=1, bf16: not timed: RuntimeError: {bench.EAGER} failed "
                     "to compile",
                     f"{bench.COMPILED}, B=1, bf16: not timed: RuntimeError: {bench.COMPILED} "
                     "failed to compile",
                     f"{bench.EAGER}, B=2, bf16: not timed: RuntimeError: {bench.EAGER} failed "
                     "to compile",
                     f"{bench.COMPILED}, B=2, bf16: not timed: RuntimeError: {bench.COMPILED} "
                     "failed to compile"]
    assert table_rows(out) == []  # nothing else was asked for: an empty table, no crash


def test_no_torch_is_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    targets, notes = bench.peer_plan(False, False, ["bf16"])
    assert targets == [] and len(notes) == 1 and notes[0].startswith("PyTorch peers: not timed")
    assert bench.peer_plan(True, False, ["bf16"]) == ([], [])


def test_cpu_peer_plan_is_eager_fp32_and_says_why_not_compiled():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    targets, notes = bench.peer_plan(False, False, [])
    assert targets == [(bench.EAGER, "cpu", "fp32")]
    assert notes == [f"{bench.COMPILED}: not timed: torch sees no CUDA device (the CPU peer is "
                     "eager)"]


def test_bench_refuses_bad_options_in_one_line(capsys, tmp_path):
    from coppelius.cli import main

    assert main(["bench", "--preset", "test", "--steps", "0"]) == 2
    assert main(["bench", "--preset", "nonesuch"]) == 2
    assert main(["bench", "--preset", "test", "--backend", "nonesuch"]) == 2
    assert main(["bench", "--preset", "test", "--batch", "1", "--batch", "0"]) == 2
    assert main(["bench", "--preset", "test", "--json", str(tmp_path)]) == 2  # a directory
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("coppelius bench: error: ") for line in err)
    assert "--batch=0" in err[3] and "--json" in err[4]


@pytest.mark.gpu
@pytest.mark.parametrize("config,gqa", [(TEST, "auto"), (MIXED, "sdpa"), (MIXED, "repeat")],
                         ids=["test", "mixed-sdpa", "mixed-repeat"])
def test_compiled_graph_peer_replays_the_eager_peers_steps(config, gqa):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    from coppelius.bench import torch_peer

    state = cases.fresh_state(config)
    windows = cases.random_windows(config, 2, 3)
    eager = torch_peer.TorchPeer(config, state.P, device="cuda", gqa=gqa)
    graph = torch_peer.CompiledGraphStep(config, state.P, windows[0], precision="fp32",
                                         gqa=gqa)
    for tokens in windows:  # the warm-up's updates were undone: update 1 comes first
        want = float(eager.step(eager.to_tokens(tokens)))
        graph.upload(tokens)
        assert float(graph.replay()) == pytest.approx(want, rel=1e-4)
    error, *_ = relative_error(graph.peer.parameters_flat() - state.P,
                               eager.parameters_flat() - state.P)
    assert error < 1e-3
