"""The checkpoint file (SPEC section 10).

    offset 0    magic b"CPLSCKPT", uint32 LE version = 1, uint32 LE header length Hn
    offset 16   header: Hn bytes of UTF-8 JSON, keys sorted, no insignificant spaces
    then        zero bytes up to the next multiple of 4096 (the payload offset)
    payload     P, then M, then V, each (N,) float32 LE: 12 N bytes
    trailer     b"CPLSDONE", uint64 LE payload bytes, SHA-256 of bytes [0, trailer start)

Writing and reading stream the payload in CHUNK_BYTES pieces: the coppelius
preset's payload is 692 MB and is never held twice. A file is checked from
the cheap end (magic, version, lengths, header, size, trailer) before the
SHA-256 pass, so a hostile length field is refused before anything large is
allocated or read. Nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from .schedule import learner_from_identity
from .config import (SEED, Config, config_from_identity, data_from_identity, data_identity,
                     initialization_identity, parameter_count,
                     schema_identity, seed_from_identity, tensor_count)
from .errors import CheckpointError, ConfigError, IdentityMismatch
from .fsutil import open_regular, publish, regular_or_absent
from .params import registry
from .state import State

CHUNK_BYTES = 4194304  # 4 MiB: the unit of streamed reads, writes and hashing
SYNC_BYTES = 16 * CHUNK_BYTES  # a checkpoint being written is synced every 64 MiB
MAGIC = b"CPLSCKPT"
VERSION = 1
TRAILER_MAGIC = b"CPLSDONE"
MAX_HEADER = 16 * 1024 * 1024  # a longer header length field is refused unread
ALIGN = 4096  # the payload starts on a page boundary

PREFIX = struct.Struct("<8sII")  # magic, version, header length Hn
TRAILER = struct.Struct("<8sQ32s")  # magic, payload bytes, SHA-256

STRING_KEYS = ("schema", "model", "learner", "data", "initialization")
IDENTITY_KEYS = STRING_KEYS + ("chunk_bytes",)  # compared with the run's (SPEC 10)
COUNT_KEYS = ("chunk_bytes", "step", "contexts")


@dataclass
class CheckpointInfo:
    """What validation learned about a file; nothing of the payload is held."""

    path: str
    header: dict
    payload_offset: int
    payload_bytes: int
    file_size: int
    sha256: str = ""  # hex digest of the content
    trailer_sha256: str = ""  # the digest the trailer records
    digest_ok: bool = True  # False only from inspect(): validate() refuses a mismatch


@dataclass
class Checkpoint:
    info: CheckpointInfo
    header: dict
    state: State  # P, M, V (N,) float32 and t = step
    step: int  # updates applied so far
    contexts: int  # contexts consumed so far


def identities(config: Config, hyper, precision: str, batch: int, tokenizer_sha: str | None,
               stream_sha: str, seed: int = SEED, heldout: int = 0,
               eval_sha: str | None = None) -> dict:
    """The identity keys of the envelope, as a run computes them."""
    return {
        "schema": schema_identity(config),
        "model": config.identity(),
        "learner": hyper.identity(precision),
        "data": data_identity(config, batch, tokenizer_sha, stream_sha, heldout, eval_sha),
        "initialization": initialization_identity(seed),
        "chunk_bytes": CHUNK_BYTES,
    }


def is_fresh(path) -> bool:
    """A missing or zero-byte checkpoint path selects fresh initialization
    (SPEC 9). Only a regular file counts: a FIFO or a device (size 0 too)
    is refused with NotRegularFile (an OSError), never taken for fresh."""
    st = regular_or_absent(path)
    return st is None or st.st_size == 0


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _error(path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {os.fspath(path)}: {what}")


# ------------------------------------------------------------------- writing

def write_checkpoint(path, config: Config, identities: dict, state: State, contexts: int) -> None:
    """Publish a checkpoint of `state` atomically and durably (SPEC 10).
    On failure the path keeps its old content and a CheckpointError names it."""
    path = os.fspath(path)
    reg = registry(config)
    for key in IDENTITY_KEYS:
        if key not in identities:
            raise _error(path, f"identity {key!r} missing from the run's identities")
    arrays = []
    for name in ("P", "M", "V"):
        a = getattr(state, name)
        if a.shape != (reg.total,) or a.dtype != np.float32:
            raise _error(path, f"state.{name} is {a.dtype} {a.shape}, expected float32 ({reg.total},)")
        arrays.append(np.ascontiguousarray(a, dtype="<f4"))  # no copy on little-endian hosts
    header = {key: identities[key] for key in IDENTITY_KEYS}
    header.update(step=int(state.t), contexts=int(contexts), parameters=reg.describe())
    check_envelope(path, header, 12 * reg.total)  # never write what no reader would take
    raw = canonical_json(header)
    payload_offset = _align(PREFIX.size + len(raw))
    payload_bytes = 12 * reg.total

    def write_body(f):
        # The SHA-256 pass and the writes overlap: each piece is hashed on a
        # second thread while it is written (both release the GIL), in
        # order; the trailer waits for the last. The file is also synced
        # every SYNC_BYTES, so the disk starts on it long before the final
        # fsync (a sync holds up the writes and the next piece's hash).
        with ThreadPoolExecutor(1, thread_name_prefix="coppelius-sha256") as hasher:
            sha, hashed, written = hashlib.sha256(), None, 0

            def put(data):
                nonlocal hashed, written
                if hashed is not None:
                    hashed.result()  # the previous piece first: the digest is of the bytes in order
                hashed = hasher.submit(sha.update, data)
                f.write(data)
                written += len(data)
                if written >= SYNC_BYTES:
                    f.flush()
                    _datasync(f.fileno())
                    written = 0

            put(PREFIX.pack(MAGIC, VERSION, len(raw)))
            put(raw)
            put(bytes(payload_offset - PREFIX.size - len(raw)))
            for a in arrays:  # P, then M, then V
                view = memoryview(a).cast("B")
                for start in range(0, len(view), CHUNK_BYTES):
                    put(view[start:start + CHUNK_BYTES])
            hashed.result()
        f.write(TRAILER.pack(TRAILER_MAGIC, payload_bytes, sha.digest()))

    try:
        publish(path, write_body)
    except OSError as e:
        raise _error(path, f"cannot publish: {e}") from None


def _datasync(fd: int) -> None:
    # the data written so far on its way to the disk (the final fsync of
    # fsutil.stage still makes the whole file durable before it is renamed)
    getattr(os, "fdatasync", os.fsync)(fd)


# ------------------------------------------------------------------- reading

def canonical_json(header: dict) -> bytes:
    """The one spelling of a header (SPEC 10: keys sorted, no insignificant spaces)."""
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")


def check_envelope(path, header: dict, payload_bytes: int) -> Config:
    """Check that a header's identities are ones this version writes and agree
    with each other and with the payload's size; returns the model. Cheap (no
    payload byte is read, nothing is allocated for the claimed model) and
    done before the SHA-256 pass: a header that claims 10^8 layers, or a
    sparse file of many GiB whose claims do not add up, is refused at once.

    The model identity gives the parameter count (config.parameter_count),
    which must be the payload's; the schema, learner, data and
    initialization identities must rebuild to themselves; `contexts` must be
    `step * batch` (SPEC 9: step s reads contexts c0 + s*B + b)."""
    where = f"checkpoint {os.fspath(path)}"
    try:
        config = config_from_identity(header["model"], where)
        count = parameter_count(config)
        listed = len(header["parameters"])
        if listed != tensor_count(config) or 12 * count != payload_bytes:
            raise _error(path, f"the model identity {header['model']!r} has {tensor_count(config)} "
                               f"tensors of {count} parameters, the header lists {listed} tensors "
                               f"of {payload_bytes // 12}")
        if header["schema"] != schema_identity(config):
            raise _error(path, f"schema identity {header['schema']!r} is not "
                               f"{schema_identity(config)!r}, this model's")
        learner_from_identity(header["learner"], where)
        batch = data_from_identity(header["data"], config, where)["batch"]
        seed_from_identity(header["initialization"], where)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if header["contexts"] != header["step"] * batch:
        raise _error(path, f"contexts {header['contexts']} is not step {header['step']} times "
                           f"the batch {batch}")
    return config


def _parse_header(path, raw: bytes) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        detail = (str(e).splitlines() or [type(e).__name__])[0]
        raise _error(path, f"header is not UTF-8 JSON ({detail})") from None
    if not isinstance(header, dict):
        raise _error(path, f"header is a JSON {type(header).__name__}, expected an object")
    if canonical_json(header) != raw:
        # a repeated key ({"step":0,"step":3}: JSON keeps the last) or another
        # spelling of the same object: not what any writer of this format wrote
        raise _error(path, "header is not in canonical form (keys sorted and unrepeated, "
                           "no insignificant spaces)")
    for key in STRING_KEYS:
        if key not in header:
            raise _error(path, f"header lacks key {key!r}")
        if not isinstance(header[key], str):
            raise _error(path, f"header key {key!r} is {header[key]!r}, expected a string")
    for key in COUNT_KEYS:
        if key not in header:
            raise _error(path, f"header lacks key {key!r}")
        value = header[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < (key == "chunk_bytes"):
            least = "a positive" if key == "chunk_bytes" else "a non-negative"
            raise _error(path, f"header key {key!r} is {value!r}, expected {least} integer")
    if "parameters" not in header:
        raise _error(path, "header lacks key 'parameters'")
    return header


def _count_parameters(path, parameters) -> int:
    """Check the parameter list is well-formed and contiguous; return its element count."""
    if not isinstance(parameters, list) or not parameters:
        raise _error(path, "header key 'parameters' must be a non-empty list")
    count, names = 0, set()
    for i, p in enumerate(parameters):
        if not isinstance(p, dict) or not {"name", "shape", "offset"} <= p.keys():
            raise _error(path, f"parameters[{i}] must be an object with name, shape and offset")
        name, shape, offset = p["name"], p["shape"], p["offset"]
        if not isinstance(name, str) or not name:
            raise _error(path, f"parameters[{i}] name {name!r} is not a non-empty string")
        if name in names:
            raise _error(path, f"parameter {name} is listed twice")
        names.add(name)
        if (not isinstance(shape, list) or not shape
                or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape)):
            raise _error(path, f"parameter {name} shape {shape!r} is not a list of positive integers")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset != count:
            raise _error(path, f"parameter {name} offset {offset!r}, expected {count} "
                               "(parameters are contiguous, in order)")
        count += math.prod(shape)
    return count


def _read_exact_into(f, view) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise EOFError
        got += n


def open_checkpoint(path):
    """The checkpoint file open for reading (binary); CheckpointError if it is
    not a readable regular file (fsutil.open_regular: a FIFO is never opened)."""
    path = os.fspath(path)
    try:
        return open_regular(path)
    except OSError as e:
        raise _error(path, f"cannot read: {e.strerror or e}") from None


def _scan(path, refuse_digest: bool = True, file=None) -> CheckpointInfo:
    """Check a checkpoint file with bounded memory: structure, then the
    SHA-256 of everything before the trailer, in `chunk_bytes` pieces.
    Reading the payload is the binding layer's (sources.CheckpointFileSource
    maps the file this checked; binding.load_state makes P, M and V of it).
    `refuse_digest=False` (inspect only) reports a SHA-256 mismatch in the
    info instead of refusing. `file`: the file at `path` already open (left
    open), read instead of reopening the path."""
    path = os.fspath(path)
    with open_checkpoint(path) if file is None else nullcontext(file) as f:
        f.seek(0)
        size = os.fstat(f.fileno()).st_size
        if size < PREFIX.size + TRAILER.size:
            raise _error(path, f"file is {size} bytes, too short for a checkpoint")
        prefix = f.read(PREFIX.size)
        magic, version, hn = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise _error(path, f"bad magic {magic!r} (expected {MAGIC!r})")
        if version != VERSION:
            raise _error(path, f"format version {version}, this reader knows {VERSION}")
        if hn > MAX_HEADER:
            raise _error(path, f"header length {hn} exceeds the limit {MAX_HEADER}")
        if PREFIX.size + hn + TRAILER.size > size:
            raise _error(path, f"header length {hn} runs beyond the file ({size} bytes)")
        raw = f.read(hn)
        header = _parse_header(path, raw)
        count = _count_parameters(path, header["parameters"])
        payload_offset = _align(PREFIX.size + hn)
        payload_bytes = 12 * count
        expected = payload_offset + payload_bytes + TRAILER.size
        if size != expected:
            raise _error(path, f"file is {size} bytes, expected {expected} for {count} parameters "
                               "(truncated or extended)")
        check_envelope(path, header, payload_bytes)  # before any payload byte is read
        padding = f.read(payload_offset - PREFIX.size - hn)
        if padding.count(0) != len(padding):
            raise _error(path, "nonzero bytes in the padding after the header")
        f.seek(size - TRAILER.size)
        tail_magic, tail_bytes, digest = TRAILER.unpack(f.read(TRAILER.size))
        if tail_magic != TRAILER_MAGIC:
            raise _error(path, f"bad trailer magic {tail_magic!r} (expected {TRAILER_MAGIC!r})")
        if tail_bytes != payload_bytes:
            raise _error(path, f"trailer says {tail_bytes} payload bytes, header says {payload_bytes}")

        # The SHA-256 pass: everything before the trailer, in bounded pieces.
        sha = hashlib.sha256()
        for piece in (prefix, raw, padding):
            sha.update(piece)
        f.seek(payload_offset)
        buffer = memoryview(bytearray(min(CHUNK_BYTES, payload_bytes)))
        try:
            for start in range(0, payload_bytes, CHUNK_BYTES):
                piece = buffer[:min(CHUNK_BYTES, payload_bytes - start)]
                _read_exact_into(f, piece)
                sha.update(piece)
        except EOFError:
            raise _error(path, "file ended inside the payload (changed while reading?)") from None
        if sha.digest() != digest and refuse_digest:
            raise _error(path, f"SHA-256 mismatch: trailer has {digest.hex()}, "
                               f"content hashes to {sha.hexdigest()}")
    return CheckpointInfo(path, header, payload_offset, payload_bytes, size, sha.hexdigest(),
                          digest.hex(), sha.digest() == digest)


def validate(path, file=None) -> CheckpointInfo:
    """Check a checkpoint file completely (structure and SHA-256) with
    bounded memory; CheckpointError names the file and what is wrong.
    `file`: the file at `path` already open (open_checkpoint); it is checked
    instead of reopening the path, so a caller that maps it next maps the
    bytes checked, whatever is published at the path meanwhile."""
    return _scan(path, file=file)


def inspect(path) -> CheckpointInfo:
    """Like validate(), but a file whose structure is sound and whose SHA-256
    does not match is described (digest_ok False) rather than refused, so
    `coppelius inspect` can show its envelope. Never use it to trust a file."""
    return _scan(path, refuse_digest=False)


def _without(identity: str, prefixes: tuple) -> list:
    return [part for part in identity.split("|") if not part.startswith(prefixes)]


# What each lifting option may change (SPEC 9): --new-data the stream (and
# so how many of its contexts are held out, and the validation set); --new-learner the learning
# rate, the schedule, clipping and the other AdamW hyperparameters, never
# the precision policy (SPEC 6: a run resumes only under its policy).
LIFTED = {"data": ("stream=", "heldout=", "eval="),
          "learner": ("lr=", "beta1=", "beta2=", "weight_decay=", "epsilon=", "schedule=",
                      "clip=", "accumulate=")}


def check_identities(header: dict, path, expect: dict, new_data: bool = False,
                     new_learner: bool = False) -> None:
    """Compare a checkpoint's identities with the run's (SPEC 10): a mismatch
    names the key and both values. `new_data` lifts the data identity's
    `stream=` (and `heldout=`) parts, `new_learner` the learner's
    hyperparameters (not its precision)."""
    lift = {"data": new_data, "learner": new_learner}
    for key in IDENTITY_KEYS:
        have, want = header[key], expect[key]
        if lift.get(key):
            if _without(have, LIFTED[key]) != _without(want, LIFTED[key]):
                option = "--new-data" if key == "data" else "--new-learner"
                raise IdentityMismatch(
                    f"checkpoint {path}: {key} identity differs beyond what {option} lifts "
                    f"({', '.join(LIFTED[key])}): checkpoint has {have!r}, run has {want!r}")
        elif have != want:
            raise IdentityMismatch(f"checkpoint {path}: {key} identity differs: "
                                   f"checkpoint has {have!r}, run has {want!r}")
