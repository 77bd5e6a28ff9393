"""The result file (SPEC section 11): layout of every record kind, reading
during and after a run, truncation at every length, CRC, no overwriting;
version-1 files still read, unknown kinds and inconsistent records refused.

Record boundaries and payloads are computed in this file from the layout
(struct, zlib), independently of the module."""

import json
import math
import os
import struct
import zlib
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, strategies as st

from coppelius.reference import results
from coppelius.reference.checkpoint import identities
from coppelius.reference.config import Hyper, preset
from coppelius.reference.errors import ResultFileError
from coppelius.reference.results import (ResultWriter, default_results_path, prediction_rows, read_results,
                               result_header)

CONFIG = preset("test")
B, T, V = 2, CONFIG.context, CONFIG.vocab
IDS = identities(CONFIG, Hyper(), "fp32", B, None, "ab" * 32)


def header(first_step=4, steps=3, repeat=False):
    return result_header(CONFIG, IDS, first_step, steps, B, "reference", repeat)


K = 5  # held-out contexts of the evaluations below


def records(seed=0, steps=(4, 5, 6)):
    """A run's worth of record contents: an evaluation after every other
    update (steps 5 and 6 leave 6 and 7 updates done) and after the last."""
    rng = np.random.default_rng(seed)
    return dict(
        forward=rng.standard_normal((3, V)).astype(np.float32),
        steps=[(s, rng.uniform(0, 5, (B, T)).astype(np.float32)) for s in steps],
        timings=[(s, float(rng.uniform(0.01, 1)), math.nan if s % 2 else float(rng.uniform(0, 1)))
                 for s in steps],
        norms=[(s, np.float32(rng.uniform(0, 3))) for s in steps],
        evals={s + 1: rng.uniform(2, 6, K).astype(np.float32) for s in steps
               if (s + 1) % 2 == 0 or s == steps[-1]},
        loss_block=rng.standard_normal((4, T)).astype(np.float32),
        logits_last=rng.standard_normal(V).astype(np.float32),
        predictions=[(7, 1), (63, 0), (0, 1)],
    )


def write_run(path, rec, final=True):
    with ResultWriter(path, header(steps=len(rec["steps"]))) as w:
        w.forward(rec["forward"])
        for (s, rows), (_, host, device), (_, norm) in zip(rec["steps"], rec["timings"], rec["norms"]):
            w.step(s, rows)
            w.timing(s, host, device)
            w.norm(s, norm)
            if s + 1 in rec["evals"]:
                w.eval(s + 1, rec["evals"][s + 1])
        if final:
            w.final(rec["loss_block"], rec["logits_last"], rec["predictions"])


def mean_of(losses) -> np.float32:
    """SPEC 11 kind 5's mean as this project reads it: the exact sum of the
    float32 losses rounded to float64, divided by K in float64, then float32
    (computed with fractions here, not with fsum as the module does)."""
    exact = sum(Fraction(float(x)) for x in losses)
    return np.float32(float(exact) / len(losses))


def expected_records(rec):
    """[(kind, payload)] in file order, built from SPEC 11's table."""
    out = [(1, rec["forward"].astype("<f4").tobytes())]
    for (s, rows), (_, host, device), (_, norm) in zip(rec["steps"], rec["timings"], rec["norms"]):
        out.append((2, struct.pack("<Q", s) + rows.astype("<f4").tobytes()))
        out.append((3, struct.pack("<Qdd", s, host, device)))
        out.append((6, struct.pack("<Qf", s, norm)))
        if s + 1 in rec["evals"]:
            losses = rec["evals"][s + 1]
            out.append((5, struct.pack("<QIf", s + 1, len(losses), mean_of(losses))
                        + losses.astype("<f4").tobytes()))
    preds = struct.pack("<6I", *[x for p in rec["predictions"] for x in p])
    out.append((4, rec["loss_block"].astype("<f4").tobytes()
                + rec["logits_last"].astype("<f4").tobytes() + preds))
    return out


def count_read(r) -> int:
    return (int(r.forward is not None) + len(r.steps) + len(r.timings) + len(r.norms)
            + len(r.evals) + int(r.final is not None))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("results") / "results-4.bin"
    rec = records()
    write_run(path, rec)
    data = path.read_bytes()
    hn = struct.unpack_from("<I", data, 12)[0]
    start = (16 + hn + 4095) // 4096 * 4096
    bounds = [start]  # offsets of record starts, then the end of the file
    for _, payload in expected_records(rec):
        bounds.append(bounds[-1] + 8 + len(payload) + 4)
    return path, rec, data, bounds


