"""Live metrics of `coppelius train`: the TensorBoard event files read back
with TensorBoard's own reader against the result file, a resumed run's
curves, Weights & Biases through a stand-in module, MFU against the FLOP
formula written out again, the metrics record (kind 7), report --compare."""

import importlib.machinery
import json
import math
import os
import shutil
import sys
import types

import numpy as np
import pytest

from coppelius import metrics, report
from coppelius.cli import main
from coppelius.reference import results
from coppelius.reference.config import PRESETS
from coppelius.reference.params import registry
from coppelius.reference.schedule import step_learning_rates

from tests.support import pattern_stream

CFG = PRESETS["test"]


@pytest.fixture
def stream(tmp_path):
    return pattern_stream(tmp_path / "s.tokens", CFG, 40, noise=0.1)


def train(stream, run_dir, *extra):
    return main(["train", "--preset", "test", "--backend", "reference", "--stream", stream,
                 "--run-dir", str(run_dir), "--checkpoint", str(run_dir / "ck.bin"),
                 "--no-sample", *extra])


def scalars(tb_dir):
    """tag -> [(step, value)] as TensorBoard reads the directory."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def model_flops(config, batch):
    """6 N T + 6 L D T^2 per context, N the weights that multiply (the
    untied embedding is a gather): the estimate written out again."""
    V, D, T, L = config.vocab, config.d_model, config.context, config.n_layer
    N = sum(int(np.prod(spec.shape)) for spec in registry(config))
    if not config.tied:
        N -= V * D
    return batch * (6 * N * T + 6 * L * D * T * T)


def test_event_files_hold_the_result_file_values(tmp_path, stream, capsys):
    assert train(stream, tmp_path, "--until", "4", "--interval", "2", "--batch", "2",
                 "--schedule", "cosine", "--warmup", "1", "--peak-tflops", "0.5") == 0
    r = results.read_results(tmp_path / "results-0.bin")
    got = scalars(tmp_path / "tb")
    steps = [s for s, _ in r.steps]
    assert steps == [0, 1, 2, 3]
    loss = [float(rows.mean(dtype=np.float64)) for _, rows in r.steps]
    assert [s for s, _ in got["train/loss"]] == steps
    assert np.allclose([v for _, v in got["train/loss"]], loss, rtol=1e-6, atol=0)
    assert got["train/grad_norm"] == [(int(s), float(n)) for s, n in r.norms]
    lr = step_learning_rates(r.header["learner"], steps)
    assert [v for _, v in got["train/learning_rate"]] == [float(np.float32(x)) for x in lr]
    assert lr[0] != lr[-1]  # the schedule moves: the step of each rate matters
    assert got["eval/loss"] == [(int(u), float(m)) for u, m, _ in r.evals]
    assert [s for s, _ in got["eval/loss"]] == [2, 4]
    # tokens/s and MFU from the timing records' host seconds
    host = np.array([t[1] for t in r.timings])
    B, T = 2, CFG.context
    assert np.allclose([v for _, v in got["train/tokens_per_second"]], B * T / host, rtol=1e-6)
    mfu = model_flops(CFG, B) / (host * 0.5e12)
    assert np.allclose([v for _, v in got["train/mfu"]], mfu, rtol=1e-6)
    # ... and the result file's metrics records hold the same
    assert [m[0] for m in r.metrics] == steps
    assert [m[1] for m in r.metrics] == [model_flops(CFG, B)] * 4
    assert [m[2] for m in r.metrics] == [0.5e12] * 4
    assert np.allclose([m[3] for m in r.metrics], mfu, rtol=1e-12)
    assert all(math.isnan(m[4]) for m in r.metrics)  # the reference has no device memory
    assert "train/device_memory_gib" not in got
    assert json.loads((tmp_path / "run.json").read_text())["options"]["peak_tflops"] == 0.5
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert lines["MFU"] == f"{100 * float(np.median(mfu)):.2f}% (median of 4 steps)"
    assert "device" not in lines  # no device memory on the reference


def test_resumed_run_continues_the_curves_without_duplicates(tmp_path, stream):
    run = tmp_path / "run"
    assert train(stream, run, "--steps", "2", "--interval", "2") == 0
    shutil.copy(run / "ck.bin", tmp_path / "ck-2.bin")
    assert train(stream, run, "--steps", "2") == 0  # steps 2, 3
    # back to the checkpoint at step 2: steps 2 and 3 are trained again, then 4
    shutil.copy(tmp_path / "ck-2.bin", run / "ck.bin")
    assert train(stream, run, "--steps", "3") == 0
    assert len(os.listdir(run / "tb")) == 3  # an event file per invocation
    got = scalars(run / "tb")
    stitched = report.stitch(report.read_run_dir(run))
    assert [s for s, _ in got["train/loss"]] == stitched.steps.tolist() == [0, 1, 2, 3, 4]
    assert np.allclose([v for _, v in got["train/loss"]], stitched.loss, rtol=1e-6, atol=0)
    # the held-out loss after 2 updates was the first invocation's: still drawn
    assert got["eval/loss"] == [(int(u), float(m))
                                for u, m in zip(stitched.eval_steps, stitched.eval_means)]
    assert [s for s, _ in got["eval/loss"]] == [2, 4, 5]
    # the third invocation's own values of steps 2 and 3 are the ones shown
    third = results.read_results(run / "results-2-1.bin")
    assert [v for s, v in got["train/grad_norm"] if s >= 2] == [float(n) for _, n in third.norms]


class FakeWandb(types.ModuleType):
    """A stand-in for the wandb package that records what it is given."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits, self.logs, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, values, step=None):
                fake.logs.append((step, dict(values)))

            def finish(self):
                fake.finished += 1

        return Run()


