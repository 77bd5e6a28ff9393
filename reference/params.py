"""The one parameter registry (SPEC section 2) and the initialization
generator.

Everything that iterates over parameters (the model, every backend, the
checkpoint, the binding, the tests) iterates over `registry(config).specs`.
A parameter is a named view into the flat float32 vector; offsets are in
elements.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .config import SEED, Config

TIED = {"lm_head.weight": "tok_embedding.weight"}  # the tied unembedding: an alias, no storage


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple
    offset: int  # in elements, into the flat parameter vector
    ordinal: int  # k of the initialization generator
    init: str  # "normal", "ones" or "zeros"
    std: float  # for "normal"; 0.0 otherwise

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def decay(self) -> bool:
        """Weight decay applies to two-dimensional parameters only (SPEC 7)."""
        return len(self.shape) == 2

    @property
    def slice(self) -> slice:
        return slice(self.offset, self.offset + self.size)


class Registry:
    """Names, shapes, offsets, decay and aliases of one configuration."""

    def __init__(self, config: Config):
        table = declare(config)
        self.config = config
        self.specs: list[ParamSpec] = []
        offset = 0
        for ordinal, (name, shape, init, std) in enumerate(table):
            spec = ParamSpec(name, shape, offset, ordinal, init, std)
            self.specs.append(spec)
            offset += spec.size
        self.total = offset
        self.by_name = {spec.name: spec for spec in self.specs}
        self.aliases = dict(TIED) if config.tied else {}

    def __iter__(self):
        return iter(self.specs)

    def __getitem__(self, name: str) -> ParamSpec:
        return self.by_name[self.aliases.get(name, name)]

    def views(self, flat: np.ndarray) -> dict:
        """name -> view of `flat` with the parameter's shape (no copy).
        Aliases are included and share their owner's view."""
        out = {s.name: flat[s.slice].reshape(s.shape) for s in self.specs}
        for alias, owner in self.aliases.items():
            out[alias] = out[owner]
        return out

    def decay_mask(self) -> np.ndarray:
        """(total,) bool: True where weight decay applies."""
        mask = np.zeros(self.total, dtype=bool)
        for s in self.specs:
            if s.decay:
                mask[s.slice] = True
        return mask

    def decay_ranges(self) -> np.ndarray:
        """(R, 2) int64: the decayed elements as R sorted, disjoint [start,
        end) runs, each as long as it can be (adjacent decayed parameters
        form one run): at most one per parameter, the mask in a few bytes."""
        runs = []
        for s in self.specs:
            if not s.decay:
                continue
            if runs and runs[-1][1] == s.offset:
                runs[-1][1] = s.offset + s.size
            else:
                runs.append([s.offset, s.offset + s.size])
        return np.array(runs, dtype=np.int64).reshape(-1, 2)

    def describe(self) -> list:
        """[{name, shape, offset}] in canonical order (the checkpoint header)."""
        return [{"name": s.name, "shape": list(s.shape), "offset": s.offset} for s in self.specs]


def declare(config: Config) -> list:
    """[(name, shape, init, std)] of every parameter in the canonical order
    of SPEC 2 and 21, from the configuration: the one place the model's
    parameters are listed. A norm has a bias where it is a layernorm; k and
    v are (Hkv E, D); q, k, v have biases right after their weights where
    qkv_bias is set; an untied model ends with lm_head.weight."""
    V, D, F, L = config.vocab, config.d_model, config.d_ff, config.n_layer
    KV = config.kv_dim  # Hkv * E
    small = 0.02 / math.sqrt(2 * L)  # residual projections; sqrt in float64

    def norm(name):
        bias = [(name + ".bias", (D,), "zeros", 0.0)] if config.norm_bias else []
        return [(name + ".weight", (D,), "ones", 0.0)] + bias

    def product(name, rows, cols, std, bias=False):
        bias = [(name + ".bias", (rows,), "zeros", 0.0)] if bias else []
        return [(name + ".weight", (rows, cols), "normal", std)] + bias

    table = [("tok_embedding.weight", (V, D), "normal", 0.02)]
    for l in range(L):
        p = f"layers.{l}."
        table += (norm(p + "attn_norm")
                  + product(p + "attn.q", D, D, 0.02, config.qkv_bias)
                  + product(p + "attn.k", KV, D, 0.02, config.qkv_bias)
                  + product(p + "attn.v", KV, D, 0.02, config.qkv_bias)
                  + product(p + "attn.o", D, D, small)
                  + norm(p + "mlp_norm")
                  + product(p + "mlp.gate", F, D, 0.02)
                  + product(p + "mlp.up", F, D, 0.02)
                  + product(p + "mlp.down", D, F, small))
    table += norm("final_norm")
    if not config.tied:
        table += product("lm_head", V, D, 0.02)
    return table


@functools.lru_cache(maxsize=None)
def registry(config: Config) -> Registry:
    return Registry(config)


# ---------------------------------------------------------------- initialization
# splitmix64 + Box-Muller, SPEC section 2. All integer arithmetic modulo 2^64:
# NumPy uint64 arrays wrap on overflow, which is exactly that.
GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def mix_keys(seed: int, count: int) -> np.ndarray:
    """(count,) uint64: key_k = mix(seed + (k + 1) * GAMMA) for k in [0, count),
    modulo 2^64. SPEC 2 keys parameter k's stream with it; SPEC 8 orders the
    documents of a source by it."""
    with np.errstate(over="ignore"):
        k1 = np.arange(1, count + 1, dtype=np.uint64)  # k + 1
        return _mix(np.uint64(seed % 2**64) + k1 * GAMMA)


def normal_values(seed: int, ordinal: int, start: int, count: int) -> np.ndarray:
    """Standard normal z (float64) of elements [start, start+count) of parameter `ordinal`."""
    key = mix_keys(seed, ordinal + 1)[ordinal]
    with np.errstate(over="ignore"):
        i1 = np.arange(start + 1, start + count + 1, dtype=np.uint64)  # i + 1
        r = _mix(key + i1 * GAMMA)
    u1 = ((r >> np.uint64(40)).astype(np.float64) + 0.5) / 2.0**24
    u2 = ((r & np.uint64(0xFFFFFF)).astype(np.float64) + 0.5) / 2.0**24
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def initialize(config: Config, seed: int = SEED) -> np.ndarray:
    """The fresh parameter vector P, (total,) float32, bit-identical everywhere."""
    reg = registry(config)
    flat = np.empty(reg.total, dtype=np.float32)
    chunk = 1 << 22  # bounded temporaries for the 57.7M-element preset
    for spec in reg:
        out = flat[spec.slice]
        if spec.init == "ones":
            out[...] = 1.0
        elif spec.init == "zeros":
            out[...] = 0.0
        else:
            for start in range(0, spec.size, chunk):
                n = min(chunk, spec.size - start)
                z = normal_values(seed, spec.ordinal, start, n)
                out[start:start + n] = (spec.std * z).astype(np.float32)  # round to nearest
    return flat
