"""Model configuration (SPEC section 1) and the learner's hyperparameters
(SPEC section 7), with the identity strings of SPEC section 10.

Dimension vocabulary used throughout the project:
    B batch, T context, D d_model, H n_head, E head dim (D/H), F d_ff,
    V vocab, L n_layer.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .errors import ConfigError, NotRegularFile
from .fsutil import read_bounded

LAYERNORM_EPS = Fraction(1, 100000)  # the default norm_eps (SPEC 3, 21)
ROPE_BASE = 10000  # the default rope_base (SPEC 3, 21)
SEED = 20260925
PRECISIONS = ("fp32", "bf16")
NORMS = ("layernorm", "rmsnorm")

# The family's fields (SPEC 21) beside the shape: each default is the model of
# SPEC sections 1 to 5, and a field at its default adds nothing to the model
# identity. Declared here once; the registry (params.py), the layouts
# (layout.py) and every backend read them from the Config.
SHAPE_FIELDS = ("vocab", "context", "d_model", "n_layer", "n_head", "d_ff")
FAMILY_FIELDS = ("norm", "norm_eps", "n_kv_head", "tied", "rope_base", "rotary", "qkv_bias")
FAMILY_DEFAULTS = {"norm": "layernorm", "norm_eps": LAYERNORM_EPS, "tied": True,
                   "rope_base": Fraction(ROPE_BASE), "rotary": Fraction(1), "qkv_bias": False}
RATIONAL_LIMIT = Fraction(2**64)  # rope_base and norm_eps are float32 somewhere; far inside


@dataclass(frozen=True)
class Config:
    """A model: its shape (SPEC 1) and its family's fields (SPEC 21).
    Validated on construction; the error names the field."""

    vocab: int  # V
    context: int  # T
    d_model: int  # D
    n_layer: int  # L
    n_head: int  # H
    d_ff: int  # F
    steps: int = 8  # default steps of one invocation (run policy, not model)
    interval: int = 4  # default checkpoint interval (run policy, not model)
    norm: str = "layernorm"  # or "rmsnorm" (no bias)
    norm_eps: Fraction = LAYERNORM_EPS  # the norms' epsilon, exact
    n_kv_head: int | None = None  # Hkv, divides H; None (or H): H, no grouping; read kv_heads
    tied: bool = True  # the logits use tok_embedding.weight; False: lm_head.weight of its own
    rope_base: Fraction = Fraction(ROPE_BASE)
    rotary: Fraction = Fraction(1)  # the rotated fraction of each head, R = rotary * E
    qkv_bias: bool = False  # q, k, v products add a bias

    def __post_init__(self):
        for name in SHAPE_FIELDS + ("steps", "interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name}={value!r}: must be a positive integer")
        if self.d_model % self.n_head != 0:
            raise ConfigError(
                f"config field n_head={self.n_head}: must divide d_model={self.d_model}")
        if self.head_dim % 2 != 0:
            raise ConfigError(
                f"config field n_head={self.n_head}: head dim d_model/n_head={self.head_dim} must be even")
        self._check_family()

    def _check_family(self):
        if self.norm not in NORMS:
            raise ConfigError(f"config field norm={self.norm!r}: must be one of {', '.join(NORMS)}")
        kv = self.n_head if self.n_kv_head is None else self.n_kv_head
        if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or self.n_head % kv:
            raise ConfigError(f"config field n_kv_head={kv!r}: must be a positive integer "
                              f"dividing n_head={self.n_head}")
        # kept as None when it is H, so equal models compare equal and a
        # configuration that changes n_head (a TOML file over a preset) keeps
        # "no grouping" rather than a count that no longer divides
        object.__setattr__(self, "n_kv_head", None if kv == self.n_head else kv)
        for name in ("tied", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config field {name}={getattr(self, name)!r}: must be true or false")
        for name in ("norm_eps", "rope_base", "rotary"):
            value = getattr(self, name)
            if not isinstance(value, Fraction):
                value = parse_rational(value, f"config field {name}") \
                    if not isinstance(value, bool) else value
                object.__setattr__(self, name, value)
            if not isinstance(value, Fraction) or not 0 < value < RATIONAL_LIMIT:
                raise ConfigError(f"config field {name}={_show_value(value)}: must be a positive "
                                  f"number below 2^64")
            if np.float32(float(value)) == 0:
                raise ConfigError(f"config field {name}={_show_value(value)}: rounds to zero "
                                  f"in float32")
        if self.rotary > 1:
            raise ConfigError(f"config field rotary={_show_value(self.rotary)}: must be in (0, 1]")
        R = self.rotary * self.head_dim
        if R.denominator != 1 or R % 2:
            raise ConfigError(f"config field rotary={_show_value(self.rotary)}: rotary * head dim "
                              f"({self.head_dim}) must be an even integer")

    @property
    def head_dim(self) -> int:  # E
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:  # Hkv
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def kv_dim(self) -> int:  # Hkv * E: the width of k and of v
        return self.kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:  # R = rotary * E: the rotated elements of each head
        return int(self.rotary * self.head_dim)

    @property
    def norm_bias(self) -> bool:
        """Whether each norm has a bias (layernorm) or only a weight (rmsnorm)."""
        return self.norm == "layernorm"

    def family(self) -> dict:
        """The family's fields (SPEC 21) by name, defaults included."""
        return {name: self.kv_heads if name == "n_kv_head" else getattr(self, name)
                for name in FAMILY_FIELDS}

    def non_default(self) -> tuple:
        """The family's fields that differ from SPEC 1-5's model, in SPEC 21's order."""
        return tuple(name for name in FAMILY_FIELDS
                     if (self.n_kv_head is not None if name == "n_kv_head"
                         else getattr(self, name) != FAMILY_DEFAULTS[name]))

    def identity(self) -> str:
        """The model identity of SPEC section 10, with SPEC 21's parts: norm,
        eps, rope_base and tied always (their values replace the defaults'),
        then kv_heads, rotary and qkv_bias where they are not the defaults."""
        text = (f"vocab={self.vocab}|context={self.context}|d_model={self.d_model}"
                f"|n_layer={self.n_layer}|n_head={self.n_head}|d_ff={self.d_ff}"
                f"|norm={self.norm}|eps={identity_number(self.norm_eps)}"
                f"|rope_base={identity_number(self.rope_base)}|tied={int(self.tied)}")
        if self.n_kv_head is not None:
            text += f"|kv_heads={self.n_kv_head}"
        if self.rotary != 1:
            text += f"|rotary={identity_number(self.rotary)}"
        if self.qkv_bias:
            text += "|qkv_bias=1"
        return text