def test_wandb_gets_the_same_values(tmp_path, stream, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    assert train(stream, tmp_path, "--until", "3", "--wandb", "proj", "--no-tensorboard") == 0
    assert not (tmp_path / "tb").exists()
    assert len(fake.inits) == 1 and fake.inits[0]["project"] == "proj" and fake.finished == 1
    r = results.read_results(tmp_path / "results-0.bin")
    assert fake.inits[0]["config"]["learner"] == r.header["learner"]
    train_logs = [(s, v) for s, v in fake.logs if "train/loss" in v]
    assert [s for s, _ in train_logs] == [0, 1, 2]
    assert [v["train/grad_norm"] for _, v in train_logs] == [float(n) for _, n in r.norms]
    assert all("train/mfu" not in v for _, v in train_logs)  # no peak known on the CPU
    assert [(s, v["eval/loss"]) for s, v in fake.logs if "eval/loss" in v] == \
        [(int(u), float(m)) for u, m, _ in r.evals]
    options = json.loads((tmp_path / "run.json").read_text())["options"]
    assert options["wandb"] == "proj" and options["tensorboard"] is False


def test_wandb_without_the_package_is_refused(tmp_path, stream, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable
    assert train(stream, tmp_path, "--steps", "1", "--wandb", "proj") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--wandb proj" in err[0] and "not installed" in err[0]
    assert not (tmp_path / "run.json").exists() and not (tmp_path / "results-0.bin").exists()


def test_tensorboard_without_the_package_is_refused(tmp_path, stream, monkeypatch, capsys):
    """The default TensorBoard directory where tensorboardX is missing (the
    tree run without its install): one line naming the option and the way
    out, before anything is published; --no-tensorboard trains."""
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # not importable
    assert train(stream, tmp_path, "--steps", "1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tensorboard" in err[0] and "tensorboardX" in err[0] \
        and "--no-tensorboard" in err[0]
    assert not (tmp_path / "run.json").exists() and not (tmp_path / "results-0.bin").exists()
    assert train(stream, tmp_path, "--steps", "1", "--no-tensorboard") == 0


def test_unwritable_tensorboard_dir_is_refused(tmp_path, stream, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert train(stream, tmp_path / "run", "--steps", "1", "--tensorboard", str(blocker)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--tensorboard {blocker}" in err[0]
    assert not (tmp_path / "run" / "results-0.bin").exists()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_bad_peak_is_refused(tmp_path, stream, capsys, value):
    assert train(stream, tmp_path, "--steps", "1", f"--peak-tflops={value}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--peak-tflops" in err[0]


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0),
    ("NVIDIA L4", 121.0), ("NVIDIA A10", 125.0), ("NVIDIA GeForce RTX 4090", 165.0),
    ("NVIDIA GeForce RTX 3060", None), ("emulated", None), (None, None)])
def test_peak_table(name, tflops):
    assert metrics.peak_tflops_of(name) == tflops


def test_meter_over_ranks():
    m = metrics.Meter(CFG, 4, "reference", peak_tflops=2.0, devices=2)
    assert m.flops == model_flops(CFG, 4)
    assert m.mfu(0.5) == model_flops(CFG, 4) / (0.5 * 2 * 2.0e12)
    assert math.isnan(metrics.Meter(CFG, 4, "reference").mfu(0.5))
    assert metrics.Meter.text(0.4125, 3 * 2**30) == "  mfu 41.2%  mem 3.00 GiB"
    assert metrics.Meter.text(math.nan, math.nan) == ""


# ------------------------------------------------------------ the record kind

def write_file(path, version=None, monkeypatch=None, with_metrics=True):
    from coppelius.reference import checkpoint
    from coppelius.reference.config import Hyper

    ids = checkpoint.identities(CFG, Hyper(), "fp32", 1, "", "0" * 64, 0, 0)
    header = results.result_header(CFG, ids, 0, 1, 1, "reference", False)
    if version is not None:
        monkeypatch.setattr(results, "VERSION", version)
    V, T = CFG.vocab, CFG.context
    with results.ResultWriter(path, header) as w:
        w.forward(np.zeros((3, V), np.float32))
        w.step(0, np.ones((1, T), np.float32))
        w.timing(0, 0.25, math.nan)
        w.norm(0, 1.5)
        if with_metrics:
            w.metrics(0, 1.0e9, 2.0e12, 0.002, 3.0 * 2**20)
    if version is not None:
        monkeypatch.undo()
    return path


def test_metrics_record_round_trip(tmp_path):
    r = results.read_results(write_file(tmp_path / "r.bin"))
    assert r.version == 3 and r.stopped is None
    assert r.metrics == [(0, 1.0e9, 2.0e12, 0.002, 3.0 * 2**20)]
    raw = (tmp_path / "r.bin").read_bytes()
    # kind 7 with its 40 bytes, its CRC over kind, length and payload
    body = results.METRICS_BODY.pack(0, 1.0e9, 2.0e12, 0.002, 3.0 * 2**20)
    import zlib

    head = (7).to_bytes(4, "little") + len(body).to_bytes(4, "little")
    assert raw.endswith(head + body + zlib.crc32(head + body).to_bytes(4, "little"))


def test_an_old_reader_refuses_the_new_version_and_kind(tmp_path, monkeypatch):
    path = write_file(tmp_path / "r.bin")
    old = {1: results.KINDS[1], 2: results.KINDS[2]}  # what a version-2 reader knows
    monkeypatch.setattr(results, "KINDS", old)
    with pytest.raises(results.ResultFileError, match="format version 3, this reader knows 1, 2"):
        results.read_results(path)
    monkeypatch.undo()
    # a kind 7 in a version-2 file is an unknown kind there, refused by name
    bad = write_file(tmp_path / "v2.bin", version=2, monkeypatch=monkeypatch)
    with pytest.raises(results.ResultFileError, match="unknown record kind 7 \\(metrics, a "
                                                      "version-3 kind\\)"):
        results.read_results(bad)


def test_version_2_files_still_read(tmp_path, monkeypatch):
    path = write_file(tmp_path / "v2.bin", version=2, monkeypatch=monkeypatch,
                      with_metrics=False)
    r = results.read_results(path)
    assert r.version == 2 and r.stopped is None and r.metrics == []
    assert [s for s, _ in r.steps] == [0] and r.norm_values.tolist() == [1.5]


# ------------------------------------------------------------------- compare

def test_report_compare(tmp_path, stream, monkeypatch, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert train(stream, a, "--steps", "4", "--interval", "2") == 0
    assert train(stream, b, "--steps", "2", "--batch", "2", "--eval-every", "0") == 0
    figures = []
    real = report.compare_figure

    def keep(runs, names):
        figures.append(real(runs, names))
        return figures[-1]

    monkeypatch.setattr(report, "compare_figure", keep)
    capsys.readouterr()
    png = tmp_path / "c.png"
    assert main(["report", "--compare", str(a), str(b), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == report.PNG_MAGIC
    (fig,) = figures
    by_step, by_tokens = fig.axes
    # a: training and held-out; b: training only (no evaluation)
    for ax in (by_step, by_tokens):
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels == ["a: training (EMA 0.9)", "a: held-out", "b: training (EMA 0.9)"]
    T = CFG.context
    assert by_step.get_lines()[1].get_xdata().tolist() == [2, 4]
    assert by_tokens.get_lines()[1].get_xdata().tolist() == [2 * T, 4 * T]
    assert np.nanmax(by_tokens.get_lines()[2].get_xdata()) == 1 * 2 * T  # b: step 1, B = 2
    assert main(["report", "--compare", str(a), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing" in err[0]
