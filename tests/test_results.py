"""The result file (SPEC section 11): layout of every record kind, reading
during and after a run, truncation at every length, CRC, no overwriting.

Record boundaries and payloads are computed in this file from the layout
(struct, zlib), independently of the module."""

import json
import math
import os
import struct
import zlib

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


def records(seed=0, steps=(4, 5, 6)):
    """A run's worth of record contents."""
    rng = np.random.default_rng(seed)
    return dict(
        forward=rng.standard_normal((3, V)).astype(np.float32),
        steps=[(s, rng.uniform(0, 5, (B, T)).astype(np.float32)) for s in steps],
        timings=[(s, float(rng.uniform(0.01, 1)), math.nan if s % 2 else float(rng.uniform(0, 1)))
                 for s in steps],
        loss_block=rng.standard_normal((4, T)).astype(np.float32),
        logits_last=rng.standard_normal(V).astype(np.float32),
        predictions=[(7, 1), (63, 0), (0, 1)],
    )


def write_run(path, rec, final=True):
    with ResultWriter(path, header(steps=len(rec["steps"]))) as w:
        w.forward(rec["forward"])
        for (s, rows), (_, host, device) in zip(rec["steps"], rec["timings"]):
            w.step(s, rows)
            w.timing(s, host, device)
        if final:
            w.final(rec["loss_block"], rec["logits_last"], rec["predictions"])


def expected_records(rec):
    """[(kind, payload)] in file order, built from SPEC 11's table."""
    out = [(1, rec["forward"].astype("<f4").tobytes())]
    for (s, rows), (_, host, device) in zip(rec["steps"], rec["timings"]):
        out.append((2, struct.pack("<Q", s) + rows.astype("<f4").tobytes()))
        out.append((3, struct.pack("<Qdd", s, host, device)))
    preds = struct.pack("<6I", *[x for p in rec["predictions"] for x in p])
    out.append((4, rec["loss_block"].astype("<f4").tobytes()
                + rec["logits_last"].astype("<f4").tobytes() + preds))
    return out


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
    assert magic == b"CPLSRSLT" and version == 1
    raw = data[16:16 + hn]
    h = json.loads(raw)
    assert raw == json.dumps(h, sort_keys=True, separators=(",", ":")).encode()
    assert h == {"model": IDS["model"], "learner": IDS["learner"], "data": IDS["data"],
                 "first_step": 4, "steps": 3, "batch": B, "context": T, "vocab": V,
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
        read = (int(r.forward is not None) + len(r.steps) + len(r.timings)
                + int(r.final is not None))
        assert read == done, length
        assert len(r.steps) == kinds[:done].count(2)
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
    assert not r.complete
    if offset >= bounds[k] + 8:  # payload or CRC: only the CRC can tell
        assert r.stopped == f"bad CRC at offset {bounds[k]}"
    else:  # kind or length (each kind has its own length here): refused before the payload is read
        assert r.stopped.startswith(f"bad record header at offset {bounds[k]} ")


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