def check_implemented(config: Config, implemented: tuple, who: str) -> None:
    """Refuse, naming the field and its value, a configuration that sets a
    family field (SPEC 21) away from its default where `who` (a backend)
    does not implement it yet; `implemented` names the fields it does."""
    for name in config.non_default():
        if name not in implemented:
            value = config.family()[name]
            shown = identity_number(value) if isinstance(value, Fraction) else repr(value)
            raise ConfigError(f"{who}: config field {name}={shown} (SPEC 21) is not "
                              f"implemented here yet")


def identity_number(q: Fraction) -> str:
    """An exact rational in a model identity: an integer as itself (10000),
    anything else as rational_text (1/100000, 5/10)."""
    q = Fraction(q)
    return str(q.numerator) if q.denominator == 1 else rational_text(q)


def _show_value(value) -> str:
    return _show(value) if isinstance(value, Fraction) else repr(value)


PRESETS = {
    "coppelius": Config(vocab=12288, context=1024, d_model=512, n_layer=16, n_head=8,
                        d_ff=1408, steps=10000, interval=1000),
    "tiny": Config(vocab=2048, context=256, d_model=128, n_layer=4, n_head=4, d_ff=352,
                   steps=1000, interval=250),
    "test": Config(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96,
                   steps=8, interval=4),
    # the model families of SPEC 21, a preset each at the test size
    "test-llama": Config(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96,
                         steps=8, interval=4, norm="rmsnorm", n_kv_head=1, tied=False),
    "test-qwen": Config(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96,
                        steps=8, interval=4, norm="rmsnorm", n_kv_head=1, tied=False,
                        qkv_bias=True),
    "test-stablelm": Config(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96,
                            steps=8, interval=4, rotary=Fraction(1, 2), tied=False,
                            n_kv_head=1),
    # production, Llama-style: grouped-query attention, RMSNorm, untied, rope base 500000
    "llama-124m": Config(vocab=32768, context=1024, d_model=768, n_layer=12, n_head=12,
                         d_ff=2048, steps=10000, interval=1000, norm="rmsnorm", n_kv_head=4,
                         tied=False, rope_base=Fraction(500000)),
}


