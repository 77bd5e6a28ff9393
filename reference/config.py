"""Model configuration (SPEC section 1) and the learner's hyperparameters
(SPEC section 7), with the identity strings of SPEC section 10.

Dimension vocabulary used throughout the project:
    B batch, T context, D d_model, H n_head, E head dim (D/H), F d_ff,
    V vocab, L n_layer.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .errors import ConfigError

LAYERNORM_EPS = Fraction(1, 100000)
ROPE_BASE = 10000
SEED = 20260925
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Config:
    """A model shape. Validated on construction; the error names the field."""

    vocab: int  # V
    context: int  # T
    d_model: int  # D
    n_layer: int  # L
    n_head: int  # H
    d_ff: int  # F
    steps: int = 8  # default steps of one invocation (run policy, not model)
    interval: int = 4  # default checkpoint interval (run policy, not model)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {field.name}={value!r}: must be a positive integer")
        if self.d_model % self.n_head != 0:
            raise ConfigError(
                f"config field n_head={self.n_head}: must divide d_model={self.d_model}")
        if self.head_dim % 2 != 0:
            raise ConfigError(
                f"config field n_head={self.n_head}: head dim d_model/n_head={self.head_dim} must be even")

    @property
    def head_dim(self) -> int:  # E
        return self.d_model // self.n_head

    def identity(self) -> str:
        """The model identity of SPEC section 10."""
        return (f"vocab={self.vocab}|context={self.context}|d_model={self.d_model}"
                f"|n_layer={self.n_layer}|n_head={self.n_head}|d_ff={self.d_ff}"
                f"|norm=layernorm|eps={rational_text(LAYERNORM_EPS)}|rope_base={ROPE_BASE}|tied=1")


PRESETS = {
    "coppelius": Config(vocab=12288, context=1024, d_model=512, n_layer=16, n_head=8,
                        d_ff=1408, steps=10000, interval=1000),
    "tiny": Config(vocab=2048, context=256, d_model=128, n_layer=4, n_head=4, d_ff=352,
                   steps=1000, interval=250),
    "test": Config(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96,
                   steps=8, interval=4),
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


MODEL_FIELDS = ("vocab", "context", "d_model", "n_layer", "n_head", "d_ff")


def config_from_identity(model: str, where: str = "checkpoint") -> Config:
    """The Config whose model identity (SPEC 10) is exactly `model`: a preset
    when one matches (for its steps and interval). Anything this version does
    not implement (another norm, a missing field) is refused, naming `where`."""
    for config in PRESETS.values():
        if config.identity() == model:
            return config
    fields = dict(part.partition("=")[::2] for part in str(model).split("|"))
    try:
        config = Config(**{k: int(fields[k]) for k in MODEL_FIELDS})
    except (KeyError, ValueError, ConfigError):
        config = None
    if config is None or config.identity() != model:
        raise ConfigError(f"{where}: model identity {model!r} is not one this version implements")
    return config


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


@dataclass(frozen=True)
class Hyper:
    """AdamW hyperparameters, exact rationals (SPEC section 7)."""

    lr: Fraction = Fraction(3, 10000)
    beta1: Fraction = Fraction(9, 10)
    beta2: Fraction = Fraction(95, 100)
    weight_decay: Fraction = Fraction(1, 10)
    epsilon: Fraction = Fraction(1, 100000000)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, Fraction):
                object.__setattr__(self, field.name, parse_rational(value, field.name))
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr}: must be positive")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay={self.weight_decay}: must be >= 0")
        if self.epsilon <= 0:
            raise ConfigError(f"epsilon={self.epsilon}: must be positive")
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

    def identity(self, precision: str) -> str:
        """The learner identity of SPEC section 10."""
        check_precision(precision)
        return (f"objective=next-token-cross-entropy|precision={precision}|optimizer=adamw"
                f"|lr={rational_text(self.lr)}|beta1={rational_text(self.beta1)}"
                f"|beta2={rational_text(self.beta2)}|weight_decay={rational_text(self.weight_decay)}"
                f"|epsilon={rational_text(self.epsilon)}|decay=matrices")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r}: must be one of {', '.join(PRECISIONS)}")
    return precision


def schema_identity(config: Config) -> str:
    return (f"coppelius-raw-pmv-f32-v1|parameter-order:p-then-m-then-v"
            f"|payload={12 * parameter_count(config)}")


def data_identity(config: Config, batch: int, tokenizer_sha: str | None, stream_sha: str) -> str:
    return (f"coppelius-token-stream|vocabulary={config.vocab}|context={config.context}"
            f"|header=16|token=4|batch={batch}|tokenizer={tokenizer_sha or 'none'}"
            f"|stream={stream_sha}")


def initialization_identity(seed: int = SEED) -> str:
    return (f"coppelius-initialization:random-normal|generator=splitmix64-boxmuller"
            f"|seed={seed}")


def parameter_count(config: Config) -> int:
    """N of SPEC section 2 from the shape alone: the embedding (V, D); per
    layer two norms (2 D each), q, k, v, o (D^2 each) and gate, up, down
    (D F each); the final norm (2 D). Equal to registry(config).total (a test
    checks it), but computed without building the registry, so a file that
    claims a model of 10^8 layers is sized, and refused, in no time."""
    V, D, F, L = config.vocab, config.d_model, config.d_ff, config.n_layer
    return V * D + L * (4 * D + 4 * D * D + 3 * D * F) + 2 * D


def tensor_count(config: Config) -> int:
    """How many named tensors the registry lists: 11 per layer, 3 more."""
    return 11 * config.n_layer + 3


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


def learner_from_identity(learner, where: str) -> tuple:
    """A learner identity (SPEC 10) -> (Hyper, precision)."""
    f = identity_fields(learner)
    try:
        hyper = Hyper(**{k: parse_rational(f[k], k)
                         for k in ("lr", "beta1", "beta2", "weight_decay", "epsilon")})
        precision = f["precision"]
        ok = precision in PRECISIONS and hyper.identity(precision) == learner
    except (KeyError, ConfigError):
        ok = False
    if not ok:
        raise ConfigError(f"{where}: learner identity {learner!r} is not one this version writes")
    return hyper, precision


def data_from_identity(data, config: Config, where: str) -> dict:
    """A data identity (SPEC 10) of a model -> {batch, tokenizer, stream}
    (tokenizer None for `none`; stream a digest, or "none" for an imported
    checkpoint that names no stream). The batch is a positive integer."""
    f = identity_fields(data)
    batch = _count_text(f.get("batch"), least=1)
    tokenizer = f.get("tokenizer")
    stream = f.get("stream")
    ok = (batch is not None and isinstance(tokenizer, str) and isinstance(stream, str)
          and (tokenizer == "none" or _is_sha256(tokenizer))
          and (stream == "none" or _is_sha256(stream))
          and data_identity(config, batch, None if tokenizer == "none" else tokenizer,
                            stream) == data)
    if not ok:
        raise ConfigError(f"{where}: data identity {data!r} is not one this version writes "
                          f"for this model (vocabulary={config.vocab}, context={config.context}, "
                          f"a positive batch)")
    return {"batch": batch, "tokenizer": None if tokenizer == "none" else tokenizer,
            "stream": stream}


def seed_from_identity(initialization, where: str) -> int:
    """An initialization identity (SPEC 10) -> its seed, in [0, 2^64)."""
    seed = _count_text(identity_fields(initialization).get("seed"))
    if seed is None or seed >= 2**64 or initialization_identity(seed) != initialization:
        raise ConfigError(f"{where}: initialization identity {initialization!r} is not one this "
                          f"version writes")
    return seed


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)
