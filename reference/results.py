"""The result file: the loss layout of one invocation (SPEC section 11).

    offset 0    magic b"CPLSRSLT", uint32 LE version = 2, uint32 LE header length Hn
    offset 16   header JSON (keys sorted, no insignificant spaces), zero bytes to 4096
    records     uint32 LE kind, uint32 LE payload bytes n, payload, uint32 LE CRC-32
                (zlib) of the 8 kind/n bytes followed by the payload

The file is appended as the run proceeds: each record is written whole and
flushed, so a reader during training or after a crash sees every complete
record and stops cleanly at the first incomplete one or the first bad CRC.

The writer writes version 3 (kinds 1 to 7); the reader reads versions 1
(kinds 1 to 4), 2 (kinds 1 to 6) and 3. Damage (a cut, a flipped bit: anything the CRC or a
length check catches) stops the reader; a record whose CRC is good but
whose content is not what this version writes (an unknown kind, an
evaluation's K that disagrees with its length, a mean that is not the mean
of its losses) is refused with an error, since no crash produces it.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

from .config import Config, config_from_identity
from .errors import ConfigError, ResultFileError
from .fsutil import open_regular

MAGIC = b"CPLSRSLT"
VERSION = 3  # what the writer writes
MAX_HEADER = 16 * 1024 * 1024  # a longer header length field is refused unread
ALIGN = 4096

FORWARD, STEP, TIMING, FINAL, EVAL, NORM, METRICS = 1, 2, 3, 4, 5, 6, 7
KIND_NAMES = {FORWARD: "forward", STEP: "step", TIMING: "timing", FINAL: "final", EVAL: "eval",
              NORM: "norm", METRICS: "metrics"}
KINDS = {1: (FORWARD, STEP, TIMING, FINAL), 2: (FORWARD, STEP, TIMING, FINAL, EVAL, NORM),
         3: (FORWARD, STEP, TIMING, FINAL, EVAL, NORM, METRICS)}  # version -> its kinds
FIRST_VERSION = {kind: min(v for v, kinds in KINDS.items() if kind in kinds) for kind in KIND_NAMES}
MAX_STEP = 2**63 - 1  # step numbers are uint64 on disk; larger ones are refused (no run gets there)

PREFIX = struct.Struct("<8sII")  # magic, version, header length Hn
RECORD = struct.Struct("<II")  # kind, payload bytes n
CRC = struct.Struct("<I")
STEP_HEAD = struct.Struct("<Q")  # global step number, then the (B,T) row losses
TIMING_BODY = struct.Struct("<Qdd")  # step, host seconds, device seconds (NaN: no clock)
PREDICTIONS = struct.Struct("<6I")  # per prediction row: argmax token, validity
EVAL_HEAD = struct.Struct("<QIf")  # updates done, K, mean held-out loss; then (K,) float32
EVAL_K = struct.Struct("<QI")  # the head's first two fields
NORM_BODY = struct.Struct("<Qf")  # step, gradient norm before clipping
# step, model FLOP of the step, the device's peak FLOP/s, MFU, device memory
# bytes in use (each float64; NaN where unknown)
METRICS_BODY = struct.Struct("<Qdddd")

HEADER_STRINGS = ("model", "learner", "data", "backend")
HEADER_STRINGS_V2 = ("initialization",)  # version 2 also names the initialization (SPEC 11)
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
        "initialization": identities["initialization"],
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
    """kind -> the exact payload length in bytes, for the kinds of fixed length
    (an evaluation's is EVAL_HEAD.size + 4 K)."""
    return {
        FORWARD: 3 * V * 4,  # (3,V) float32
        STEP: STEP_HEAD.size + B * T * 4,  # step, (B,T) float32
        TIMING: TIMING_BODY.size,
        FINAL: 4 * T * 4 + V * 4 + PREDICTIONS.size,  # (4,T), (V,), 3 x (argmax, valid)
        NORM: NORM_BODY.size,
        METRICS: METRICS_BODY.size,
    }


def eval_mean(context_losses) -> np.float32:
    """The mean held-out loss a kind-5 record stores: the K float32 losses
    summed exactly (math.fsum: correctly rounded, so no summation order can
    change it), divided by K in float64, rounded once to float32. Where a
    loss is not finite the mean is what IEEE arithmetic makes of it (NaN,
    or an infinity), since fsum refuses inf - inf."""
    x = np.asarray(context_losses, dtype=np.float32).astype(np.float64)  # (K,)
    if not np.isfinite(x).all():
        with np.errstate(invalid="ignore", over="ignore"):
            return np.float32(np.sum(x) / len(x))
    return np.float32(math.fsum(x.tolist()) / len(x))


def _same_float(a: np.float32, b: np.float32) -> bool:
    return bool(a == b) or bool(np.isnan(a) and np.isnan(b))


def _f32(x, shape, what: str, path) -> bytes:
    a = np.asarray(x)
    if a.shape != shape:
        raise ResultFileError(f"result file {path}: {what} has shape {a.shape}, expected {shape}")
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def _step_number(step, path) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step <= MAX_STEP:
        raise ResultFileError(f"result file {path}: step number {step!r} is not an integer "
                              f"in [0, {MAX_STEP}]")
    return int(step)


class ResultWriter:
    """Appends records to a new result file; never overwrites an existing one."""

    def __init__(self, path, header: dict):
        self.path = os.fspath(path)
        self.B, self.T, self.V = header["batch"], header["context"], header["vocab"]
        self._eval_k = None  # K of the first evaluation written
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

    def eval(self, step: int, context_losses) -> None:
        """An evaluation after `step` updates: the mean loss of each of the K
        held-out contexts, (K,) float32. The writer stores the mean of them
        (eval_mean), so the printed, recorded and plotted means are one number."""
        losses = np.asarray(context_losses)
        if losses.ndim != 1 or len(losses) == 0:
            raise ResultFileError(f"result file {self.path}: evaluation at step {step}: context "
                                  f"losses have shape {losses.shape}, expected (K,) with K >= 1")
        if self._eval_k is not None and len(losses) != self._eval_k:
            # one invocation holds out one set of contexts: K is the file's, once
            raise ResultFileError(f"result file {self.path}: evaluation at step {step} has "
                                  f"K={len(losses)} contexts, earlier ones had {self._eval_k}")
        self._eval_k = len(losses)
        body = np.ascontiguousarray(losses, dtype="<f4")  # (K,)
        # the mean goes in as the float32 it is (struct's "f" would refuse an
        # infinity that a diverged run can produce)
        self._record(EVAL, EVAL_K.pack(_step_number(step, self.path), len(body))
                     + eval_mean(body).astype("<f4").tobytes() + body.tobytes())

    def norm(self, step: int, norm) -> None:
        """The gradient norm of step `step` before clipping (SPEC 7), as float32."""
        self._record(NORM, STEP_HEAD.pack(_step_number(step, self.path))
                     + np.float32(norm).astype("<f4").tobytes())

    def metrics(self, step: int, flops: float, peak_flops: float, mfu: float,
                memory_bytes: float) -> None:
        """Step `step`'s model FLOP, the peak FLOP/s it is measured against,
        its model FLOP utilisation and the device memory in use (NaN: not
        known). Not deterministic, like a timing record."""
        self._record(METRICS, METRICS_BODY.pack(_step_number(step, self.path), float(flops),
                                                float(peak_flops), float(mfu),
                                                float(memory_bytes)))

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
    version: int = VERSION
    forward: np.ndarray | None = None  # (3,V) float32
    steps: list = field(default_factory=list)  # [(step, row losses (B,T) float32)]
    timings: list = field(default_factory=list)  # [(step, host_s, device_s)]
    evals: list = field(default_factory=list)  # [(updates done, mean float32, losses (K,) float32)]
    norms: list = field(default_factory=list)  # [(step, gradient norm float32)]
    metrics: list = field(default_factory=list)  # [(step, flops, peak FLOP/s, MFU, memory bytes)]
    final: dict | None = None  # loss_block (4,T), logits_last (V,), predictions [(argmax, valid)]*3
    complete: bool = False  # a final record was read
    stopped: str | None = None  # why reading stopped before the end of the file, if it did
    end: int = 0  # offset just past the last complete record

    @property
    def eval_steps(self) -> np.ndarray:  # (R,) int64: updates done at each evaluation
        return np.array([s for s, _, _ in self.evals], dtype=np.int64)

    @property
    def eval_means(self) -> np.ndarray:  # (R,) float32
        return np.array([m for _, m, _ in self.evals], dtype=np.float32)

    @property
    def eval_losses(self) -> np.ndarray:  # (R,K) float32: per held-out context (K is the file's)
        K = len(self.evals[0][2]) if self.evals else 0
        return np.array([losses for _, _, losses in self.evals], dtype=np.float32).reshape(
            len(self.evals), K)

    @property
    def norm_steps(self) -> np.ndarray:  # (R,) int64
        return np.array([s for s, _ in self.norms], dtype=np.int64)

    @property
    def norm_values(self) -> np.ndarray:  # (R,) float32
        return np.array([n for _, n in self.norms], dtype=np.float32)


def _read_header(path, f, size: int) -> tuple:
    def refuse(what):
        return ResultFileError(f"result file {path}: {what}")

    prefix = f.read(PREFIX.size)
    if len(prefix) < PREFIX.size:
        raise refuse(f"file is {size} bytes, too short for a result file")
    magic, version, hn = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise refuse(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version not in KINDS:
        raise refuse(f"format version {version}, this reader knows {', '.join(map(str, KINDS))}")
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
    for key in HEADER_STRINGS + (HEADER_STRINGS_V2 if version >= 2 else ()):
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
    return header, version, records


def read_results(path) -> Results:
    """Read every complete record; stop cleanly at the first incomplete one or
    bad CRC (the reason is in .stopped). A bad magic or header, and a record
    that is whole but not one this version writes, are refused."""
    path = os.fspath(path)
    try:
        f = open_regular(path)
    except OSError as e:
        raise ResultFileError(f"result file {path}: cannot read: {e.strerror or e}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        header, version, offset = _read_header(path, f, size)
        out = Results(path=path, header=header, version=version, end=offset)
        _read_records(path, f, size, offset, out)
    return out


def _read_records(path, f, size: int, offset: int, out: Results) -> None:
    B, T, V = out.header["batch"], out.header["context"], out.header["vocab"]
    sizes = payload_sizes(B, T, V)
    known = KINDS[out.version]

    def refuse(what):
        return ResultFileError(f"result file {path}: record at offset {offset}: {what}")

    def step_number(payload):
        (step,) = STEP_HEAD.unpack_from(payload)
        if step > MAX_STEP:
            raise refuse(f"step number {step} exceeds {MAX_STEP}")
        return step

    while True:
        head = f.read(RECORD.size)
        if not head:
            return
        if len(head) < RECORD.size:
            out.stopped = f"truncated record at offset {offset}"
            return
        kind, n = RECORD.unpack(head)
        if kind == EVAL and kind in known:
            length_ok = n >= EVAL_HEAD.size + 4 and (n - EVAL_HEAD.size) % 4 == 0  # K >= 1
        else:
            length_ok = kind not in known or sizes[kind] == n
        if not length_ok:  # checked before reading n bytes: n may be hostile
            out.stopped = f"bad record header at offset {offset} (kind {kind}, {n} bytes)"
            return
        if offset + RECORD.size + n + CRC.size > size:  # bounded: never read past the file
            out.stopped = f"truncated record at offset {offset}"
            return
        body = f.read(n + CRC.size)
        if len(body) < n + CRC.size:  # the file shrank while being read
            out.stopped = f"truncated record at offset {offset}"
            return
        payload = body[:n]
        if zlib.crc32(payload, zlib.crc32(head)) != CRC.unpack(body[n:])[0]:
            out.stopped = f"bad CRC at offset {offset}"
            return
        # The CRC is good: the writer wrote this record as it is, so what
        # follows is refused rather than read past (no crash makes it).
        if kind not in known:
            name = (f" ({KIND_NAMES[kind]}, a version-{FIRST_VERSION[kind]} kind)"
                    if kind in KIND_NAMES else "")
            raise refuse(f"unknown record kind {kind}{name}: a version-{out.version} file has kinds "
                         f"{', '.join(map(str, known))}")
        if kind == FORWARD:
            out.forward = np.frombuffer(payload, "<f4").reshape(3, V)
        elif kind == STEP:
            (step,) = STEP_HEAD.unpack_from(payload)
            # a writer numbers steps first_step, first_step + 1, ...: any
            # other number (2^64 - 1, say) is not a record of this run
            expected = out.header["first_step"] + len(out.steps)
            if step != expected:
                out.stopped = (f"step record at offset {offset} has step {step}, expected "
                               f"{expected}")
                return
            rows = np.frombuffer(payload, "<f4", offset=STEP_HEAD.size).reshape(B, T)
            out.steps.append((step_number(payload), rows))
        elif kind == TIMING:
            timing = TIMING_BODY.unpack(payload)
            if not out.steps or timing[0] != out.steps[-1][0]:
                out.stopped = (f"timing record at offset {offset} has step {timing[0]}, not the "
                               f"step before it")
                return
            out.timings.append(timing)
        elif kind == FINAL:
            block = np.frombuffer(payload, "<f4", count=4 * T).reshape(4, T)
            logits = np.frombuffer(payload, "<f4", count=V, offset=16 * T)
            flat = PREDICTIONS.unpack_from(payload, 16 * T + 4 * V)
            out.final = {"loss_block": block, "logits_last": logits,
                         "predictions": [(flat[0], flat[1]), (flat[2], flat[3]), (flat[4], flat[5])]}
            out.complete = True
        elif kind == METRICS:
            out.metrics.append(METRICS_BODY.unpack(payload))
        elif kind == EVAL:
            out.evals.append(_eval_record(payload, n, step_number(payload), out, refuse))
        else:  # NORM
            norm = np.frombuffer(payload, "<f4", count=1, offset=STEP_HEAD.size)[0]
            out.norms.append((step_number(payload), norm))
        offset += RECORD.size + n + CRC.size
        out.end = offset


def _eval_record(payload: bytes, n: int, step: int, out: Results, refuse) -> tuple:
    _, K, _ = EVAL_HEAD.unpack_from(payload)
    if EVAL_HEAD.size + 4 * K != n:
        raise refuse(f"evaluation of K={K} contexts needs {EVAL_HEAD.size + 4 * K} payload bytes, "
                     f"the record has {n}")
    if out.evals and len(out.evals[0][2]) != K:
        raise refuse(f"evaluation of K={K} contexts, the file's first one had {len(out.evals[0][2])}")
    mean = np.frombuffer(payload, "<f4", count=1, offset=EVAL_HEAD.size - 4)[0]
    losses = np.frombuffer(payload, "<f4", offset=EVAL_HEAD.size)  # (K,)
    if not _same_float(mean, eval_mean(losses)):
        raise refuse(f"evaluation at step {step}: stored mean {mean} is not the mean of its "
                     f"{K} context losses ({eval_mean(losses)})")
    return step, mean, losses