def preset(name: str) -> Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"preset {name!r}: unknown (choose from {', '.join(PRESETS)})") from None


# An exact rational is built from its text: "1e999999999" would be the
# integer 10**999999999, hours of arithmetic and gigabytes of digits. Every
# value a learner can use is far inside these bounds (float32 spans about
# 1e-45 to 3e38), so a longer text or a larger exponent is refused unbuilt.
MAX_RATIONAL_CHARS = 400
MAX_DECIMAL_EXPONENT = 4000
_EXPONENT = re.compile(r"[eE]([-+]?)([0-9_]+)$")  # Fraction's syntax: the exponent ends the text


def parse_rational(text, field: str) -> Fraction:
    """'3/10000', '0.0003' or '3e-4' -> an exact Fraction; the error names the field."""
    text = str(text).strip()
    if len(text) > MAX_RATIONAL_CHARS:
        raise ConfigError(f"{field}: a number of {len(text)} characters; at most "
                          f"{MAX_RATIONAL_CHARS} are read")
    m = _EXPONENT.search(text)
    digits = m.group(2).replace("_", "") if m else ""
    if digits and int(digits) > MAX_DECIMAL_EXPONENT:
        raise ConfigError(f"{field}={text!r}: the exponent is out of range (at most "
                          f"{MAX_DECIMAL_EXPONENT} in magnitude)")
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"{field}={text!r}: not a number (write e.g. 3/10000 or 0.0003)") from None
    return value


MODEL_FIELDS = SHAPE_FIELDS


def config_from_identity(model: str, where: str = "checkpoint") -> Config:
    """The Config whose model identity (SPEC 10, 21) is exactly `model`: a
    preset when one matches (for its steps and interval). Anything this
    version does not write (another norm, a missing field, a value spelled
    another way) is refused, naming `where`."""
    for config in PRESETS.values():
        if config.identity() == model:
            return config
    try:
        config = Config(**_identity_fields(str(model)))
    except (KeyError, ValueError, ConfigError):
        config = None
    if config is None or config.identity() != model:
        raise ConfigError(f"{where}: model identity {model!r} is not one this version implements")
    return config


def _identity_fields(model: str) -> dict:
    """The Config fields a model identity names (its canonical form is
    checked by rebuilding it); KeyError or ValueError where one is missing
    or unreadable."""
    fields = dict(part.partition("=")[::2] for part in model.split("|"))
    out = {k: int(fields[k]) for k in SHAPE_FIELDS}
    flags = {"0": False, "1": True}
    out.update(norm=fields["norm"], norm_eps=parse_rational(fields["eps"], "eps"),
               rope_base=parse_rational(fields["rope_base"], "rope_base"),
               tied=flags[fields["tied"]])
    if "kv_heads" in fields:
        out["n_kv_head"] = int(fields["kv_heads"])
    if "rotary" in fields:
        out["rotary"] = parse_rational(fields["rotary"], "rotary")
    if "qkv_bias" in fields:
        out["qkv_bias"] = flags[fields["qkv_bias"]]
    return out


# What a model configuration file may set (SPEC 17): the model's fields, and
# the run policy a preset carries (steps, interval) plus the batch a run
# defaults to. Without --preset, a file sets every model field, and steps and
# interval default to the tiny preset's (a configuration that trains on a CPU
# in minutes is the likely reason to write one).
RUN_KEYS = ("steps", "interval", "batch")
MODEL_FILE_KEYS = MODEL_FIELDS + FAMILY_FIELDS + RUN_KEYS
MODEL_FILE_BYTES = 1 << 20  # a model file is a few lines; anything larger is not one
MODEL_FILE_DEPTH = 8  # a model file's values are scalars; arrays or tables deeper than this
MODEL_FILE_DIGITS = 40  # characters of one number: every field is far shorter
FIELD_LIMIT = 1 << 31  # every field is an int32 somewhere (token ids, kernel indices)

# TOML's strings and comments, blanked before brackets and numbers are
# counted (the leftmost match wins, so a '#' inside a string stays a string)
_TOML_OPAQUE = re.compile(r'"""(?:[^\\]|\\.)*?"""|\'\'\'.*?\'\'\'|"(?:[^"\\\n]|\\.)*"'
                          r"|'[^'\n]*'|#[^\n]*", re.DOTALL)
