"""The token stream file (SPEC section 8): header, ids, refusals, contexts."""

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius.reference.errors import StreamError
from coppelius.reference.stream import (HEADER_BYTES, open_stream, read_stream_header,
                              write_stream)


def raw_stream(path, mtime_ns, size, ids, tail=b""):
    """An independent writer: struct, not numpy."""
    with open(path, "wb") as f:
        f.write(struct.pack("<qQ", mtime_ns, size))
        f.write(struct.pack(f"<{len(ids)}I", *ids))
        f.write(tail)


@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=200),
       mtime_ns=st.integers(-2**63, 2**63 - 1), size=st.integers(0, 2**64 - 1))
def test_round_trip_matches_an_independent_layout(tmp_path_factory, ids, mtime_ns, size):
    path = tmp_path_factory.mktemp("s") / "a.tokens"
    write_stream(path, np.array(ids, dtype=np.uint64), mtime_ns, size)
    expected = struct.pack("<qQ", mtime_ns, size) + struct.pack(f"<{len(ids)}I", *ids)
    assert path.read_bytes() == expected
    assert read_stream_header(path) == (mtime_ns, size)
    stream = open_stream(path, vocab=2**32)
    assert stream.ids.tolist() == ids
    assert stream.sha256 == hashlib.sha256(expected[HEADER_BYTES:]).hexdigest()
    assert not stream.ids.flags.writeable


def test_sha256_is_of_the_bytes_after_the_header(tmp_path):
    path = tmp_path / "a.tokens"
    rng = np.random.default_rng(1)
    write_stream(path, rng.integers(0, 2048, 5000), 123, 456)
    stream = open_stream(path, 2048)
    assert stream.sha256 == hashlib.sha256(path.read_bytes()[16:]).hexdigest()
    # the header (the source's mtime and size) is not part of the identity
    write_stream(tmp_path / "b.tokens", stream.ids, 999, 1)
    assert open_stream(tmp_path / "b.tokens", 2048).sha256 == stream.sha256


@pytest.mark.parametrize("header", [0, 1, 15])
def test_short_header_is_refused(tmp_path, header):
    path = tmp_path / "short.tokens"
    path.write_bytes(b"\x01" * header)
    with pytest.raises(StreamError, match=rf"short\.tokens: header is {header} bytes at offset 0"):
        open_stream(path, 64)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(StreamError, match=r"nothere\.tokens: no such token stream"):
        open_stream(tmp_path / "nothere.tokens", 64)


@pytest.mark.parametrize("stray", [1, 2, 3])
def test_stray_bytes_are_refused_at_their_offset(tmp_path, stray):
    path = tmp_path / "stray.tokens"
    raw_stream(path, 0, 0, [1, 2, 3], tail=b"\x00" * stray)
    offset = 16 + 3 * 4
    with pytest.raises(StreamError, match=rf"stray\.tokens: {stray} stray bytes at offset {offset}"):
        open_stream(path, 64)


@given(n=st.integers(1, 300), data=st.data())
def test_id_out_of_range_is_refused_at_its_offset(tmp_path_factory, n, data):
    V = data.draw(st.integers(1, 1000))
    ids = data.draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n))
    bad = data.draw(st.integers(0, n - 1))
    value = data.draw(st.integers(V, 2**32 - 1))
    ids[bad] = value
    # later bad ids must not be reported first
    ids += [V] * data.draw(st.integers(0, 3))
    path = tmp_path_factory.mktemp("s") / "bad.tokens"
    raw_stream(path, 0, 0, ids)
    with pytest.raises(StreamError) as e:
        open_stream(path, V)
    message = str(e.value)
    assert "bad.tokens" in message
    assert f"id {value} at offset {16 + 4 * bad} " in message
    assert f"V={V}" in message


def test_id_out_of_range_is_found_past_the_first_chunk(tmp_path, monkeypatch):
    from coppelius.reference import stream as stream_module

    monkeypatch.setattr(stream_module, "CHUNK_IDS", 1000)
    ids = np.zeros(5500, dtype=np.uint32)
    ids[4321] = 64
    path = tmp_path / "far.tokens"
    write_stream(path, ids, 0, 0)
    with pytest.raises(StreamError, match=rf"id 64 at offset {16 + 4 * 4321} "):
        open_stream(path, 64)
    ids[4321] = 63
    write_stream(path, ids, 0, 0)
    assert open_stream(path, 64).n_contexts(16) == (5500 - 1) // 16


def test_an_empty_or_too_short_stream_opens_with_no_context(tmp_path):
    path = tmp_path / "empty.tokens"
    write_stream(path, [], 1, 2)
    assert open_stream(path, 64).n_contexts(16) == 0
    write_stream(path, list(range(16)), 1, 2)  # 16 ids: one short of T+1
    assert open_stream(path, 64).n_contexts(16) == 0
    write_stream(path, list(range(17)), 1, 2)
    assert open_stream(path, 64).n_contexts(16) == 1


@given(N=st.integers(2, 400), T=st.integers(1, 40), data=st.data())
def test_contexts_and_batches_match_a_list_computation(tmp_path_factory, N, T, data):
    ids = data.draw(st.lists(st.integers(0, 99), min_size=N, max_size=N))
    path = tmp_path_factory.mktemp("s") / "c.tokens"
    raw_stream(path, 0, 0, ids)
    stream = open_stream(path, 100)
    # count the windows of T+1 ids that start at multiples of T
    K = 0
    while T * K + T + 1 <= N:
        K += 1
    assert stream.n_contexts(T) == K
    if K == 0:
        return
    B = data.draw(st.integers(1, 5))
    c0 = data.draw(st.integers(0, 3 * K))
    got = stream.batch(c0, B, T, repeat=True)
    assert got.dtype == np.int64 and got.shape == (B, T + 1)
    expected = [ids[T * ((c0 + b) % K): T * ((c0 + b) % K) + T + 1] for b in range(B)]
    assert got.tolist() == expected
    if c0 + B <= K:
        assert stream.batch(c0, B, T).tolist() == expected
        # inputs of context c+1 start where the targets of context c end
        assert got[0, T] == ids[T * (c0 % K) + T]
    else:
        with pytest.raises(StreamError, match="contexts"):
            stream.batch(c0, B, T)


def test_file_system_failures_are_stream_errors_naming_the_path(tmp_path, monkeypatch):
    import errno

    from coppelius.reference import fsutil

    folder = tmp_path / "folder.tokens"
    folder.mkdir()
    with pytest.raises(StreamError, match=r"folder\.tokens: is a directory, not a token stream"):
        open_stream(folder, 64)
    with pytest.raises(StreamError, match=r"folder\.tokens: cannot write token stream"):
        write_stream(folder, [1, 2, 3], 0, 0)
    assert list(folder.iterdir()) == []

    # a write that fails (a full disk) leaves the published stream as it was
    path = tmp_path / "a.tokens"
    raw_stream(path, 5, 6, [1, 2, 3])
    before = path.read_bytes()

    def disk_full(phase):
        if phase == "written":
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsutil, "_hook", disk_full)
    with pytest.raises(StreamError, match=r"a\.tokens: cannot write token stream \(No space"):
        write_stream(path, [4, 5, 6, 7], 8, 9)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tokens", "folder.tokens"]
