"""Checkpoint sources (SPEC section 12): where a binding reads its values.

A source lists its tensors (`key -> TensorInfo(dtype, shape, nbytes)`) from
metadata alone, and grants *leases*: read-only NumPy views of one tensor or
of a range of its rows. A lease larger than the source's bound
(`max_lease_bytes`) is refused before anything is read, so a file cannot
make the loader pull more than the bound into memory at once.

Two sources:
- `CheckpointFileSource`: a checkpoint file (SPEC section 10), opened once,
  validated (magic, lengths, SHA-256) through that open file and then
  memory-mapped read-only from the same file, so the bytes checked are the
  bytes leased even if the path is republished meanwhile. Keys are the
  parameter names, plus `m/<name>` and `v/<name>` for the AdamW moments.
- `SafetensorsSource`: a safetensors file, read through the `safetensors`
  library after its header has been checked here as well, so that a lying
  file is refused at construction, before any tensor is read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from types import MappingProxyType
from typing import NamedTuple

import ml_dtypes  # registers "bfloat16" with NumPy; the safetensors library needs that
import numpy as np
import safetensors

from .checkpoint import open_checkpoint, validate
from .errors import CoppeliusError
from .fsutil import open_regular

# The largest single read a source grants by default. The largest tensor of
# the production model is the embedding, 12288 x 512 float32 = 24 MiB; the
# bound leaves room for larger vocabularies while keeping a single lease far
# below host memory.
DEFAULT_MAX_LEASE_BYTES = 1 << 28  # 256 MiB

# dtype names used everywhere in the binding layer -> NumPy dtype
DTYPES = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint64": np.dtype(np.uint64),
    "uint32": np.dtype(np.uint32),
    "uint16": np.dtype(np.uint16),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}

# safetensors dtype tag -> our dtype name (the tags this project can read)
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}

MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit (100 MB)


class BindingError(CoppeliusError):
    """Binding a model's parameters failed; names the parameter (or the file).
    The subclasses (reference.binding) tell which way it failed."""


class SourceError(BindingError):
    """A source refused: a malformed file, an unknown key, a bad row range,
    or a lease over the source's bound."""


class TensorInfo(NamedTuple):
    """A tensor's metadata; unpacks as (dtype, shape, nbytes)."""

    dtype: str  # a key of DTYPES
    shape: tuple
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one index of the first axis."""
        return DTYPES[self.dtype].itemsize * math.prod(self.shape[1:])


def tensor_info(dtype: str, shape) -> TensorInfo:
    shape = tuple(int(n) for n in shape)
    return TensorInfo(dtype, shape, DTYPES[dtype].itemsize * math.prod(shape))


class CheckpointSource:
    """The source protocol: `tensors()` and `lease(key, rows=None)`.

    Subclasses fill `self._tensors` (key -> TensorInfo) at construction and
    implement `_read(key, start, stop)` returning a NumPy array of rows
    [start, stop) (the whole tensor when start, stop is None, None).
    """

    path: str
    max_lease_bytes: int

    def __init__(self, path, max_lease_bytes: int = DEFAULT_MAX_LEASE_BYTES):
        self.path = os.fspath(path)
        self.max_lease_bytes = int(max_lease_bytes)
        self._tensors: dict = {}
        self.leases_granted = 0  # how many leases this source has granted (tests read it)

    def tensors(self) -> MappingProxyType:
        """key -> TensorInfo, in the source's order (read-only)."""
        return MappingProxyType(self._tensors)

    def check_lease(self, key: str, rows: slice | None = None) -> TensorInfo:
        """What `lease(key, rows)` would return, checked against the source's
        metadata and bound without reading anything. Raises SourceError."""
        return self._plan_lease(key, rows)[0]

    def lease(self, key: str, rows: slice | None = None) -> np.ndarray:
        """A read-only view of tensor `key`, or of its rows `rows` (a slice of
        the first axis, step 1)."""
        info, start, stop = self._plan_lease(key, rows)
        try:
            array = self._read(key, start, stop)
        except OSError as e:
            raise SourceError(f"{self.path}: reading {key!r}: {e.strerror or e}") from None
        array = array.view(np.ndarray)  # a plain ndarray, not a memmap subclass
        array.flags.writeable = False
        assert array.dtype == DTYPES[info.dtype] and array.shape == info.shape, key
        self.leases_granted += 1
        return array

    def _plan_lease(self, key: str, rows) -> tuple:
        """(TensorInfo of the lease, start, stop); start, stop None for the whole tensor."""
        if key not in self._tensors:
            raise SourceError(f"{self.path}: no tensor {key!r}")
        info, start, stop = self._tensors[key], None, None
        if rows is not None:
            start, stop = _row_range(info, rows, f"{self.path}: tensor {key!r}")
            info = TensorInfo(info.dtype, (stop - start,) + info.shape[1:],
                              (stop - start) * info.row_bytes)
        if info.nbytes > self.max_lease_bytes:
            raise SourceError(
                f"{self.path}: lease of {key!r} is {info.nbytes} bytes, over the bound of "
                f"{self.max_lease_bytes} bytes (lease it in row ranges)")
        return info, start, stop

    def _read(self, key, start, stop) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _row_range(info: TensorInfo, rows: slice, what: str) -> tuple:
    """(start, stop) of a row slice, refused unless it is a plain in-range
    slice of the first axis."""
    if not isinstance(rows, slice) or rows.step not in (None, 1):
        raise SourceError(f"{what}: rows={rows!r} must be a slice start:stop with step 1")
    if not info.shape:
        raise SourceError(f"{what}: rows of a 0-dimensional tensor")
    n = info.shape[0]
    start = 0 if rows.start is None else rows.start
    stop = n if rows.stop is None else rows.stop
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= n):
        raise SourceError(f"{what}: rows {rows.start}:{rows.stop} outside 0:{n}")
    return start, stop