_TOML_NUMBER = re.compile(r"[+-]?\b[0-9][0-9A-Za-z_.+-]*")
_TOML_KEY = re.compile(r"\s*([^=\s]+)\s*=")


def _toml_bounds(where: str, text: str) -> None:
    """Refuse, before parsing, what would make the TOML parser recurse
    without bound (arrays or inline tables nested deeply) or convert a number
    of thousands of digits: the refusal names the line and its key."""
    bare = _TOML_OPAQUE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)  # same offsets

    def line_of(offset: int) -> str:
        line = text.count("\n", 0, offset) + 1
        key = _TOML_KEY.match(text.split("\n")[line - 1])
        return f"line {line}" + (f": {key.group(1)}" if key else "")

    depth = 0
    for m in re.finditer(r"[][{}]", bare):
        depth += 1 if m.group() in "[{" else -1
        if depth > MODEL_FILE_DEPTH:
            raise ConfigError(f"{where}: {line_of(m.start())}: arrays or tables nested more than "
                              f"{MODEL_FILE_DEPTH} deep; a model file's values are numbers, "
                              f"strings and booleans")
    for m in _TOML_NUMBER.finditer(bare):
        if len(m.group()) > MODEL_FILE_DIGITS:
            raise ConfigError(f"{where}: {line_of(m.start())}: a number of {len(m.group())} "
                              f"characters; at most {MODEL_FILE_DIGITS} are read")


def _toml_shown(value) -> str:
    """A TOML value in a refusal, kept short."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def config_from_toml(path, base: Config | None = None) -> tuple:
    """(Config, run defaults) of a model configuration file (SPEC 17).

    `base` (a preset, from --preset) gives every field the file does not
    set; without it the file must set all of MODEL_FIELDS. Run defaults:
    {"batch": B} when the file sets batch, else {}. A refusal is one
    ConfigError naming the file, and the key or the TOML line. The file is
    read with a bound (at most MODEL_FILE_BYTES + 1 bytes, never waiting on
    a file that does not end) and checked for depth and number sizes before
    it is parsed."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    path = os.fspath(path)
    where = f"model file {path}"
    try:
        raw = read_bounded(path, MODEL_FILE_BYTES)  # a FIFO is never opened
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except (NotRegularFile, IsADirectoryError):
        raise ConfigError(f"{where}: not a regular file") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read ({e.strerror or e})") from None
    if len(raw) > MODEL_FILE_BYTES:
        raise ConfigError(f"{where}: larger than {MODEL_FILE_BYTES} bytes, not a model file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{where}: line {line}: not UTF-8 (byte offset {e.start})") from None
    _toml_bounds(where, text)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # its message ends "(at line L, column C)"
        raise ConfigError(f"{where}: not valid TOML: {e}") from None
    for key, value in doc.items():
        if key not in MODEL_FILE_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r} (a model file sets "
                              f"{', '.join(MODEL_FILE_KEYS)})")
        if key not in FAMILY_FIELDS and (isinstance(value, bool) or not isinstance(value, int)
                                         or not 0 < value < FIELD_LIMIT):
            raise ConfigError(f"{where}: {key} = {_toml_shown(value)}: must be a positive integer "
                              f"below 2^31")
    if base is None:
        missing = [k for k in MODEL_FIELDS if k not in doc]
        if missing:
            raise ConfigError(f"{where}: missing key {missing[0]!r} (without --preset a model "
                              f"file sets all of {', '.join(MODEL_FIELDS)})")
        base = PRESETS["tiny"]  # every model field is the file's; steps and interval default
    fields = {k: doc[k] for k in MODEL_FIELDS + ("steps", "interval") if k in doc}
    fields.update({k: _family_value(where, k, doc[k]) for k in FAMILY_FIELDS if k in doc})
    try:
        config = dataclasses.replace(base, **fields)
    except ConfigError as e:  # a shape the model cannot take (n_head not dividing d_model, ...)
        raise ConfigError(f"{where}: {e}") from None
    return config, {k: doc[k] for k in ("batch",) if k in doc}


