"""`coppelius inspect` and `coppelius report`, run through the console
script's main on files the tests make; the printed numbers are compared
with this file's own computation."""

import hashlib
import math
import re
import statistics
from fractions import Fraction

import numpy as np
import pytest

from coppelius import cli
from coppelius.reference.checkpoint import identities, write_checkpoint
from coppelius.reference.config import Hyper, preset
from coppelius.reference.params import initialize, registry
from coppelius.reference.results import ResultWriter, result_header
from coppelius.reference.state import State

CONFIG = preset("test")
B, T, V = 3, CONFIG.context, CONFIG.vocab
IDS = identities(CONFIG, Hyper(), "bf16", B, None, hashlib.sha256(b"ids").hexdigest())
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_results(path, n_steps=30, first_step=10, final=True, seed=0):
    """A result file with decreasing, noisy row losses; returns what it holds."""
    rng = np.random.default_rng(seed)
    steps, hosts = [], []
    header = result_header(CONFIG, IDS, first_step, n_steps, B, "reference", False)
    with ResultWriter(path, header) as w:
        w.forward(rng.standard_normal((3, V)).astype(np.float32))
        for i in range(n_steps):
            rows = (4.0 - 2.0 * i / n_steps + rng.uniform(0, 1, (B, T))).astype(np.float32)
            host = float(rng.uniform(0.01, 0.1))
            w.step(first_step + i, rows)
            w.timing(first_step + i, host, math.nan)
            steps.append((first_step + i, rows))
            hosts.append(host)
        if final:
            w.final(np.zeros((4, T), np.float32), np.zeros(V, np.float32), [(1, 1)] * 3)
    return steps, hosts


def field(out: str, key: str) -> str:
    match = re.search(rf"^{re.escape(key)}\s+(.*)$", out, re.M)
    assert match, f"no line {key!r} in:\n{out}"
    return match.group(1)