# ------------------------------------------------------------------ checkpoint file

def moment_key(which: str, name: str) -> str:
    """The source key of a parameter's moment: `m/<name>` or `v/<name>`."""
    assert which in ("m", "v")
    return f"{which}/{name}"


class CheckpointFileSource(CheckpointSource):
    """A checkpoint file (SPEC section 10), validated and memory-mapped.

    The payload is P, then M, then V, each the parameter vector of N float32
    elements; the header's `parameters` list gives each name's shape and
    element offset into that vector. Keys: `<name>`, `m/<name>`, `v/<name>`.
    """

    def __init__(self, path, max_lease_bytes: int = DEFAULT_MAX_LEASE_BYTES):
        super().__init__(path, max_lease_bytes)
        # One open file for the check and the mapping. Validating by path and
        # then mapping the path would map whatever a republication (a rename
        # over the path) left there in between: an unchecked file.
        with open_checkpoint(self.path) as f:
            # magic, version, lengths, the SHA-256, and a well-formed,
            # contiguous parameter list with 12 N payload bytes
            self.info = validate(self.path, file=f)
            self.header = self.info.header
            N = self.info.payload_bytes // 12  # elements of each of P, M, V
            self.N = N
            self._offsets = {}
            for entry in self.header["parameters"]:
                name = entry["name"]
                self._offsets[name] = entry["offset"]
                info = tensor_info("float32", entry["shape"])
                for key in (name, moment_key("m", name), moment_key("v", name)):
                    self._tensors[key] = info
            # (3N,) float32 LE, read-only: a lease is a view, nothing is copied.
            # The mapping holds its own reference to the file, so closing f is fine.
            self._payload = np.memmap(f, dtype="<f4", mode="r",
                                      offset=self.info.payload_offset, shape=(3 * N,))

    def _read(self, key, start, stop):
        part, pname = 0, key
        if key.startswith("m/"):
            part, pname = 1, key[2:]
        elif key.startswith("v/"):
            part, pname = 2, key[2:]
        info = self._tensors[key]
        base = part * self.N + self._offsets[pname]
        full = self._payload[base:base + math.prod(info.shape)].reshape(info.shape)
        return full if start is None else full[start:stop]

    def close(self) -> None:
        self._payload = None


# ------------------------------------------------------------------ safetensors