def _family_value(where: str, key: str, value):
    """A family field (SPEC 21) as a TOML file writes it: norm a string,
    tied and qkv_bias booleans, n_kv_head an integer, norm_eps, rope_base
    and rotary a number or a string of an exact rational ("1/2", "1e-5"); a
    float is read from its decimal text, so 1e-5 is exactly 1/100000."""
    kinds = {"norm": (str,), "tied": (bool,), "qkv_bias": (bool,), "n_kv_head": (int,)}
    allowed = kinds.get(key, (int, float, str))
    if not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool)):
        shown = _toml_shown(value)
        want = {"norm": "a string", "tied": "true or false", "qkv_bias": "true or false",
                "n_kv_head": "an integer"}.get(key, 'a number or a string like "1/2"')
        raise ConfigError(f"{where}: {key} = {shown}: must be {want}")
    if key in ("norm_eps", "rope_base", "rotary"):
        try:
            return parse_rational(repr(value) if isinstance(value, float) else value, key)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    return value


def rational_text(q: Fraction) -> str:
    """The canonical text of an exact rational in an identity: a decimal
    fraction over the smallest power of ten that holds it (95/100, 3/10000),
    anything else in lowest terms (1/3). So 0.95, 19/20 and 95/100 all read
    `95/100`, the form SPEC section 10 shows."""
    q = Fraction(q)
    den = q.denominator
    twos = fives = 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    if den != 1:
        return f"{q.numerator}/{q.denominator}"
    scale = 10 ** max(twos, fives)
    return f"{q.numerator * scale // q.denominator}/{scale}"


def _as_float32(q: Fraction) -> np.float32:
    try:
        return np.float32(float(q)) if abs(q) < 2**128 else np.float32(np.inf)
    except OverflowError:
        return np.float32(np.inf)


def _show(q: Fraction) -> str:
    text = rational_text(q)
    return text if len(text) <= 64 else f"{float(q):.6g}" if abs(q) < 2**1000 else "(huge)"


SCHEDULES = ("constant", "cosine", "wsd")
MAX_SCHEDULE_TOTAL = 10_000_000  # the host table of a_t, b_t has total + 2 rows (SPEC 7)
RATIONAL_FIELDS = ("lr", "beta1", "beta2", "weight_decay", "epsilon", "floor")


