"""The checkpoint file (SPEC section 10): layout, identities, refusal of
corrupt and hostile files, and atomic publication under crashes and ENOSPC.

The layout is checked by an independent parser and writer in this file
(struct, json and hashlib), not by the module against itself."""

import errno
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, strategies as st

from coppelius.reference import checkpoint, fsutil
from coppelius.reference.binding import load_state
from coppelius.reference.sources import BindingError
from coppelius.reference.checkpoint import (identities, is_fresh, validate,
                                  write_checkpoint)
from coppelius.reference.config import Hyper, preset
from coppelius.reference.errors import CheckpointError, IdentityMismatch
from coppelius.reference.params import initialize, registry
from coppelius.reference.state import State

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = preset("test")
N = registry(CONFIG).total
TOKENIZER_SHA = hashlib.sha256(b"tokenizer").hexdigest()
STREAM_SHA = hashlib.sha256(b"stream").hexdigest()


def run_identities(**overrides):
    args = dict(hyper=Hyper(), precision="fp32", batch=4, tokenizer_sha=TOKENIZER_SHA,
                stream_sha=STREAM_SHA)
    args.update(overrides)
    return identities(CONFIG, args["hyper"], args["precision"], args["batch"],
                      args["tokenizer_sha"], args["stream_sha"])


def make_state(seed: int, t: int) -> State:
    rng = np.random.default_rng(seed)
    P = initialize(CONFIG) + rng.standard_normal(N).astype(np.float32) * np.float32(1e-3)
    M = rng.standard_normal(N).astype(np.float32) * np.float32(1e-2)
    V = np.abs(rng.standard_normal(N)).astype(np.float32) * np.float32(1e-4)
    return State(P=P, M=M, V=V, t=t)


def parse(data: bytes) -> dict:
    """An independent parse of SPEC 10's layout."""
    magic, version, hn = struct.unpack_from("<8sII", data, 0)
    raw = data[16:16 + hn]
    payload_offset = (16 + hn + 4095) // 4096 * 4096
    trailer = len(data) - 48
    t_magic, t_bytes, digest = struct.unpack_from("<8sQ32s", data, trailer)
    return dict(magic=magic, version=version, raw=raw, header=json.loads(raw),
                padding=data[16 + hn:payload_offset], payload_offset=payload_offset,
                payload=data[payload_offset:trailer], trailer_magic=t_magic,
                trailer_bytes=t_bytes, digest=digest, trailer=trailer)


def build(header, payload: bytes, raw: bytes | None = None, pad: int = 0) -> bytes:
    """An independent writer: any header (or raw header bytes), a valid trailer."""
    if raw is None:
        raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    start = struct.pack("<8sII", b"CPLSCKPT", 1, len(raw)) + raw
    body = start + bytes([pad]) * (-len(start) % 4096) + payload
    return body + struct.pack("<8sQ", b"CPLSDONE", len(payload)) + hashlib.sha256(body).digest()