def _unique_keys(pairs) -> dict:
    """A JSON object hook refusing repeated keys (JSON would keep the last)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


class SafetensorsSource(CheckpointSource):
    """A safetensors file, read with the `safetensors` library.

    The header is checked here before the library opens the file (both
    layers must agree): the 8-byte header length within the file, the header
    a JSON object, every tensor a known dtype with a shape whose byte length
    equals its `data_offsets` span, every span inside the data section, and
    no two spans overlapping. A file that fails any of it raises SourceError
    at construction; no lease is ever granted from it.
    """

    def __init__(self, path, max_lease_bytes: int = DEFAULT_MAX_LEASE_BYTES):
        super().__init__(path, max_lease_bytes)
        header = self._check_header()
        self.metadata = dict(header.pop("__metadata__", None) or {})  # str -> str
        for key, entry in header.items():
            self._tensors[key] = tensor_info(SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"])
        try:  # the library's own checks (contiguous spans, file fully covered, ...)
            self._file = safetensors.safe_open(self.path, framework="numpy")
        except safetensors.SafetensorError as e:
            raise SourceError(f"{self.path}: not a valid safetensors file: {e}") from None
        if sorted(self._file.keys()) != sorted(self._tensors):
            raise SourceError(f"{self.path}: the safetensors library lists other tensors "
                              "than the header")

    def _check_header(self) -> dict:
        name = self.path
        try:
            with open_regular(self.path) as f:  # a FIFO is never opened (it would block)
                size = os.fstat(f.fileno()).st_size
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise SourceError(f"{name}: {size} bytes, too short for a safetensors header")
                (n,) = struct.unpack("<Q", prefix)
                if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
                    raise SourceError(
                        f"{name}: header length {n} runs beyond the file of {size} bytes")
                raw = f.read(n)
        except OSError as e:
            raise SourceError(f"{name}: cannot read: {e.strerror or e}") from None
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise SourceError(f"{name}: header is not valid UTF-8 JSON ({e})") from None
        if not isinstance(header, dict):
            raise SourceError(f"{name}: header is not a JSON object")
        meta = header.get("__metadata__")
        if meta is not None and not (isinstance(meta, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
            raise SourceError(f"{name}: __metadata__ is not a map of strings to strings")
        data_bytes = size - 8 - n
        spans = []
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            what = f"{name}: tensor {key!r}"
            if not (isinstance(entry, dict) and {"dtype", "shape", "data_offsets"} <= set(entry)):
                raise SourceError(f"{what}: entry needs dtype, shape and data_offsets")
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if dtype not in SAFETENSORS_DTYPES:
                raise SourceError(f"{what}: dtype {dtype!r} is not supported "
                                  f"({', '.join(SAFETENSORS_DTYPES)})")
            if not (isinstance(shape, list) and all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
                raise SourceError(f"{what}: shape {shape!r} is not a list of sizes")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                    isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
                raise SourceError(f"{what}: data_offsets {offsets!r} is not [begin, end]")
            begin, end = offsets
            if not 0 <= begin <= end <= data_bytes:
                raise SourceError(f"{what}: data_offsets {begin}:{end} outside the "
                                  f"{data_bytes} data bytes")
            nbytes = tensor_info(SAFETENSORS_DTYPES[dtype], shape).nbytes
            if nbytes != end - begin:
                raise SourceError(f"{what}: shape {shape} of {dtype} is {nbytes} bytes but "
                                  f"data_offsets span {end - begin}")
            spans.append((begin, end, key))
        spans.sort()
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                raise SourceError(f"{name}: tensors {a!r} and {b!r} overlap")
        return header

    def _read(self, key, start, stop):
        try:
            if start is None:
                return self._file.get_tensor(key)
            if start == stop:  # the library refuses an empty range at the end
                info = self._tensors[key]
                return np.empty((0,) + info.shape[1:], DTYPES[info.dtype])
            return self._file.get_slice(key)[start:stop]
        except safetensors.SafetensorError as e:
            raise SourceError(f"{self.path}: reading {key!r}: {e}") from None

    def close(self) -> None:
        self._file = None
