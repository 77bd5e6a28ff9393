"""The token stream file (SPEC section 8).

    offset 0    int64 LE   the source's modification time, ns since the epoch
    offset 8    uint64 LE  the source's size in bytes
    offset 16   uint32 LE  token ids, N of them

A stream of N ids holds K = floor((N - 1) / T) contexts; context c is
ids[T c : T c + T + 1]: inputs the first T, targets the same window one on.

Only a regular file is opened as a stream (fsutil.open_regular).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from .errors import StreamError
from .fsutil import open_regular, publish

HEADER_BYTES = 16
TOKEN_BYTES = 4
HEADER = np.dtype([("mtime_ns", "<i8"), ("size", "<u8")])
TOKEN = np.dtype("<u4")
# Reading in pieces bounds the memory of the checks and the hash, whatever N.
CHUNK_IDS = 1 << 22  # 16 MiB of ids


def stream_body(ids, source_mtime_ns: int, source_size: int, path="stream"):
    """The writer of a stream file of `ids` (N,): `write_body(f)` for
    reference.fsutil.publish. `path` names the file in a refusal."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise StreamError(f"{os.fspath(path)}: ids must be one-dimensional, got shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(TOKEN).max):
        raise StreamError(f"{os.fspath(path)}: ids must fit uint32")
    header = np.array([(source_mtime_ns, source_size)], dtype=HEADER)
    body = ids.astype(TOKEN, copy=False)

    def write_body(f):
        f.write(header.tobytes())
        for start in range(0, body.size, CHUNK_IDS):
            f.write(body[start:start + CHUNK_IDS].tobytes())

    return write_body


def write_stream(path, ids, source_mtime_ns: int, source_size: int) -> None:
    """Publish a stream of `ids` (N,) atomically (reference.fsutil.publish).
    A file-system failure is a StreamError naming the path; the file at the
    path is then as it was."""
    write_body = stream_body(ids, source_mtime_ns, source_size, path)
    try:
        publish(path, write_body)
    except OSError as e:
        raise StreamError(f"{os.fspath(path)}: cannot write token stream "
                          f"({e.strerror or e})") from None


def _open(path):
    """The stream file open for reading, refused (StreamError) unless it is a
    regular file: a FIFO or a device given as a stream is never opened."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise StreamError(f"{path}: no such token stream") from None
    except IsADirectoryError:
        raise StreamError(f"{path}: is a directory, not a token stream") from None
    except OSError as e:
        raise StreamError(f"{path}: cannot read token stream ({e.strerror or e})") from None


def _header(path, f) -> tuple:
    raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise StreamError(f"{path}: header is {len(raw)} bytes at offset 0, "
                          f"a token stream needs {HEADER_BYTES}")
    header = np.frombuffer(raw, dtype=HEADER)[0]
    return int(header["mtime_ns"]), int(header["size"])


def read_stream_header(path) -> tuple:
    """(source mtime_ns, source size) from a stream's header."""
    path = os.fspath(path)
    with _open(path) as f:
        return _header(path, f)