class Saved(tuple):
    """(path, state, bytes) of a checkpoint; a short repr for hypothesis' reports."""

    def __repr__(self):
        return f"Saved({self[0]})"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint written by the module, its state and its bytes."""
    path = tmp_path_factory.mktemp("ckpt") / "model.ckpt"
    state = make_state(1, t=7)
    write_checkpoint(path, CONFIG, run_identities(), state, contexts=28)
    return Saved((path, state, path.read_bytes()))


# ------------------------------------------------------------- layout, round trip

def test_round_trip_bytes(saved):
    path, state, _ = saved
    ck = load_state(path, CONFIG, expect=run_identities())
    for name in ("P", "M", "V"):
        got = getattr(ck.state, name)
        assert got.dtype == np.float32 and got.shape == (N,)
        assert got.tobytes() == getattr(state, name).tobytes(), name
    assert ck.step == ck.state.t == 7
    assert ck.contexts == 28


def test_layout_matches_spec(saved):
    path, state, data = saved
    f = parse(data)
    assert f["magic"] == b"CPLSCKPT" and f["version"] == 1
    # Keys sorted, no insignificant spaces: the canonical dump reproduces the bytes.
    assert f["raw"] == json.dumps(f["header"], sort_keys=True, separators=(",", ":")).encode()
    assert list(f["header"]) == sorted(f["header"])
    assert f["payload_offset"] % 4096 == 0 and f["payload_offset"] >= 16 + len(f["raw"])
    assert f["padding"] == bytes(len(f["padding"]))
    want = np.concatenate([state.P, state.M, state.V]).astype("<f4").tobytes()
    assert f["payload"] == want
    assert f["trailer_magic"] == b"CPLSDONE" and f["trailer_bytes"] == 12 * N
    assert f["digest"] == hashlib.sha256(data[:f["trailer"]]).digest()
    assert len(data) == f["payload_offset"] + 12 * N + 48
    h = f["header"]
    for key, value in run_identities().items():
        assert h[key] == value
    assert h["step"] == 7 and h["contexts"] == 28
    assert h["chunk_bytes"] == 4194304
    assert h["schema"] == f"coppelius-raw-pmv-f32-v1|parameter-order:p-then-m-then-v|payload={12 * N}"
    # Parameters: canonical order, contiguous offsets in elements.
    offset = 0
    for p, spec in zip(h["parameters"], registry(CONFIG).specs):
        assert p == {"name": spec.name, "shape": list(spec.shape), "offset": offset}
        offset += int(np.prod(p["shape"]))
    assert offset == N and len(h["parameters"]) == len(registry(CONFIG).specs)


def test_chunking_does_not_change_the_bytes(tmp_path, saved, monkeypatch):
    """Chunks that split floats and arrays unevenly give the same file and arrays."""
    ids = run_identities()  # chunk_bytes=4194304 in the envelope, as in `saved`
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 4096 * 3 + 6)
    # synced on the way every 40 pages: each sync sees the file grown by at least that
    monkeypatch.setattr(checkpoint, "SYNC_BYTES", 4096 * 40)
    synced = []
    monkeypatch.setattr(checkpoint, "_datasync", lambda fd: synced.append(os.fstat(fd).st_size))
    path = tmp_path / "chunked.ckpt"
    write_checkpoint(path, CONFIG, ids, saved[1], contexts=28)
    assert path.read_bytes() == saved[2]
    # a sync after at least 40 pages and before a piece more
    assert len(saved[2]) // (4096 * 43 + 6) <= len(synced) <= len(saved[2]) // (4096 * 40)
    assert all(size >= (i + 1) * 4096 * 40 for i, size in enumerate(synced))
    ck = load_state(path, CONFIG, expect=ids)
    assert ck.state.M.tobytes() == saved[1].M.tobytes()
    assert validate(path).sha256 == hashlib.sha256(saved[2][:-48]).hexdigest()


def test_validate_reports_digest(saved):
    path, _, data = saved
    info = validate(path)
    f = parse(data)
    assert info.sha256 == f["digest"].hex()
    assert info.payload_offset == f["payload_offset"] and info.payload_bytes == 12 * N
    assert info.file_size == len(data)


def test_reads_a_file_written_independently(tmp_path):
    state = make_state(2, t=3)
    header = dict(run_identities(), step=3, contexts=12, parameters=registry(CONFIG).describe())
    payload = np.concatenate([state.P, state.M, state.V]).astype("<f4").tobytes()
    path = tmp_path / "other.ckpt"
    path.write_bytes(build(header, payload))
    ck = load_state(path, CONFIG, expect=run_identities())
    assert ck.state.V.tobytes() == state.V.tobytes() and ck.step == 3 and ck.contexts == 12


def test_is_fresh(tmp_path, saved):
    assert is_fresh(tmp_path / "missing.ckpt")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    assert is_fresh(tmp_path / "empty.ckpt")
    assert not is_fresh(saved[0])
    (tmp_path / "junk.ckpt").write_bytes(b"x")
    assert not is_fresh(tmp_path / "junk.ckpt")  # not fresh: refused by validation instead
    with pytest.raises(CheckpointError):
        validate(tmp_path / "junk.ckpt")


# ------------------------------------------------------------------ identities

def changed(key):
    ids = run_identities()
    if key == "chunk_bytes":
        ids[key] = 2 * ids[key]
    elif key == "schema":
        ids[key] = ids[key].replace("payload=", "payload=1")
    elif key == "model":
        ids[key] = ids[key].replace("rope_base=10000", "rope_base=500000")
    elif key == "learner":
        ids = run_identities(precision="bf16")
    elif key == "data":
        ids = run_identities(batch=8)
    elif key == "initialization":
        ids[key] = ids[key].replace("seed=20260925", "seed=1")
    assert ids[key] != run_identities()[key]
    return ids


@pytest.mark.parametrize("key", checkpoint.IDENTITY_KEYS)
def test_identity_mismatch_names_key_and_both_values(saved, key):
    path = saved[0]
    want = changed(key)
    with pytest.raises(IdentityMismatch) as e:
        load_state(path, CONFIG, expect=want)
    message = str(e.value)
    assert key in message and "\n" not in message
    assert repr(run_identities()[key]) in message and repr(want[key]) in message
    # --new-data does not lift anything but the stream part.
    with pytest.raises(IdentityMismatch):
        load_state(path, CONFIG, expect=want, new_data=True)


def test_new_data_lifts_only_the_stream(saved):
    path = saved[0]
    other = hashlib.sha256(b"another corpus").hexdigest()
    with pytest.raises(IdentityMismatch, match="data"):
        load_state(path, CONFIG, expect=run_identities(stream_sha=other))
    ck = load_state(path, CONFIG, expect=run_identities(stream_sha=other), new_data=True)
    assert ck.step == 7
    for overrides in (dict(tokenizer_sha=other), dict(batch=2), dict(tokenizer_sha=None)):
        want = run_identities(stream_sha=other, **overrides)
        with pytest.raises(IdentityMismatch) as e:
            load_state(path, CONFIG, expect=want, new_data=True)
        assert want["data"] in str(e.value)


def test_other_model_shape_refused(saved):
    # without an expected model identity, binding lists the tensors the file lacks
    with pytest.raises(BindingError, match="missing tensors 'layers.2.attn.k.weight'"):
        load_state(saved[0], preset("tiny"))


# -------------------------------------------------------- corrupt files refused

def region(data_len):
    """Offsets anywhere, with extra weight on the small regions (prefix, header, trailer)."""
    return st.one_of(st.integers(0, data_len - 1), st.integers(0, 4095),
                     st.integers(data_len - 48, data_len - 1))


@given(st.data())
def test_flipped_byte_refused_and_file_untouched(tmp_path_factory, saved, data):
    _, _, good = saved
    offset = data.draw(region(len(good)), label="offset")
    mask = data.draw(st.integers(1, 255), label="mask")
    bad = bytearray(good)
    bad[offset] ^= mask
    path = tmp_path_factory.mktemp("flip") / "bad.ckpt"
    path.write_bytes(bytes(bad))
    with pytest.raises(CheckpointError) as e:
        validate(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CheckpointError):
        load_state(path, CONFIG, expect=run_identities())
    assert path.read_bytes() == bytes(bad)


@given(st.data())
def test_truncation_refused_and_file_untouched(tmp_path_factory, saved, data):
    _, _, good = saved
    length = data.draw(region(len(good)), label="length")
    path = tmp_path_factory.mktemp("cut") / "cut.ckpt"
    path.write_bytes(good[:length])
    with pytest.raises(CheckpointError):
        validate(path)
    with pytest.raises(CheckpointError):
        load_state(path, CONFIG)
    assert path.read_bytes() == good[:length]


def test_appended_byte_refused(tmp_path, saved):
    path = tmp_path / "long.ckpt"
    path.write_bytes(saved[2] + b"\0")
    with pytest.raises(CheckpointError, match="bytes"):
        validate(path)


# ---------------------------------------------------------------- hostile headers

def good_header():
    return dict(run_identities(), step=3, contexts=12, parameters=registry(CONFIG).describe())


def good_payload():
    return bytes(12 * N)


def test_header_length_over_limit_refused_unread(tmp_path):
    hn = checkpoint.MAX_HEADER + 1
    path = tmp_path / "huge.ckpt"
    with open(path, "wb") as f:
        f.write(struct.pack("<8sII", b"CPLSCKPT", 1, hn))
        f.truncate(16 + hn + 4096 + 48)  # the bytes exist (sparse): only the field refuses them
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=f"header length {hn}"):
            validate(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"validation allocated {peak} bytes before refusing"


def test_header_length_beyond_file_refused(tmp_path):
    path = tmp_path / "short.ckpt"
    path.write_bytes(struct.pack("<8sII", b"CPLSCKPT", 1, 1 << 20) + bytes(100))
    with pytest.raises(CheckpointError, match="beyond the file"):
        validate(path)


def test_bad_magic_and_version_refused(tmp_path, saved):
    good = saved[2]
    path = tmp_path / "x.ckpt"
    path.write_bytes(b"CPLSXXXX" + good[8:])
    with pytest.raises(CheckpointError, match="magic"):
        validate(path)
    path.write_bytes(good[:8] + struct.pack("<I", 2) + good[12:])
    with pytest.raises(CheckpointError, match="version 2"):
        validate(path)


def without(key):
    h = good_header()
    del h[key]
    return h


def with_(**changes):
    h = good_header()
    h.update(changes)
    return h


def with_param(i, **changes):
    h = good_header()
    h["parameters"][i] = dict(h["parameters"][i], **changes)
    return h


@pytest.mark.parametrize("header,raw,match", [
    pytest.param(None, b"\xff\xfe{not json", "not UTF-8 JSON", id="not-utf8"),
    pytest.param(None, b"{\"schema\": ", "not UTF-8 JSON", id="not-json"),
    pytest.param(None, b"[1,2,3]", "JSON list", id="json-list"),
    pytest.param(None, b"[" * 100000 + b"]" * 100000, "JSON", id="deep-nesting"),
    pytest.param(without("schema"), None, "'schema'", id="missing-schema"),
    pytest.param(without("data"), None, "'data'", id="missing-data"),
    pytest.param(without("step"), None, "'step'", id="missing-step"),
    pytest.param(without("chunk_bytes"), None, "'chunk_bytes'", id="missing-chunk-bytes"),
    pytest.param(without("parameters"), None, "'parameters'", id="missing-parameters"),
    pytest.param(with_(model=7), None, "'model'", id="model-int"),
    pytest.param(with_(step="3"), None, "'step'", id="step-string"),
    pytest.param(with_(step=-1), None, "'step'", id="step-negative"),
    pytest.param(with_(contexts=1.5), None, "'contexts'", id="contexts-float"),
    pytest.param(with_(chunk_bytes=True), None, "'chunk_bytes'", id="chunk-bytes-bool"),
    pytest.param(with_(chunk_bytes=0), None, "'chunk_bytes'", id="chunk-bytes-zero"),
    pytest.param(with_(parameters={}), None, "parameters", id="parameters-object"),
    pytest.param(with_(parameters=[]), None, "parameters", id="parameters-empty"),
    pytest.param(with_param(1, name=5), None, "parameters\\[1\\]", id="name-int"),
    pytest.param(with_param(1, shape=[0]), None, "layers.0.attn_norm.weight shape", id="shape-zero"),
    pytest.param(with_param(1, shape=[-32]), None, "shape", id="shape-negative"),
    pytest.param(with_param(1, shape="32"), None, "shape", id="shape-string"),
    pytest.param(with_param(-1, shape=[10 ** 30]), None, "expected [0-9]+ for", id="shape-huge"),
    pytest.param(with_param(2, offset="2080"), None, "offset", id="offset-string"),
    pytest.param(with_param(2, offset=2081), None, "offset 2081, expected 2080", id="gap"),
    pytest.param(with_param(2, name="layers.0.attn_norm.weight"), None, "twice", id="duplicate"),
    pytest.param(with_param(-1, shape=[31]), None, f"for {N - 1} parameters", id="payload-short"),
    pytest.param(with_(parameters=good_header()["parameters"] + [
        {"name": "extra.weight", "shape": [2], "offset": N}]), None, f"for {N + 2} parameters",
        id="payload-long"),
])
def test_hostile_header_refused(tmp_path, header, raw, match):
    path = tmp_path / "hostile.ckpt"
    path.write_bytes(build(header, good_payload(), raw=raw))
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=match) as e:
        validate(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert path.read_bytes() == before


def test_consistent_but_foreign_parameter_list_refused_on_read(tmp_path):
    h = good_header()
    h["parameters"][1]["name"] = "layers.0.attn_norm.gamma"
    path = tmp_path / "renamed.ckpt"
    path.write_bytes(build(h, good_payload()))
    validate(path)  # well-formed ...
    # the error names the tensor the file lacks or the one no parameter takes
    with pytest.raises(BindingError, match="layers.0.attn_norm.(gamma|weight)"):
        load_state(path, CONFIG, expect=run_identities())  # ... but not this model's


def test_nonzero_padding_refused(tmp_path):
    path = tmp_path / "padded.ckpt"
    path.write_bytes(build(good_header(), good_payload(), pad=0x20))  # spaces, validly hashed
    with pytest.raises(CheckpointError, match="padding"):
        validate(path)


def test_trailer_length_disagreeing_refused(tmp_path, saved):
    data = bytearray(saved[2])
    struct.pack_into("<Q", data, len(data) - 40, 12 * N - 12)
    path = tmp_path / "t.ckpt"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="trailer says"):
        validate(path)


# ------------------------------------------------------------------- publication

CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    sys.path.insert(0, {root!r})
    from coppelius.reference import fsutil
    from coppelius.reference.checkpoint import identities, write_checkpoint
    from coppelius.reference.config import Hyper, preset
    from coppelius.reference.params import registry
    from coppelius.reference.state import State

    path, phase, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = preset("test")
    n = registry(config).total
    rng = np.random.default_rng(5)
    state = State(*(rng.standard_normal(n).astype(np.float32) for _ in range(3)), t=99)
    ids = identities(config, Hyper(), "fp32", 4, {tok!r}, {stream!r})

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    fsutil._hook = lambda name: die() if name == phase else None
    if limit >= 0:  # die once `limit` bytes of the new file have been written
        real_fdopen = os.fdopen

        class Dying:
            def __init__(self, f):
                self.f, self.n = f, 0
            def write(self, data):
                data = memoryview(data).cast("B")
                if self.n + len(data) >= limit:
                    self.f.write(data[:limit - self.n])
                    self.f.flush()
                    die()
                self.n += len(data)
                return self.f.write(data)
            def __getattr__(self, name):
                return getattr(self.f, name)
            def __enter__(self):
                return self
            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

        fsutil.os.fdopen = lambda *a, **k: Dying(real_fdopen(*a, **k))
    write_checkpoint(path, config, ids, state, 396)
""").format(root=ROOT, tok=TOKENIZER_SHA, stream=STREAM_SHA)