def test_report_summary_and_plot(tmp_path, capsys):
    path = tmp_path / "results-10.bin"
    steps, hosts = make_results(path)
    png = tmp_path / "loss.png"
    assert cli.main(["report", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    # This test's own means: math.fsum over the float32 values, in float64.
    means = [math.fsum(rows.astype(np.float64).ravel()) / rows.size for _, rows in steps]
    best = min(range(len(means)), key=means.__getitem__)
    for key, i in (("first loss", 0), ("last loss", len(steps) - 1), ("min loss", best)):
        loss, step = re.fullmatch(r"([0-9.]+) at step (\d+)", field(out, key)).groups()
        assert abs(float(loss) - means[i]) < 1e-6 and int(step) == steps[i][0], key
    rate = float(field(out, "tokens/s").split()[0])
    assert abs(rate - statistics.median(B * T / h for h in hosts)) < 0.051
    assert field(out, "steps read").startswith("30 of 30")
    assert field(out, "completed") == "yes"
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "results-10.bin"]  # no temporary


def test_plot_is_not_blank(tmp_path, capsys):
    from matplotlib.image import imread

    path = tmp_path / "r.bin"
    make_results(path, n_steps=3)
    png = tmp_path / "plot.png"
    assert cli.main(["report", str(path), "--plot", str(png)]) == 0
    image = imread(png)  # (H, W, 4) floats
    assert image.ndim == 3 and image.shape[1] > image.shape[0]
    assert np.unique(image.reshape(-1, image.shape[2]), axis=0).shape[0] > 20


def test_report_without_plot_writes_no_png(tmp_path, capsys):
    path = tmp_path / "r.bin"
    make_results(path, n_steps=2)
    assert cli.main(["report", str(path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.bin"]


def test_report_of_an_interrupted_run(tmp_path, capsys):
    path = tmp_path / "r.bin"
    steps, _ = make_results(path, n_steps=5, final=False)
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # the last timing record cut short
    assert cli.main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert field(out, "steps read").startswith("5 of 5")
    assert re.fullmatch(r"no \(truncated record at offset \d+\)", field(out, "completed"))


def test_report_with_no_steps_is_an_error(tmp_path, capsys):
    path = tmp_path / "r.bin"
    make_results(path, n_steps=0, final=False)
    assert cli.main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no step records" in err and str(path) in err


@pytest.fixture
def ckpt(tmp_path):
    rng = np.random.default_rng(3)
    N = registry(CONFIG).total
    state = State(initialize(CONFIG), rng.standard_normal(N).astype(np.float32),
                  rng.uniform(0, 1, N).astype(np.float32), t=17)
    path = tmp_path / "model.ckpt"
    write_checkpoint(path, CONFIG, IDS, state, contexts=51)
    return path


def test_inspect_checkpoint(ckpt, capsys):
    assert cli.main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    for key, value in IDS.items():
        assert field(out, key) == str(value)
    assert field(out, "step") == "17" and field(out, "contexts") == "51"
    N = registry(CONFIG).total
    assert field(out, "parameters").startswith(f"{N} in {len(registry(CONFIG).specs)} tensors")
    assert field(out, "payload bytes").startswith(f"{12 * N} ")
    data = ckpt.read_bytes()
    digest = hashlib.sha256(data[:-48]).hexdigest()
    assert f"sha256 ok {digest}" in out


def test_inspect_damaged_payload_shows_the_envelope_and_the_mismatch(ckpt, capsys):
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0x40
    ckpt.write_bytes(bytes(data))
    assert cli.main(["inspect", str(ckpt)]) == 2
    captured = capsys.readouterr()
    assert field(captured.out, "step") == "17"  # the envelope is still shown
    content = hashlib.sha256(bytes(data[:-48])).hexdigest()
    trailer = bytes(data[-32:]).hex()
    assert f"sha256 MISMATCH: trailer {trailer}, content {content}" in captured.out
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("coppelius inspect: error: ") and str(ckpt) in captured.err
    assert "SHA-256" in captured.err


def test_inspect_damaged_header_exits_2_with_one_line_only(ckpt, capsys):
    data = bytearray(ckpt.read_bytes())
    data[20] ^= 0x40  # inside the JSON header: the structure itself is untrustworthy
    ckpt.write_bytes(bytes(data))
    assert cli.main(["inspect", str(ckpt)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and str(ckpt) in captured.err


def test_inspect_results(tmp_path, capsys):
    path = tmp_path / "r.bin"
    make_results(path, n_steps=4, first_step=8)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert field(out, "records") == "forward 1, steps 4, timings 4, final 1"
    assert field(out, "backend") == "reference" and field(out, "first_step") == "8"
    assert field(out, "step range") == "8..11"
    assert field(out, "complete") == "yes" and field(out, "stopped early") == "no"
    data = bytearray(path.read_bytes())
    data[-10] ^= 1  # inside the final record
    path.write_bytes(bytes(data))
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert field(out, "records") == "forward 1, steps 4, timings 4, final 0"
    assert re.fullmatch(r"yes: bad CRC at offset \d+", field(out, "stopped early"))


@pytest.mark.parametrize("content", [b"", b"hello world, not a checkpoint", b"CPLSRSLT\x01"])
def test_inspect_unknown_or_broken_file(tmp_path, capsys, content):
    path = tmp_path / "mystery.bin"
    path.write_bytes(content)
    assert cli.main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "Traceback" not in err


def test_inspect_missing_file(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "nope.ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.ckpt" in err


def test_ema_is_a_bias_corrected_weighted_mean():
    from coppelius.report import ema

    x = np.random.default_rng(7).standard_normal(50)
    beta = 0.9
    for k in (0, 1, 10, 49):
        w = (1 - beta) * beta ** np.arange(k, -1, -1)  # weights of x[0..k]
        assert ema(x, beta)[k] == pytest.approx(np.dot(w, x[:k + 1]) / w.sum(), rel=1e-12)
    assert np.allclose(ema(np.full(20, 3.25)), 3.25)


# ------------------------------------------------------------ learning rate of each step

def spec_s(t, W, N, f):
    """SPEC 7's s(t), written out here from the SPEC's Python."""
    if t <= W:
        return t / W
    if t > N:
        return float(f)
    return float(f) + (1 - float(f)) * 0.5 * (1.0 + math.cos(math.pi * (t - W) / (N - W)))


def test_step_learning_rates_follow_spec_7():
    from coppelius.reference.schedule import parse_schedule, step_learning_rates

    h = Hyper(schedule="cosine", warmup=4, total=20, floor=Fraction(1, 10))
    ident = h.identity("fp32")
    assert parse_schedule(ident) == ("cosine", 4, 20, Fraction(1, 10))
    steps = [0, 1, 3, 4, 11, 19, 20, 21, 10**6, 2**63 - 1]  # step s applies update t = s + 1
    got = step_learning_rates(ident, steps)
    assert got.dtype == np.float64
    # by hand: warm-up t/W is exact, halfway (t = 12) s = 11/20, beyond N the floor
    exact = {0: Fraction(1, 4), 1: Fraction(1, 2), 3: Fraction(1), 11: Fraction(11, 20)}
    for s, frac in exact.items():
        assert got[steps.index(s)] == float(np.float32(float(Fraction(3, 10000) * frac))), s
    for i, s in enumerate(steps):
        assert got[i] == float(np.float32(0.0003 * spec_s(min(s + 1, 21), 4, 20, 0.1))), s
    assert got[-1] == got[-2] == got[-3] == got[-4] == float(np.float32(0.0003 * 0.1))
    # no warm-up: the first update is already on the cosine
    ident = Hyper(schedule="cosine", warmup=0, total=10, floor=Fraction(0)).identity("bf16")
    first = step_learning_rates(ident, [0])[0]
    assert first == float(np.float32(0.0003 * 0.5 * (1.0 + math.cos(math.pi / 10))))
    assert parse_schedule(Hyper().identity("fp32")) == ("constant", 0, None, Fraction(0))
    assert step_learning_rates(Hyper(lr="1/3").identity("fp32"), [0, 9]).tolist() == \
        [float(np.float32(1 / 3))] * 2


@pytest.mark.parametrize("edit", [
    lambda i: i.replace("optimizer=adamw", "optimizer=sgd"),
    lambda i: i.replace("floor=1/10", "floor=0.1"),  # not the canonical form
    lambda i: i.replace("total=20", "total=" + "9" * 5000),
    lambda i: i + "|mystery=1",
    lambda i: i.replace("cosine(", "linear("),
    lambda i: i.replace("|lr=3/10000", ""),
    lambda i: 17,
])
def test_learner_identities_this_version_does_not_write_are_refused(edit):
    from coppelius.reference.errors import ConfigError
    from coppelius.reference.schedule import learner_from_identity

    ident = Hyper(schedule="cosine", warmup=4, total=20, floor=Fraction(1, 10)).identity("fp32")
    assert learner_from_identity(ident)[1] == "fp32"
    with pytest.raises(ConfigError, match="not one this version implements") as e:
        learner_from_identity(edit(ident), "result file r.bin")
    assert str(e.value).startswith("result file r.bin: ") and len(str(e.value)) < 600