@dataclass(frozen=True)
class Hyper:
    """The learner: AdamW hyperparameters (exact rationals), the learning-rate
    schedule and gradient clipping (SPEC section 7).

    schedule "constant" uses lr for every update; "cosine" warms up linearly
    over `warmup` updates, decays to `floor * lr` at update `total`, and stays
    there; "wsd" warms up the same way, holds lr, then decays linearly over
    the last `decay` updates to `floor * lr` at update `total`, and stays
    there. `clip` (None: off) bounds the gradient's L2 norm."""

    lr: Fraction = Fraction(3, 10000)
    beta1: Fraction = Fraction(9, 10)
    beta2: Fraction = Fraction(95, 100)
    weight_decay: Fraction = Fraction(1, 10)
    epsilon: Fraction = Fraction(1, 100000000)
    schedule: str = "constant"
    warmup: int = 0  # W, cosine and wsd only
    total: int | None = None  # N, cosine and wsd only (the run loop's default: the run's final step)
    floor: Fraction = Fraction(0)  # f in [0, 1], cosine and wsd only
    decay: int | None = None  # D in [1, N - W], wsd only
    clip: Fraction | None = None  # c > 0, or None
    accumulate: int = 1  # k micro-batches per step (SPEC 19); k must divide the batch

    def __post_init__(self):
        k = self.accumulate
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < 2**31:
            raise ConfigError(f"accumulate={k!r}: must be a positive integer")
        for name in RATIONAL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, Fraction):
                object.__setattr__(self, name, parse_rational(value, name))
        if self.clip is not None and not isinstance(self.clip, Fraction):
            object.__setattr__(self, "clip", parse_rational(self.clip, "clip"))
        self._check_schedule()
        if self.lr <= 0:
            raise ConfigError(f"lr={_show(self.lr)}: must be positive")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name}={_show(getattr(self, name))}: must be in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay={_show(self.weight_decay)}: must be >= 0")
        if self.epsilon <= 0:
            raise ConfigError(f"epsilon={_show(self.epsilon)}: must be positive")
        # Each coefficient enters float32 arithmetic (SPEC 7): it must be a
        # finite float32, and the ones the update divides or scales by must
        # not round to zero (or to one, for the betas: then c = 1 - beta^t = 0).
        coefficients = {
            "lr": (self.lr, True), "epsilon": (self.epsilon, True),
            "beta1": (self.beta1, False), "beta2": (self.beta2, False),
            "1 - beta1": (1 - self.beta1, True), "1 - beta2": (1 - self.beta2, True),
            "lr * weight_decay": (self.lr * self.weight_decay, False),
        }
        for name, (q, nonzero) in coefficients.items():
            x = _as_float32(q)
            if not np.isfinite(x):
                raise ConfigError(f"{name}={_show(q)}: does not fit in float32")
            if nonzero and x == 0:
                raise ConfigError(f"{name}={_show(q)}: rounds to zero in float32")
        for name in ("beta1", "beta2"):
            if float(getattr(self, name)) >= 1.0:
                raise ConfigError(f"{name}={_show(getattr(self, name))}: rounds to 1 in float64, "
                                  f"so the bias correction 1 - {name}^t would be 0")

        if self.clip is not None:
            if self.clip <= 0:
                raise ConfigError(f"clip={_show(self.clip)}: must be positive")
            x = _as_float32(self.clip)
            if not np.isfinite(x) or x == 0:
                raise ConfigError(f"clip={_show(self.clip)}: is not a nonzero finite float32")

    def _check_schedule(self):
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r}: must be one of {', '.join(SCHEDULES)}")
        if self.schedule == "constant":
            if self.warmup != 0 or self.total is not None or self.floor != 0:
                raise ConfigError("warmup, total and floor belong to the cosine and wsd "
                                  "schedules (add --schedule cosine or --schedule wsd)")
        if self.schedule != "wsd" and self.decay is not None:
            raise ConfigError(f"decay={self.decay!r}: belongs to the wsd schedule "
                              f"(add --schedule wsd)")
        if self.schedule == "constant":
            return
        for name in ("warmup", "total"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r}: must be an integer >= 0")
        if not self.warmup < self.total:
            raise ConfigError(f"total={self.total}: must exceed warmup={self.warmup}")
        if self.total > MAX_SCHEDULE_TOTAL:
            raise ConfigError(f"total={self.total}: at most {MAX_SCHEDULE_TOTAL} updates")
        if not 0 <= self.floor <= 1:
            raise ConfigError(f"floor={_show(self.floor)}: must be in [0, 1]")
        if self.schedule == "wsd":
            D, span = self.decay, self.total - self.warmup
            if isinstance(D, bool) or not isinstance(D, int) or not 1 <= D <= span:
                raise ConfigError(f"decay={D!r}: must be an integer in [1, total - warmup] "
                                  f"= [1, {span}]")

    def identity(self, precision: str) -> str:
        """The learner identity of SPEC section 10 (with SPEC 7's schedule and
        clipping parts, which the defaults leave out)."""
        check_precision(precision)
        text = (f"objective=next-token-cross-entropy|precision={precision}|optimizer=adamw"
                f"|lr={rational_text(self.lr)}|beta1={rational_text(self.beta1)}"
                f"|beta2={rational_text(self.beta2)}|weight_decay={rational_text(self.weight_decay)}"
                f"|epsilon={rational_text(self.epsilon)}|decay=matrices")
        if self.schedule == "cosine":
            text += (f"|schedule=cosine(warmup={self.warmup},total={self.total},"
                     f"floor={rational_text(self.floor)})")
        elif self.schedule == "wsd":
            text += (f"|schedule=wsd(warmup={self.warmup},total={self.total},"
                     f"decay={self.decay},floor={rational_text(self.floor)})")
        if self.clip is not None:
            text += f"|clip={rational_text(self.clip)}"
        if self.accumulate > 1:  # resume exactness needs the same k (SPEC 19)
            text += f"|accumulate={self.accumulate}"
        return text


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r}: must be one of {', '.join(PRECISIONS)}")
    return precision


def schema_identity(config: Config) -> str:
    return (f"coppelius-raw-pmv-f32-v1|parameter-order:p-then-m-then-v"
            f"|payload={12 * parameter_count(config)}")


def data_identity(config: Config, batch: int, tokenizer_sha: str | None, stream_sha: str,
                  heldout: int = 0, eval_sha: str | None = None) -> str:
    """SPEC 10; `|heldout=K` when the stream's last K contexts are held out
    for evaluation (SPEC 18), nothing when K = 0; `|eval=<sha256>` when a
    validation set of its own is evaluated (SPEC 22)."""
    return (f"coppelius-token-stream|vocabulary={config.vocab}|context={config.context}"
            f"|header=16|token=4|batch={batch}|tokenizer={tokenizer_sha or 'none'}"
            f"|stream={stream_sha}" + (f"|heldout={heldout}" if heldout else "")
            + (f"|eval={eval_sha}" if eval_sha else ""))