def new_state_bytes():
    rng = np.random.default_rng(5)
    return [rng.standard_normal(N).astype(np.float32).tobytes() for _ in range(3)]


def publish_in_child(path, phase="", limit=-1):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), phase, str(limit)],
                          capture_output=True, timeout=60)
    return proc


def assert_holds(path, which, old):
    ck = load_state(path, CONFIG, expect=run_identities())
    if which == "old":
        assert ck.step == 7 and ck.contexts == 28
        assert ck.state.P.tobytes() == old.P.tobytes()
    else:
        assert ck.step == 99 and ck.contexts == 396
        assert [ck.state.P.tobytes(), ck.state.M.tobytes(), ck.state.V.tobytes()] == new_state_bytes()


@pytest.mark.parametrize("phase,which", [("written", "old"), ("synced", "old"), ("renamed", "new"),
                                         ("", "new")])
def test_crash_at_each_phase_leaves_old_or_new(tmp_path, saved, phase, which):
    path = tmp_path / "model.ckpt"
    path.write_bytes(saved[2])
    proc = publish_in_child(path, phase)
    if phase:
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    else:
        assert proc.returncode == 0, proc.stderr.decode()
    validate(path)
    assert_holds(path, which, saved[1])


def test_crash_inside_the_body_leaves_old(tmp_path, saved):
    size = len(saved[2])
    # Inside the prefix, the header, the padding, the payload (P, M, V) and the trailer.
    limits = [5, 200, 4000, 4096 + 1, 4096 + 4 * N + 3, 4096 + 12 * N - 1, size - 20, size - 1]
    path = tmp_path / "model.ckpt"
    for limit in limits:
        path.write_bytes(saved[2])
        proc = publish_in_child(path, limit=limit)
        assert proc.returncode == -signal.SIGKILL, (limit, proc.stderr.decode())
        assert_holds(path, "old", saved[1])
        # The dead child's temporary holds exactly the bytes written before the kill.
        temps = [p for p in tmp_path.iterdir() if p.name != "model.ckpt"]
        assert len(temps) == 1 and temps[0].stat().st_size == limit
        temps[0].unlink()


def test_enospc_one_line_error_old_intact_no_temporary(tmp_path, saved, monkeypatch):
    path = tmp_path / "model.ckpt"
    path.write_bytes(saved[2])
    real_fdopen = os.fdopen

    class Full:
        """A file that runs out of space after 100 kB."""

        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, data):
            self.n += len(memoryview(data).cast("B"))
            if self.n > 100_000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    monkeypatch.setattr(fsutil.os, "fdopen", lambda *a, **k: Full(real_fdopen(*a, **k)))
    with pytest.raises(CheckpointError) as e:
        write_checkpoint(path, CONFIG, run_identities(), make_state(3, t=11), contexts=44)
    monkeypatch.undo()
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    assert "No space left on device" in message
    assert path.read_bytes() == saved[2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


def test_write_refuses_wrong_state_shape(tmp_path):
    state = make_state(4, t=0)
    state.M = state.M[:-1]
    with pytest.raises(CheckpointError, match="state.M"):
        write_checkpoint(tmp_path / "x.ckpt", CONFIG, run_identities(), state, 0)
    assert not (tmp_path / "x.ckpt").exists()