def test_layout_matches_spec(run):
    _, rec, data, bounds = run
    magic, version, hn = struct.unpack_from("<8sII", data, 0)
    assert magic == b"CPLSRSLT" and version == 3
    raw = data[16:16 + hn]
    h = json.loads(raw)
    assert raw == json.dumps(h, sort_keys=True, separators=(",", ":")).encode()
    assert h == {"model": IDS["model"], "learner": IDS["learner"], "data": IDS["data"],
                 "initialization": IDS["initialization"], "first_step": 4, "steps": 3, "batch": B, "context": T, "vocab": V,
                 "prediction_rows": [T // 4 - 1, T // 2 - 1, T - 1], "backend": "reference",
                 "repeat_data": False}
    assert bounds[0] % 4096 == 0 and data[16 + hn:bounds[0]] == bytes(bounds[0] - 16 - hn)
    offset = bounds[0]
    for kind, payload in expected_records(rec):
        head = struct.pack("<II", kind, len(payload))
        assert data[offset:offset + 8] == head
        assert data[offset + 8:offset + 8 + len(payload)] == payload, kind
        crc = struct.unpack_from("<I", data, offset + 8 + len(payload))[0]
        assert crc == zlib.crc32(head + payload)
        offset += 8 + len(payload) + 4
    assert offset == len(data) == bounds[-1]


def test_round_trip_every_kind(run):
    path, rec, _, bounds = run
    r = read_results(path)
    assert r.header == header()
    assert r.forward.tobytes() == rec["forward"].tobytes() and r.forward.shape == (3, V)
    assert [s for s, _ in r.steps] == [4, 5, 6]
    for (_, got), (_, want) in zip(r.steps, rec["steps"]):
        assert got.dtype == np.float32 and got.tobytes() == want.tobytes()
    assert len(r.timings) == 3
    for got, want in zip(r.timings, rec["timings"]):
        assert got[0] == want[0] and got[1] == want[1]
        assert got[2] == want[2] or (math.isnan(got[2]) and math.isnan(want[2]))
    assert r.final["loss_block"].tobytes() == rec["loss_block"].tobytes()
    assert r.final["logits_last"].tobytes() == rec["logits_last"].tobytes()
    assert r.final["predictions"] == rec["predictions"]
    assert r.version == 3
    assert r.norm_steps.tolist() == [4, 5, 6] and r.norm_steps.dtype == np.int64
    assert r.norm_values.tobytes() == np.array([n for _, n in rec["norms"]], "<f4").tobytes()
    assert r.eval_steps.tolist() == [6, 7] == sorted(rec["evals"])
    assert r.eval_losses.shape == (2, K) and r.eval_losses.dtype == np.float32
    assert r.eval_losses.tobytes() == np.stack([rec["evals"][6], rec["evals"][7]]).tobytes()
    assert r.eval_means.tolist() == [mean_of(rec["evals"][6]), mean_of(rec["evals"][7])]
    assert r.complete and r.stopped is None and r.end == bounds[-1]


def test_prediction_rows():
    assert prediction_rows(16) == [3, 7, 15]
    assert prediction_rows(1024) == [255, 511, 1023]


def test_truncation_at_every_length_reads_complete_records(tmp_path, run):
    _, _, data, bounds = run
    kinds = [k for k, _ in expected_records(run[1])]
    path = tmp_path / "cut.bin"
    for length in range(bounds[0], len(data) + 1):
        path.write_bytes(data[:length])
        r = read_results(path)
        done = sum(1 for b in bounds[1:] if b <= length)  # complete records
        assert count_read(r) == done, length
        assert len(r.steps) == kinds[:done].count(2)
        assert len(r.evals) == kinds[:done].count(5) and len(r.norms) == kinds[:done].count(6)
        assert r.end == bounds[done]
        if length == bounds[done]:
            assert r.stopped is None
        else:
            assert r.stopped == f"truncated record at offset {bounds[done]}", length
        assert r.complete == (length == len(data))


def test_truncation_inside_the_header_refused(tmp_path, run):
    _, _, data, bounds = run
    path = tmp_path / "cut.bin"
    for length in (0, 8, 15, 16, 100, bounds[0] - 1):
        path.write_bytes(data[:length])
        with pytest.raises(ResultFileError) as e:
            read_results(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)


@given(st.data())
def test_flipped_byte_in_a_record_is_caught(tmp_path_factory, run, data):
    _, _, good, bounds = run
    offset = data.draw(st.integers(bounds[0], len(good) - 1), label="offset")
    mask = data.draw(st.integers(1, 255), label="mask")
    bad = bytearray(good)
    bad[offset] ^= mask
    path = tmp_path_factory.mktemp("flip") / "bad.bin"
    path.write_bytes(bytes(bad))
    r = read_results(path)
    k = max(i for i, b in enumerate(bounds[:-1]) if b <= offset)  # the damaged record
    assert r.end == bounds[k]  # every record before it is read, none after
    assert count_read(r) == k and not r.complete
    if offset >= bounds[k] + 8:  # payload or CRC: only the CRC can tell
        assert r.stopped == f"bad CRC at offset {bounds[k]}"
    else:
        # kind or length: a length not its kind's is refused before the
        # payload is read, one past the file is a cut, and a length or kind
        # that fits is read and fails its CRC, which covers both. Never an
        # error: one flipped byte is damage, and damage stops the reader.
        assert (r.stopped.startswith(f"bad record header at offset {bounds[k]} ")
                or r.stopped in (f"bad CRC at offset {bounds[k]}",
                                 f"truncated record at offset {bounds[k]}")), r.stopped


def test_bad_magic_and_header_refused(tmp_path, run):
    _, _, data, bounds = run
    path = tmp_path / "bad.bin"
    hn = struct.unpack_from("<I", data, 12)[0]
    cases = {
        "magic": b"CPLSCKPT" + data[8:],
        "version 9": data[:8] + struct.pack("<I", 9) + data[12:],
        "exceeds": data[:12] + struct.pack("<I", 1 << 30) + data[16:],
        "not UTF-8 JSON": data[:16] + b"\xff" + data[17:],
        "'batch'": data.replace(b'"batch":2,', b'"batch":0,'),
        "padding": data[:16 + hn] + b"\x01" + data[17 + hn:],
    }
    for match, bad in cases.items():
        path.write_bytes(bad)
        with pytest.raises(ResultFileError, match=match) as e:
            read_results(path)
        assert str(path) in str(e.value)


def test_reader_sees_each_record_as_it_is_written(tmp_path):
    path = tmp_path / "live.bin"
    rec = records(1)
    with ResultWriter(path, header()) as w:
        assert read_results(path).end == 4096 and read_results(path).stopped is None
        w.forward(rec["forward"])
        assert read_results(path).forward is not None
        for i, (s, rows) in enumerate(rec["steps"]):
            w.step(s, rows)
            r = read_results(path)
            assert len(r.steps) == i + 1 and r.steps[-1][1].tobytes() == rows.tobytes()
            assert r.stopped is None and not r.complete


def test_existing_path_refused(tmp_path):
    path = tmp_path / "results-0.bin"
    path.write_bytes(b"precious")
    with pytest.raises(ResultFileError, match="already exists") as e:
        ResultWriter(path, header())
    assert str(path) in str(e.value)
    assert path.read_bytes() == b"precious"


def test_writer_refuses_wrong_shapes(tmp_path):
    with ResultWriter(tmp_path / "r.bin", header()) as w:
        with pytest.raises(ResultFileError, match="row losses"):
            w.step(0, np.zeros((B, T + 1), np.float32))
        with pytest.raises(ResultFileError, match="forward"):
            w.forward(np.zeros((V, 3), np.float32))
    assert read_results(tmp_path / "r.bin").steps == []


def test_default_results_path_adds_suffixes(tmp_path):
    assert default_results_path(tmp_path, 12) == os.path.join(tmp_path, "results-12.bin")
    for name in ["results-12.bin", "results-12-1.bin", "results-12-2.bin"]:
        assert default_results_path(tmp_path, 12) == os.path.join(tmp_path, name)
        (tmp_path / name).write_bytes(b"")
    assert default_results_path(tmp_path, 12) == os.path.join(tmp_path, "results-12-3.bin")
    assert default_results_path(tmp_path, 0) == os.path.join(tmp_path, "results-0.bin")


def test_header_carries_repeat_data(tmp_path):
    path = tmp_path / "r.bin"
    ResultWriter(path, header(repeat=True)).close()
    assert read_results(path).header["repeat_data"] is True
    assert results.MAGIC == b"CPLSRSLT"


# ------------------------------------------------------------ version 2 by hand

def record(kind, payload) -> bytes:
    head = struct.pack("<II", kind, len(payload))
    return head + payload + struct.pack("<I", zlib.crc32(head + payload))


def file_bytes(version, h, *recs) -> bytes:
    """A result file laid out from SPEC 11, independently of the writer."""
    raw = json.dumps(h, sort_keys=True, separators=(",", ":")).encode()
    start = struct.pack("<8sII", b"CPLSRSLT", version, len(raw)) + raw
    return start + bytes(-len(start) % 4096) + b"".join(recs)


def v1_header():
    h = header(first_step=0, steps=2)
    del h["initialization"]  # version 1 did not carry it
    return h


def test_version_1_file_still_reads(tmp_path):
    rows = np.arange(B * T, dtype=np.float32).reshape(B, T) / 7
    path = tmp_path / "v1.bin"
    path.write_bytes(file_bytes(1, v1_header(),
                                record(2, struct.pack("<Q", 0) + rows.tobytes()),
                                record(3, struct.pack("<Qdd", 0, 0.5, math.nan)),
                                record(2, struct.pack("<Q", 1) + (rows + 1).tobytes())))
    r = read_results(path)
    assert r.version == 1 and r.stopped is None and "initialization" not in r.header
    assert [s for s, _ in r.steps] == [0, 1] and r.steps[1][1].tobytes() == (rows + 1).tobytes()
    assert r.timings[0][:2] == (0, 0.5) and r.evals == [] and r.norms == []
    assert r.eval_losses.shape == (0, 0) and r.norm_values.shape == (0,)


@pytest.mark.parametrize("kind, payload, name", [
    (5, struct.pack("<QIf", 1, 1, 2.0) + struct.pack("<f", 2.0), "eval"),
    (6, struct.pack("<Qf", 0, 1.5), "norm"),
])
def test_version_2_kinds_refused_in_a_version_1_file(tmp_path, kind, payload, name):
    path = tmp_path / "v1.bin"
    path.write_bytes(file_bytes(1, v1_header(), record(kind, payload)))
    with pytest.raises(ResultFileError) as e:
        read_results(path)
    msg = str(e.value)
    assert f"unknown record kind {kind} ({name}" in msg and "offset 4096" in msg
    assert str(path) in msg and "\n" not in msg


def test_version_2_header_needs_the_initialization(tmp_path):
    path = tmp_path / "v2.bin"
    path.write_bytes(file_bytes(2, v1_header()))
    with pytest.raises(ResultFileError, match="'initialization'"):
        read_results(path)


def test_unknown_kind_is_refused_by_name(tmp_path, run):
    _, _, data, bounds = run
    path = tmp_path / "future.bin"
    path.write_bytes(data[:bounds[2]] + record(8, b"news from a later version"))
    with pytest.raises(ResultFileError) as e:
        read_results(path)
    msg = str(e.value)
    assert msg == (f"result file {path}: record at offset {bounds[2]}: unknown record kind 8: "
                   f"a version-3 file has kinds 1, 2, 3, 4, 5, 6, 7")


def test_unknown_kind_with_a_bad_crc_is_damage(tmp_path, run):
    _, _, data, bounds = run
    bad = bytearray(record(8, b"x" * 40))
    bad[-1] ^= 1
    path = tmp_path / "damaged.bin"
    path.write_bytes(data[:bounds[2]] + bytes(bad))
    r = read_results(path)
    assert r.stopped == f"bad CRC at offset {bounds[2]}" and r.end == bounds[2]


@pytest.mark.parametrize("kind", [2, 5, 8])
def test_a_length_past_the_end_of_the_file_is_not_read(tmp_path, run, kind):
    # the reader compares n with the file size first, so a hostile length
    # (here 4 GiB - 4) allocates nothing: it reads as a cut record
    _, _, data, bounds = run
    n = 0xFFFFFFFC if kind != 2 else 8 + 4 * B * T
    path = tmp_path / "long.bin"
    path.write_bytes(data[:bounds[1]] + struct.pack("<II", kind, n) + bytes(16))
    r = read_results(path)
    assert r.stopped == f"truncated record at offset {bounds[1]}" and r.end == bounds[1]


@pytest.mark.parametrize("payload, match", [
    (struct.pack("<QIf", 3, 4, 1.0) + struct.pack("<3f", 1, 1, 1), "K=4 contexts needs 32 payload bytes"),
    (struct.pack("<QIf", 3, 2, 1.0) + struct.pack("<3f", 1, 1, 1), "K=2 contexts needs 24"),
    (struct.pack("<QIf", 3, 3, 1.5) + struct.pack("<3f", 1, 1, 1), "stored mean 1.5 is not the mean"),
    (struct.pack("<QIf", 2**63, 1, 1.0) + struct.pack("<f", 1), "step number 9223372036854775808"),
])
def test_inconsistent_eval_record_is_refused(tmp_path, payload, match):
    path = tmp_path / "bad.bin"
    path.write_bytes(file_bytes(2, header(), record(5, payload)))
    with pytest.raises(ResultFileError, match=match) as e:
        read_results(path)
    assert str(path) in str(e.value) and "offset 4096" in str(e.value)


def test_eval_record_of_no_contexts_is_a_bad_header(tmp_path):
    path = tmp_path / "k0.bin"
    path.write_bytes(file_bytes(2, header(), record(5, struct.pack("<QIf", 3, 0, 0.0))))
    assert read_results(path).stopped == "bad record header at offset 4096 (kind 5, 16 bytes)"


def test_eval_k_may_not_change_within_a_file(tmp_path):
    one = struct.pack("<QIf", 1, 1, 2.0) + struct.pack("<f", 2.0)
    two = struct.pack("<QIf", 2, 2, 2.0) + struct.pack("<2f", 2.0, 2.0)
    path = tmp_path / "k.bin"
    path.write_bytes(file_bytes(2, header(), record(5, one), record(5, two)))
    with pytest.raises(ResultFileError, match="K=2 contexts, the file's first one had 1"):
        read_results(path)
    with ResultWriter(tmp_path / "w.bin", header()) as w:
        w.eval(1, np.ones(3, np.float32))
        with pytest.raises(ResultFileError, match="K=4 contexts, earlier ones had 3"):
            w.eval(2, np.ones(4, np.float32))


finite32 = st.floats(0, 20, width=32)
any32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@given(evals=st.lists(st.tuples(st.integers(0, 2**63 - 1), st.one_of(finite32, any32)), max_size=4),
       k=st.integers(1, 40), norms=st.lists(st.tuples(st.integers(0, 2**63 - 1), any32), max_size=6),
       seed=st.integers(0, 2**32 - 1))
def test_eval_and_norm_round_trip(tmp_path_factory, evals, k, norms, seed):
    rng = np.random.default_rng(seed)
    written = []
    path = tmp_path_factory.mktemp("v2") / "r.bin"
    with ResultWriter(path, header()) as w:
        for step, spike in evals:
            losses = rng.uniform(0, 10, k).astype(np.float32)
            losses[rng.integers(k)] = spike  # now and then NaN or an infinity
            w.eval(step, losses)
            written.append((step, losses))
        for step, norm in norms:
            w.norm(step, norm)
    r = read_results(path)
    assert r.stopped is None and r.version == 3
    assert r.eval_steps.tolist() == [s for s, _ in written]
    assert r.eval_losses.reshape(-1).tobytes() == b"".join(x.tobytes() for _, x in written)
    for got, (_, losses) in zip(r.eval_means, written):
        with np.errstate(invalid="ignore"):  # inf - inf: NaN, as the record has it
            want = (mean_of(losses) if np.isfinite(losses).all()
                    else np.float32(np.sum(losses, dtype=np.float64) / k))
        assert got.tobytes() == want.tobytes() or (np.isnan(got) and np.isnan(want))
    assert r.norm_steps.tolist() == [s for s, _ in norms]
    assert r.norm_values.tobytes() == np.array([n for _, n in norms], "<f4").tobytes()


def test_eval_mean_is_exact():
    # 1 + 2^-24 + 2^-24 (float32 values): a float32 running sum loses both
    # halves; the exact mean (1 + 2^-23) / 3 is what the record stores
    losses = np.array([1.0, 2.0**-24, 2.0**-24], np.float32)
    assert results.eval_mean(losses) == np.float32((1 + 2.0**-23) / 3) == mean_of(losses)
    assert np.isnan(results.eval_mean(np.array([np.inf, -np.inf, 1], np.float32)))
    assert results.eval_mean(np.array([np.inf, 1], np.float32)) == np.inf


@pytest.mark.parametrize("call, match", [
    (lambda w: w.eval(1, np.zeros(0, np.float32)), r"shape \(0,\)"),
    (lambda w: w.eval(1, np.zeros((2, 2), np.float32)), r"shape \(2, 2\)"),
    (lambda w: w.eval(-1, np.zeros(2, np.float32)), "step number -1"),
    (lambda w: w.norm(2**63, 1.0), "step number 9223372036854775808"),
    (lambda w: w.norm(1.5, 1.0), "step number 1.5"),
])
def test_writer_refuses_bad_eval_and_norm(tmp_path, call, match):
    with ResultWriter(tmp_path / "r.bin", header()) as w:
        with pytest.raises(ResultFileError, match=match):
            call(w)
    assert read_results(tmp_path / "r.bin").end == 4096  # nothing was written