class Stream:
    """An opened, checked stream of N ids.

    The file stays open and contexts are read from it (`batch`, `contexts`)
    rather than from a memory mapping: a file truncated or rewritten while a
    run reads it is then a StreamError naming it, where a mapping would kill
    the process with SIGBUS and no message. `ids` maps the file for callers
    that want every id at once (short-lived uses: checks and tests)."""

    def __init__(self, path: str, file, n: int, vocab: int, source_mtime_ns: int,
                 source_size: int):
        self.path = path
        self._file = file  # open, binary; positioned reads only (os.pread)
        self._n = n  # N
        self.vocab = vocab  # V
        self.source_mtime_ns = source_mtime_ns
        self.source_size = source_size
        self._sha256 = None
        self._ids = None

    def __len__(self) -> int:
        return self._n

    def close(self) -> None:
        self._ids = None
        self._file.close()

    @property
    def ids(self) -> np.ndarray:
        """(N,) uint32, read-only: the file's ids, mapped."""
        if self._ids is None:
            if self._n == 0:
                ids = np.zeros(0, dtype=TOKEN)  # np.memmap refuses an empty mapping
                ids.flags.writeable = False
            else:
                ids = np.memmap(self._file, dtype=TOKEN, mode="r", offset=HEADER_BYTES,
                                shape=(self._n,))
            self._ids = ids
        return self._ids

    def _read(self, start: int, count: int) -> np.ndarray:
        """ids [start, start + count) (count,) uint32, read from the file;
        a StreamError when the file no longer holds them or they are not
        below V (the file changed after it was opened and checked)."""
        offset = HEADER_BYTES + TOKEN_BYTES * start
        try:
            raw = os.pread(self._file.fileno(), TOKEN_BYTES * count, offset)
        except OSError as e:
            raise StreamError(f"{self.path}: cannot read token stream ({e.strerror or e})") from None
        if len(raw) < TOKEN_BYTES * count:
            size = os.fstat(self._file.fileno()).st_size
            raise StreamError(f"{self.path}: is {size} bytes now, token {start + count - 1} "
                              f"ends at offset {offset + TOKEN_BYTES * count} (was it truncated "
                              f"while in use?)")
        ids = np.frombuffer(raw, dtype=TOKEN)
        if ids.size and int(ids.max()) >= self.vocab:
            i = start + int(np.argmax(ids >= self.vocab))
            raise StreamError(f"{self.path}: id at offset {HEADER_BYTES + TOKEN_BYTES * i} is not "
                              f"below V={self.vocab} (was it changed while in use?)")
        return ids

    def _chunks(self):
        for start in range(0, self._n, CHUNK_IDS):
            yield start, self._read(start, min(CHUNK_IDS, self._n - start))

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of the id bytes (the file after its header): the data
        identity's `stream` part."""
        if self._sha256 is None:
            h = hashlib.sha256()
            for _, chunk in self._chunks():
                h.update(chunk.tobytes())
            self._sha256 = h.hexdigest()
        return self._sha256

    def n_contexts(self, T: int) -> int:
        """K = floor((N - 1) / T): contexts of T inputs plus one target."""
        return max(len(self) - 1, 0) // T

    def batch(self, c0: int, B: int, T: int, repeat: bool = False,
              contexts: int | None = None) -> np.ndarray:
        """Contexts c0 .. c0+B-1 as a (B, T+1) int64 array; with `repeat`,
        context c is read as c mod K (SPEC section 9). `contexts`: how many
        of the stream's contexts training may read (K; the rest are held
        out, SPEC 18), by default all. The range is checked in Python
        integers first: any c0 or B is refused, none overflows."""
        K = self.n_contexts(T) if contexts is None else contexts
        if repeat:
            if K == 0:
                raise StreamError(f"{self.path}: {len(self)} ids hold no context of {T + 1}")
            c = (c0 % K + np.arange(B, dtype=np.int64)) % K  # (B,)
        elif c0 < 0 or c0 + B > K:
            raise StreamError(f"{self.path}: contexts {c0}..{c0 + B - 1} asked for, "
                              f"the stream holds {K} of context {T}")
        else:
            c = np.arange(c0, c0 + B, dtype=np.int64)  # (B,)
        return self.contexts(c, T)

    def contexts(self, indices, T: int) -> np.ndarray:
        """Contexts `indices` (each in [0, K)) as a (len, T+1) int64 array,
        read from the open file (a stream changed in use is an error naming
        it, never a SIGBUS)."""
        K = self.n_contexts(T)
        c = [int(ci) for ci in indices]
        bad = [ci for ci in c if not 0 <= ci < K]
        if bad:
            raise StreamError(f"{self.path}: context {bad[0]} asked for, the stream holds {K} "
                              f"of context {T}")
        return np.stack([self._read(ci * T, T + 1) for ci in c]).astype(np.int64)  # (B,T+1)


def open_stream(path, vocab: int) -> Stream:
    """Open and check a stream: header size, body a multiple of 4 bytes, every
    id < vocab. A refusal names the file and the byte offset."""
    path = os.fspath(path)
    f = _open(path)
    try:
        mtime_ns, size = _header(path, f)
        file_bytes = os.fstat(f.fileno()).st_size
        if file_bytes < HEADER_BYTES:  # yet a header was read: the size is not the length
            raise StreamError(f"{path}: its size is {file_bytes} bytes yet it reads more (a file "
                              f"made as it is read, like those in /proc): not a token stream")
        body_bytes = file_bytes - HEADER_BYTES
        stray = body_bytes % TOKEN_BYTES
        if stray:
            raise StreamError(f"{path}: {stray} stray bytes at offset {file_bytes - stray}: "
                              f"the body after the {HEADER_BYTES}-byte header must be a multiple "
                              f"of {TOKEN_BYTES} bytes")
        stream = Stream(path, f, body_bytes // TOKEN_BYTES, 2**32, mtime_ns, size)
        h = hashlib.sha256()  # the digest is taken on the same pass as the check
        for start, chunk in stream._chunks():
            bad = np.flatnonzero(chunk >= vocab)
            if bad.size:
                i = start + int(bad[0])
                raise StreamError(f"{path}: id {int(chunk[bad[0]])} at offset "
                                  f"{HEADER_BYTES + TOKEN_BYTES * i} (token {i}) is not below "
                                  f"the vocabulary V={vocab}")
            h.update(chunk.tobytes())
        stream.vocab = vocab
        stream._sha256 = h.hexdigest()
        return stream
    except BaseException:
        f.close()
        raise
