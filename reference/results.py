"""The result file: the loss layout of one invocation (SPEC section 11).

    offset 0    magic b"CPLSRSLT", uint32 LE version = 1, uint32 LE header length Hn
    offset 16   header JSON (keys sorted, no insignificant spaces), zero bytes to 4096
    records     uint32 LE kind, uint32 LE payload bytes n, payload, uint32 LE CRC-32
                (zlib) of the 8 kind/n bytes followed by the payload

The file is appended as the run proceeds: each record is written whole and
flushed, so a reader during training or after a crash sees every complete
record and stops cleanly at the first incomplete one or the first bad CRC.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

from .config import Config, config_from_identity
from .errors import ConfigError, ResultFileError
from .fsutil import open_regular

MAGIC = b"CPLSRSLT"
VERSION = 1
MAX_HEADER = 16 * 1024 * 1024  # a longer header length field is refused unread
ALIGN = 4096

FORWARD, STEP, TIMING, FINAL = 1, 2, 3, 4
KIND_NAMES = {FORWARD: "forward", STEP: "step", TIMING: "timing", FINAL: "final"}

PREFIX = struct.Struct("<8sII")  # magic, version, header length Hn
RECORD = struct.Struct("<II")  # kind, payload bytes n
CRC = struct.Struct("<I")
STEP_HEAD = struct.Struct("<Q")  # global step number, then the (B,T) row losses
TIMING_BODY = struct.Struct("<Qdd")  # step, host seconds, device seconds (NaN: no clock)
PREDICTIONS = struct.Struct("<6I")  # per prediction row: argmax token, validity

HEADER_STRINGS = ("model", "learner", "data", "backend")
HEADER_COUNTS = {"first_step": 0, "steps": 0, "batch": 1, "context": 1, "vocab": 1}  # key -> least
MAX_STEP = 2**63 - 1  # step numbers are uint64 on disk, int64 wherever they are computed with


def prediction_rows(T: int) -> list:
    """The rows whose logits the forward and final records keep: T/4-1, T/2-1, T-1."""
    return [T // 4 - 1, T // 2 - 1, T - 1]


def result_header(config: Config, identities: dict, first_step: int, steps: int, batch: int,
                  backend: str, repeat_data: bool) -> dict:
    return {
        "model": identities["model"],
        "learner": identities["learner"],
        "data": identities["data"],
        "first_step": int(first_step),
        "steps": int(steps),
        "batch": int(batch),
        "context": config.context,
        "vocab": config.vocab,
        "prediction_rows": prediction_rows(config.context),
        "backend": backend,
        "repeat_data": bool(repeat_data),
    }


def default_results_path(run_dir, first_step: int) -> str:
    """results-<first step>.bin in the run directory, or -1, -2, ... if taken."""
    base = os.path.join(os.fspath(run_dir), f"results-{first_step}")
    path, k = base + ".bin", 0
    while os.path.lexists(path):
        k += 1
        path = f"{base}-{k}.bin"
    return path


def payload_sizes(B: int, T: int, V: int) -> dict:
    """kind -> the exact payload length in bytes."""
    return {
        FORWARD: 3 * V * 4,  # (3,V) float32
        STEP: STEP_HEAD.size + B * T * 4,  # step, (B,T) float32
        TIMING: TIMING_BODY.size,
        FINAL: 4 * T * 4 + V * 4 + PREDICTIONS.size,  # (4,T), (V,), 3 x (argmax, valid)
    }


def _f32(x, shape, what: str, path) -> bytes:
    a = np.asarray(x)
    if a.shape != shape:
        raise ResultFileError(f"result file {path}: {what} has shape {a.shape}, expected {shape}")
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


class ResultWriter:
    """Appends records to a new result file; never overwrites an existing one."""

    def __init__(self, path, header: dict):
        self.path = os.fspath(path)
        self.B, self.T, self.V = header["batch"], header["context"], header["vocab"]
        raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
        try:
            # exclusive: an existing file is refused; unbuffered: each record
            # goes to the file in one write, and no buffer is left to fail later
            self._f = open(self.path, "xb", buffering=0)
        except FileExistsError:
            raise ResultFileError(
                f"result file {self.path}: already exists (a run never overwrites one)") from None
        except OSError as e:
            raise ResultFileError(f"result file {self.path}: cannot create: {e}") from None
        start = PREFIX.pack(MAGIC, VERSION, len(raw)) + raw
        try:
            self._write(start + bytes(-len(start) % ALIGN))
        except BaseException:
            # no header, no result file: the file is this writer's own (created
            # exclusively above), so a full disk leaves nothing behind
            self._f.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
            raise

    def _write(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:  # a raw write may be short; a reader sees the record once it is whole
                view = view[self._f.write(view):]
        except OSError as e:
            raise ResultFileError(f"result file {self.path}: cannot write: {e}") from None

    def _record(self, kind: int, payload: bytes) -> None:
        head = RECORD.pack(kind, len(payload))
        crc = zlib.crc32(payload, zlib.crc32(head))
        self._write(head + payload + CRC.pack(crc))  # one write: the record whole

    def forward(self, logits) -> None:
        """Logits of the prediction rows of batch element 0, (3,V), before the first step."""
        self._record(FORWARD, _f32(logits, (3, self.V), "forward logits", self.path))

    def step(self, step: int, row_losses) -> None:
        """The row losses (B,T) of global step `step`."""
        rows = _f32(row_losses, (self.B, self.T), f"step {step} row losses", self.path)
        self._record(STEP, STEP_HEAD.pack(step) + rows)

    def timing(self, step: int, host_s: float, device_s: float) -> None:
        self._record(TIMING, TIMING_BODY.pack(step, float(host_s), float(device_s)))

    def final(self, loss_block, logits_last, predictions) -> None:
        """loss_block (4,T), logits of row T-1 after the final update (V,), and
        [(argmax, valid)] for the three prediction rows."""
        predictions = [(int(a), int(bool(v))) for a, v in predictions]
        if len(predictions) != 3:
            raise ResultFileError(f"result file {self.path}: {len(predictions)} predictions, expected 3")
        self._record(FINAL, _f32(loss_block, (4, self.T), "final loss block", self.path)
                     + _f32(logits_last, (self.V,), "final logits", self.path)
                     + PREDICTIONS.pack(*[x for pair in predictions for x in pair]))

    def close(self) -> None:
        if self._f.closed:
            return
        try:
            os.fsync(self._f.fileno())
        except OSError as e:
            raise ResultFileError(f"result file {self.path}: cannot sync: {e}") from None
        finally:
            try:
                self._f.close()
            except OSError:
                pass  # unbuffered: nothing is left to write; the fsync error (if any) is raised

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class Results:
    path: str
    header: dict
    forward: np.ndarray | None = None  # (3,V) float32
    steps: list = field(default_factory=list)  # [(step, row losses (B,T) float32)]
    timings: list = field(default_factory=list)  # [(step, host_s, device_s)]
    final: dict | None = None  # loss_block (4,T), logits_last (V,), predictions [(argmax, valid)]*3
    complete: bool = False  # a final record was read
    stopped: str | None = None  # why reading stopped before the end of the file, if it did
    end: int = 0  # offset just past the last complete record


def _read_header(path, f, size: int) -> tuple:
    def refuse(what):
        return ResultFileError(f"result file {path}: {what}")

    prefix = f.read(PREFIX.size)
    if len(prefix) < PREFIX.size:
        raise refuse(f"file is {size} bytes, too short for a result file")
    magic, version, hn = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise refuse(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise refuse(f"format version {version}, this reader knows {VERSION}")
    if hn > MAX_HEADER:
        raise refuse(f"header length {hn} exceeds the limit {MAX_HEADER}")
    records = PREFIX.size + hn + (-(PREFIX.size + hn) % ALIGN)
    if records > size:
        raise refuse(f"header and padding end at {records}, beyond the file ({size} bytes)")
    raw = f.read(hn)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        detail = (str(e).splitlines() or [type(e).__name__])[0]
        raise refuse(f"header is not UTF-8 JSON ({detail})") from None
    if not isinstance(header, dict):
        raise refuse(f"header is a JSON {type(header).__name__}, expected an object")
    if json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8") != raw:
        raise refuse("header is not in canonical form (keys sorted and unrepeated, "
                     "no insignificant spaces)")
    for key in HEADER_STRINGS:
        if not isinstance(header.get(key), str):
            raise refuse(f"header key {key!r} is {header.get(key)!r}, expected a string")
    for key in HEADER_COUNTS:
        value, least = header.get(key), HEADER_COUNTS[key]
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_STEP:
            raise refuse(f"header key {key!r} is {value!r}, expected an integer >= {least}")
    if header["first_step"] + header["steps"] > MAX_STEP:
        raise refuse(f"header: first_step {header['first_step']} + steps {header['steps']} "
                     f"exceeds 2^63 - 1")
    try:
        config = config_from_identity(header["model"], f"result file {path}")
    except ConfigError as e:
        raise ResultFileError(str(e)) from None
    for key in ("vocab", "context"):
        if header[key] != getattr(config, key):
            raise refuse(f"header key {key!r} is {header[key]}, the model identity's is "
                         f"{getattr(config, key)}")
    if header.get("prediction_rows") != prediction_rows(header["context"]):
        raise refuse(f"header key 'prediction_rows' is {header.get('prediction_rows')!r}, "
                     f"expected {prediction_rows(header['context'])}")
    if not isinstance(header.get("repeat_data"), bool):
        raise refuse(f"header key 'repeat_data' is {header.get('repeat_data')!r}, expected a boolean")
    padding = f.read(records - PREFIX.size - hn)
    if padding.count(0) != len(padding):
        raise refuse("nonzero bytes in the padding after the header")
    return header, records


def read_results(path) -> Results:
    """Read every complete record; stop cleanly at the first incomplete one or
    bad CRC (the reason is in .stopped). A bad magic or header is refused."""
    path = os.fspath(path)
    try:
        f = open_regular(path)
    except OSError as e:
        raise ResultFileError(f"result file {path}: cannot read: {e.strerror or e}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        header, offset = _read_header(path, f, size)
        B, T, V = header["batch"], header["context"], header["vocab"]
        sizes = payload_sizes(B, T, V)
        out = Results(path=path, header=header, end=offset)
        while True:
            head = f.read(RECORD.size)
            if not head:
                break
            if len(head) < RECORD.size:
                out.stopped = f"truncated record at offset {offset}"
                break
            kind, n = RECORD.unpack(head)
            if sizes.get(kind) != n:  # checked before reading n bytes: n may be hostile
                out.stopped = f"bad record header at offset {offset} (kind {kind}, {n} bytes)"
                break
            if offset + RECORD.size + n + CRC.size > size:  # nothing allocated for what is not there
                out.stopped = f"truncated record at offset {offset}"
                break
            body = f.read(n + CRC.size)
            if len(body) < n + CRC.size:
                out.stopped = f"truncated record at offset {offset}"
                break
            payload = body[:n]
            if zlib.crc32(payload, zlib.crc32(head)) != CRC.unpack(body[n:])[0]:
                out.stopped = f"bad CRC at offset {offset}"
                break
            if kind == FORWARD:
                out.forward = np.frombuffer(payload, "<f4").reshape(3, V)
            elif kind == STEP:
                (step,) = STEP_HEAD.unpack_from(payload)
                # a writer numbers steps first_step, first_step + 1, ...: any
                # other number (2^64 - 1, say) is not a record of this run
                if step != header["first_step"] + len(out.steps):
                    out.stopped = (f"step record at offset {offset} has step {step}, expected "
                                   f"{header['first_step'] + len(out.steps)}")
                    break
                rows = np.frombuffer(payload, "<f4", offset=STEP_HEAD.size).reshape(B, T)
                out.steps.append((step, rows))
            elif kind == TIMING:
                timing = TIMING_BODY.unpack(payload)
                if not out.steps or timing[0] != out.steps[-1][0]:
                    out.stopped = f"timing record at offset {offset} has step {timing[0]}, " \
                                  f"not the step before it"
                    break
                out.timings.append(timing)
            else:
                block = np.frombuffer(payload, "<f4", count=4 * T).reshape(4, T)
                logits = np.frombuffer(payload, "<f4", count=V, offset=16 * T)
                flat = PREDICTIONS.unpack_from(payload, 16 * T + 4 * V)
                out.final = {"loss_block": block, "logits_last": logits,
                             "predictions": [(flat[0], flat[1]), (flat[2], flat[3]), (flat[4], flat[5])]}
                out.complete = True
            offset += RECORD.size + n + CRC.size
            out.end = offset
    return out