def initialization_identity(seed: int = SEED) -> str:
    return (f"coppelius-initialization:random-normal|generator=splitmix64-boxmuller"
            f"|seed={seed}")


def parameter_count(config: Config) -> int:
    """N of SPEC sections 2 and 21 from the configuration alone: the
    embedding (V, D); per layer two norms (D each, 2 D with a bias), q and o
    (D^2 each), k and v (Hkv E D each) with their biases where set, and gate,
    up, down (D F each); the final norm; lm_head (V D) when untied. Equal to
    registry(config).total (a test checks it), but computed without building
    the registry, so a file that claims a model of 10^8 layers is sized, and
    refused, in no time."""
    V, D, F, L, KV = config.vocab, config.d_model, config.d_ff, config.n_layer, config.kv_dim
    norm = 2 * D if config.norm_bias else D
    attention = 2 * D * D + 2 * KV * D + (D + 2 * KV if config.qkv_bias else 0)
    head = 0 if config.tied else V * D
    return V * D + L * (2 * norm + attention + 3 * D * F) + norm + head


def tensor_count(config: Config) -> int:
    """How many named tensors the registry lists (aliases not counted): per
    layer two norms, four attention products (and three biases where set)
    and three MLP products; the embedding, the final norm, lm_head when
    untied."""
    norm = 2 if config.norm_bias else 1
    layer = 2 * norm + 4 + (3 if config.qkv_bias else 0) + 3
    return layer * config.n_layer + 1 + norm + (0 if config.tied else 1)


# ---------------------------------------------------------------- identities read back
# A file's identity strings are parsed back and must rebuild to themselves:
# an identity this version did not write (empty, reordered, a value spelled
# another way) is refused rather than half understood.

def identity_fields(identity) -> dict:
    """'a=1|b=2|flag' -> {'a': '1', 'b': '2'}; parts without '=' are dropped."""
    return dict(part.split("=", 1) for part in str(identity).split("|") if "=" in part)


def _count_text(text, least: int = 0) -> int | None:
    """A canonical decimal integer >= least (no sign, no leading zero), else None."""
    if not isinstance(text, str) or not text.isdigit() or not text.isascii() or \
            (len(text) > 1 and text[0] == "0") or len(text) > 40:
        return None
    value = int(text)
    return value if value >= least else None


def data_from_identity(data, config: Config, where: str) -> dict:
    """A data identity (SPEC 10) of a model -> {batch, tokenizer, stream}
    (tokenizer None for `none`; stream a digest, or "none" for an imported
    checkpoint that names no stream). The batch is a positive integer."""
    f = identity_fields(data)
    batch = _count_text(f.get("batch"), least=1)
    tokenizer = f.get("tokenizer")
    stream = f.get("stream")
    heldout = _count_text(f.get("heldout"), least=1) if "heldout" in f else 0  # SPEC 18
    eval_sha = f.get("eval")  # SPEC 22
    ok = (batch is not None and heldout is not None and isinstance(tokenizer, str)
          and isinstance(stream, str)
          and (tokenizer == "none" or _is_sha256(tokenizer))
          and (stream == "none" or _is_sha256(stream))
          and (eval_sha is None or _is_sha256(eval_sha))
          and data_identity(config, batch, None if tokenizer == "none" else tokenizer,
                            stream, heldout, eval_sha) == data)
    if not ok:
        raise ConfigError(f"{where}: data identity {data!r} is not one this version writes "
                          f"for this model (vocabulary={config.vocab}, context={config.context}, "
                          f"a positive batch)")
    return {"batch": batch, "tokenizer": None if tokenizer == "none" else tokenizer,
            "stream": stream, "heldout": heldout}


def seed_from_identity(initialization, where: str) -> int:
    """An initialization identity (SPEC 10) -> its seed, in [0, 2^64)."""
    seed = _count_text(identity_fields(initialization).get("seed"))
    if seed is None or seed >= 2**64 or initialization_identity(seed) != initialization:
        raise ConfigError(f"{where}: initialization identity {initialization!r} is not one this "
                          f"version writes")
    return seed


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)
