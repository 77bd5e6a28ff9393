"""The token stream file (SPEC section 8).

    offset 0    int64 LE   the source's modification time, ns since the epoch
    offset 8    uint64 LE  the source's size in bytes
    offset 16   uint32 LE  token ids, N of them

A stream of N ids holds K = floor((N - 1) / T) contexts; context c is
ids[T c : T c + T + 1]: inputs the first T, targets the same window one on.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from .errors import StreamError
from .fsutil import publish

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


def read_stream_header(path) -> tuple:
    """(source mtime_ns, source size) from a stream's header."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise StreamError(f"{path}: no such token stream") from None
    except IsADirectoryError:
        raise StreamError(f"{path}: is a directory, not a token stream") from None
    except OSError as e:
        raise StreamError(f"{path}: cannot read token stream ({e.strerror})") from None
    if len(raw) < HEADER_BYTES:
        raise StreamError(f"{path}: header is {len(raw)} bytes at offset 0, "
                          f"a token stream needs {HEADER_BYTES}")
    header = np.frombuffer(raw, dtype=HEADER)[0]
    return int(header["mtime_ns"]), int(header["size"])


class Stream:
    """An opened, checked stream: ids is a read-only (N,) uint32 memmap."""

    def __init__(self, path: str, ids: np.ndarray, vocab: int, source_mtime_ns: int,
                 source_size: int):
        self.path = path
        self.ids = ids  # (N,) uint32, read-only
        self.vocab = vocab  # V
        self.source_mtime_ns = source_mtime_ns
        self.source_size = source_size
        self._sha256 = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of the id bytes (the file after its header): the data
        identity's `stream` part."""
        if self._sha256 is None:
            h = hashlib.sha256()
            for start in range(0, len(self), CHUNK_IDS):
                h.update(self.ids[start:start + CHUNK_IDS].tobytes())
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
        out, SPEC 18), by default all."""
        K = self.n_contexts(T) if contexts is None else contexts
        c = np.arange(c0, c0 + B, dtype=np.int64)  # (B,)
        if repeat:
            if K == 0:
                raise StreamError(f"{self.path}: {len(self)} ids hold no context of {T + 1}")
            c = c % K
        elif c0 < 0 or c0 + B > K:
            raise StreamError(f"{self.path}: contexts {c0}..{c0 + B - 1} asked for, "
                              f"the stream holds {K} of context {T}")
        return self.contexts(c, T)

    def contexts(self, indices, T: int) -> np.ndarray:
        """Contexts `indices` (each in [0, K)) as a (len, T+1) int64 array."""
        c = np.asarray(indices, dtype=np.int64)  # (B,)
        index = c[:, None] * T + np.arange(T + 1, dtype=np.int64)[None, :]  # (B,T+1)
        return self.ids[index].astype(np.int64)


def open_stream(path, vocab: int) -> Stream:
    """Open and check a stream: header size, body a multiple of 4 bytes, every
    id < vocab. A refusal names the file and the byte offset."""
    path = os.fspath(path)
    mtime_ns, size = read_stream_header(path)
    try:
        file_bytes = os.path.getsize(path)
    except OSError as e:
        raise StreamError(f"{path}: cannot read token stream ({e.strerror})") from None
    body_bytes = file_bytes - HEADER_BYTES
    stray = body_bytes % TOKEN_BYTES
    if stray:
        raise StreamError(f"{path}: {stray} stray bytes at offset {file_bytes - stray}: "
                          f"the body after the {HEADER_BYTES}-byte header must be a multiple "
                          f"of {TOKEN_BYTES} bytes")
    n = body_bytes // TOKEN_BYTES
    if n == 0:
        ids = np.zeros(0, dtype=TOKEN)  # np.memmap refuses an empty mapping
        ids.flags.writeable = False
    else:
        try:
            ids = np.memmap(path, dtype=TOKEN, mode="r", offset=HEADER_BYTES, shape=(n,))
        except OSError as e:
            raise StreamError(f"{path}: cannot map token stream ({e.strerror})") from None
    for start in range(0, n, CHUNK_IDS):
        chunk = ids[start:start + CHUNK_IDS]
        bad = np.flatnonzero(chunk >= vocab)
        if bad.size:
            i = start + int(bad[0])
            raise StreamError(f"{path}: id {int(ids[i])} at offset "
                              f"{HEADER_BYTES + TOKEN_BYTES * i} (token {i}) is not below "
                              f"the vocabulary V={vocab}")
    return Stream(path, ids, vocab, mtime_ns, size)
