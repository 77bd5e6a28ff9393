"""Pre-tokenized shards as a token stream (SPEC section 22).

`--stream` takes, besides the project's own stream file (section 8):

    llm.c's shard   256 int32 LE header: [0] magic 20240520, [1] version
                    (1: uint16 ids, 2: uint32 ids), [2] the id count N;
                    then N little-endian ids
    a raw .bin      nanoGPT's: little-endian uint16 ids and nothing else
    a folder        its regular files ending in .bin or .tokens (not those
                    whose name begins with a dot), in sorted name order
    a glob          the files it matches, in sorted path order

A shard's kind is read from the file: the llm.c magic in its first four
bytes, else a name ending in .bin is raw uint16, else it is the project's own
stream. The shards are one stream: their ids concatenated in order, read
through memory mappings (np.memmap), never loaded whole, and contexts follow
section 8 over the concatenation. One file of the project's own format is
opened by reference.stream as before.

The `stream` digest is the SHA-256 of the ids as little-endian uint32, in
order: the same ids give the same digest in every form (a uint16 shard, a
uint32 shard, the project's own stream). It is computed once, with the
largest id, and cached beside the first shard in `.coppelius-ids-<12 hex>.json`
(the hex names the list of shard paths), keyed by each shard's size and
modification time: a cache that does not match is recomputed, and one that
cannot be written (a read-only folder) is simply not kept.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from coppelius.reference import fsutil
from coppelius.reference import stream as own
from coppelius.reference.errors import StreamError

LLMC_MAGIC = 20240520
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = 4 * LLMC_HEADER_INTS
LLMC_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
RAW_DTYPE = np.dtype("<u2")
SHARD_SUFFIXES = (".bin", ".tokens")
CACHE_FORMAT = "coppelius-ids-v1"
CACHE_BYTES = 1 << 24  # a cache names its shards; anything larger is not one
CHUNK_IDS = own.CHUNK_IDS


@dataclass
class Shard:
    path: str
    kind: str  # "llm.c v1", "llm.c v2", "raw uint16", "coppelius"
    dtype: np.dtype
    offset: int  # bytes before the first id
    count: int  # ids
    size: int  # file bytes
    mtime_ns: int


def is_pattern(spec: str) -> bool:
    return glob.has_magic(spec) and not os.path.lexists(spec)


def shard_paths(spec) -> list:
    """The shard files `spec` names, in order: a folder's, a glob's, or the one file."""
    spec = os.fspath(spec)
    if os.path.isdir(spec):
        names = sorted(n for n in os.listdir(spec)
                       if n.endswith(SHARD_SUFFIXES) and not n.startswith(".")
                       and os.path.isfile(os.path.join(spec, n)))
        if not names:
            raise StreamError(f"--stream {spec}: the folder holds no shard (a file ending in "
                              f"{' or '.join(SHARD_SUFFIXES)})")
        return [os.path.join(spec, n) for n in names]
    if is_pattern(spec):
        paths = sorted(glob.glob(spec))
        if not paths:
            raise StreamError(f"--stream {spec}: the pattern matches no file")
        return paths
    return [spec]


def tokenizer_place(spec) -> str:
    """Where a stream's tokenizer.json lies: in the folder of shards, else
    beside the (first) file."""
    spec = os.fspath(spec)
    base = spec if os.path.isdir(spec) else os.path.dirname(shard_paths(spec)[0])
    return os.path.join(base, "tokenizer.json")


def read_shard(path: str, f) -> Shard:
    """A shard's kind, id type and count from its header and size, checked."""
    st = os.fstat(f.fileno())
    size = st.st_size
    head = os.pread(f.fileno(), LLMC_HEADER_BYTES, 0)
    if len(head) >= 4 and int(np.frombuffer(head[:4], "<i4")[0]) == LLMC_MAGIC:
        if len(head) < LLMC_HEADER_BYTES:
            raise StreamError(f"{path}: an llm.c shard's header is {LLMC_HEADER_BYTES} bytes, "
                              f"the file has {size}")
        header = np.frombuffer(head, "<i4")
        version, count = int(header[1]), int(header[2])
        if version not in LLMC_DTYPES:
            raise StreamError(f"{path}: llm.c header version {version} at offset 4: must be "
                              f"1 (uint16 ids) or 2 (uint32 ids)")
        dtype = LLMC_DTYPES[version]
        want = LLMC_HEADER_BYTES + count * dtype.itemsize
        if count < 0 or want != size:
            raise StreamError(f"{path}: llm.c header count {count} at offset 8 says "
                              f"{want} bytes, the file has {size}")
        return Shard(path, f"llm.c v{version}", dtype, LLMC_HEADER_BYTES, count, size,
                     st.st_mtime_ns)
    if path.endswith(".bin"):
        if size % RAW_DTYPE.itemsize:
            raise StreamError(f"{path}: 1 stray byte at offset {size - 1}: a raw .bin holds "
                              f"uint16 ids (2 bytes each); an llm.c shard begins with magic "
                              f"{LLMC_MAGIC}")
        return Shard(path, "raw uint16", RAW_DTYPE, 0, size // 2, size, st.st_mtime_ns)
    if size < own.HEADER_BYTES:
        raise StreamError(f"{path}: header is {size} bytes at offset 0, a token stream needs "
                          f"{own.HEADER_BYTES}")
    stray = (size - own.HEADER_BYTES) % own.TOKEN_BYTES
    if stray:
        raise StreamError(f"{path}: {stray} stray bytes at offset {size - stray}: the body after "
                          f"the {own.HEADER_BYTES}-byte header must be a multiple of "
                          f"{own.TOKEN_BYTES} bytes")
    return Shard(path, "coppelius", own.TOKEN, own.HEADER_BYTES,
                 (size - own.HEADER_BYTES) // own.TOKEN_BYTES, size, st.st_mtime_ns)


def _cache_path(shards: list) -> str:
    names = "\0".join(os.path.abspath(s.path) for s in shards)
    key = hashlib.sha256(names.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return os.path.join(os.path.dirname(os.path.abspath(shards[0].path)),
                        f".coppelius-ids-{key}.json")


def _cache_key(shards: list) -> list:
    return [[os.path.abspath(s.path), s.size, s.mtime_ns] for s in shards]


def _read_cache(shards: list):
    """(sha256, max id) from a cache that matches the shards as they are, else None."""
    try:
        with fsutil.open_regular(_cache_path(shards)) as f:
            record = json.loads(f.read(CACHE_BYTES))
        if record.get("format") == CACHE_FORMAT and record.get("shards") == _cache_key(shards):
            sha, top = record["sha256"], record["max_id"]
            if isinstance(sha, str) and len(sha) == 64 and isinstance(top, int):
                return sha, top
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass
    return None


def _write_cache(shards: list, sha: str, top: int) -> None:
    text = json.dumps({"format": CACHE_FORMAT, "shards": _cache_key(shards), "sha256": sha,
                       "max_id": top}).encode()
    try:
        fsutil.publish(_cache_path(shards), lambda f: f.write(text))
    except OSError:
        pass  # a read-only folder: the digest is taken again next time


def digest(stream: "ShardStream") -> tuple:
    """(SHA-256 of the ids as uint32 LE, the largest id or -1), in one pass."""
    h = hashlib.sha256()
    top = -1
    for start in range(0, len(stream), CHUNK_IDS):
        chunk = stream.read(start, min(CHUNK_IDS, len(stream) - start), check=False)
        if chunk.size:
            top = max(top, int(chunk.max()))
        h.update(chunk.astype(own.TOKEN, copy=False).tobytes())
    return h.hexdigest(), top


class ShardStream(own.Stream):
    """Shards as one stream of N ids (reference.stream.Stream's reading:
    batch, contexts, n_contexts, sha256), read through memory mappings. Each
    read checks first that the shards it touches still have their size (a
    mapping past a truncated file's end would be a SIGBUS, not a message)."""

    def __init__(self, spec: str, shards: list, files: list, vocab: int):
        self.path = spec
        self.shards = shards
        self._files = files
        self._n = sum(s.count for s in shards)
        self.vocab = vocab
        self.source_mtime_ns = max(s.mtime_ns for s in shards)
        self.source_size = sum(s.size for s in shards)
        self._sha256 = None
        self._ids = None
        self._starts = np.cumsum([0] + [s.count for s in shards])  # (S+1,)
        self._maps = [None if s.count == 0 else
                      np.memmap(f, dtype=s.dtype, mode="r", offset=s.offset, shape=(s.count,))
                      for s, f in zip(shards, files)]

    def close(self) -> None:
        self._maps = []
        for f in self._files:
            f.close()

    @property
    def ids(self) -> np.ndarray:
        """(N,) uint32: every id, read (short-lived uses: checks and tests)."""
        return self.read(0, self._n)

    def read(self, start: int, count: int, check: bool = True) -> np.ndarray:
        """ids [start, start + count) as (count,) uint32, across shards."""
        out = np.empty(count, dtype=own.TOKEN)
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < count:
            s = self.shards[i]
            if os.fstat(self._files[i].fileno()).st_size < s.size:
                raise StreamError(f"{s.path}: is shorter than its {s.size} bytes now (was it "
                                  f"truncated while in use?)")
            lo = start + done - int(self._starts[i])
            take = min(s.count - lo, count - done)
            out[done:done + take] = self._maps[i][lo:lo + take]
            done += take
            i += 1
        if check and out.size and int(out.max()) >= self.vocab:
            j = start + int(np.argmax(out >= self.vocab))
            raise StreamError(f"{self.path}: id {j} of the shards is not below V={self.vocab} "
                              f"(was it changed while in use?)")
        return out

    def _read(self, start: int, count: int) -> np.ndarray:
        return self.read(start, count)

    def where(self, i: int) -> str:
        """'PATH (token t, offset o)' of the stream's id i."""
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        s = self.shards[k]
        t = i - int(self._starts[k])
        return f"{s.path}: id at offset {s.offset + t * s.dtype.itemsize} (token {t})"

    def first_at_least(self, vocab: int) -> int:
        for start in range(0, self._n, CHUNK_IDS):
            chunk = self.read(start, min(CHUNK_IDS, self._n - start), check=False)
            bad = np.flatnonzero(chunk >= vocab)
            if bad.size:
                return start + int(bad[0])
        return -1


def open_shards(spec, vocab: int) -> ShardStream:
    """Open and check shards (section 22): headers, counts against sizes,
    every id < vocab (the cached largest id, else a pass that also digests)."""
    spec = os.fspath(spec)
    files, shards = [], []
    try:
        for path in shard_paths(spec):
            f = own._open(path)
            files.append(f)
            shards.append(read_shard(path, f))
        families = {s.kind.split(" ")[0] for s in shards}
        if len(families) > 1:
            first = shards[0]
            odd = next(s for s in shards if s.kind.split(" ")[0] != first.kind.split(" ")[0])
            raise StreamError(f"{odd.path}: is a {odd.kind} shard (magic "
                              f"{_magic(odd.path)} at offset 0) where {first.path} is "
                              f"{first.kind}: the shards of one stream are of one kind")
        stream = ShardStream(spec, shards, files, 2**32)
        cached = _read_cache(shards)
        sha, top = cached if cached is not None else digest(stream)
        if top >= vocab:
            i = stream.first_at_least(vocab)
            value = int(stream.read(i, 1, check=False)[0])
            raise StreamError(f"{stream.where(i)}: id {value} is not below the vocabulary "
                              f"V={vocab}")
        if cached is None:
            _write_cache(shards, sha, top)
        stream.vocab = vocab
        stream._sha256 = sha
        return stream
    except BaseException:
        for f in files:
            f.close()
        raise


def _magic(path) -> int | None:
    with fsutil.open_regular(path) as f:
        head = f.read(4)
    return int(np.frombuffer(head, "<i4")[0]) if len(head) == 4 else None


def is_own_stream(spec) -> bool:
    """Whether `spec` is one file of the project's own stream format."""
    spec = os.fspath(spec)
    if os.path.isdir(spec) or is_pattern(spec) or spec.endswith(".bin"):
        return False
    try:
        with fsutil.open_regular(spec) as f:
            head = f.read(4)
    except OSError:
        return True  # reference.stream names what is wrong
    return not (len(head) == 4 and int(np.frombuffer(head, "<i4")[0]) == LLMC_MAGIC)


def open_any(spec, vocab: int):
    """The stream `spec` names, in any form, opened and checked."""
    if is_own_stream(spec):
        return own.open_stream(spec, vocab)
    return open_shards(spec, vocab)


def describe(spec) -> list:
    """(key, value) lines for `coppelius inspect`: each shard's format,
    dtype and count, then the stream's ids and digest (ids not checked
    against any V)."""
    stream = open_shards(spec, 2**32)
    try:
        if len(stream) == 0:
            raise StreamError(f"{os.fspath(spec)}: holds no token id (an empty file is no "
                              f"stream, checkpoint or result file)")
        lines = [("stream", os.fspath(spec))]
        for s in stream.shards:
            lines.append(("shard", f"{s.path}: {s.kind}, {s.dtype.name} ids, {s.count} ids, "
                                   f"{s.size} bytes"))
        top = digest(stream)[1] if stream.shards else -1
        lines += [("shards", len(stream.shards)), ("ids", len(stream)),
                  ("largest id", top), ("sha256", stream.sha256)]
        return lines
    finally:
        stream.close()
