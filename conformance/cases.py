"""Inputs of the conformance checks: the presets checked by default, token
windows, random states and the hypothesis strategies that draw small
configurations (every member of the model family, SPEC 21).

Fixed cases: the preset's fresh initialization (SPEC section 2) and token
windows drawn from `numpy.random.default_rng(TOKEN_SEED)` as one
(steps, B, T+1) array of ids uniform in [0, V), step s using window s.
Uniform ids touch most embedding rows, so every row's gradient is checked.
Or a real token stream: step s reads contexts c0 + s*B + b (SPEC section 9).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from ..reference.config import SEED, Config
from ..reference.params import initialize, registry
from ..reference.state import State

TOKEN_SEED = 20260925  # the project seed (SPEC section 1), reused for the token windows

# What the suite checks when no preset or model file is named: the defaults'
# model and a preset per family of SPEC 21, all of the test size (a few
# seconds each on a CPU).
PRESETS = ("test", "test-llama", "test-qwen", "test-stablelm")


def random_windows(config: Config, batch: int, steps: int, seed: int = TOKEN_SEED) -> np.ndarray:
    """(steps, B, T+1) int64 ids, uniform in [0, V)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab, size=(steps, batch, config.context + 1), dtype=np.int64)


def stream_windows(stream, config: Config, batch: int, steps: int, c0: int = 0) -> np.ndarray:
    """(steps, B, T+1) ids of contexts c0 + s*B + b of a token stream."""
    return np.stack([np.asarray(stream.batch(c0 + s * batch, batch, config.context), dtype=np.int64)
                     for s in range(steps)])


def fresh_state(config: Config, seed: int = SEED) -> State:
    return State.fresh(initialize(config, seed))


def random_state(config: Config, seed: int, scale: float = 1.0, t: int | None = None) -> State:
    """A state somewhere in the middle of a run: the initialization moved by
    noise (so norm weights are not exactly ones and biases not zeros), first
    moments of either sign, second moments positive, and an update count t.

    `scale` multiplies the parameter noise (0 keeps the initialization)."""
    rng = np.random.default_rng(seed)
    reg = registry(config)
    P = initialize(config, seed=seed % 2**63)
    P += (scale * 0.02 * rng.standard_normal(reg.total)).astype(np.float32)
    M = (1e-3 * rng.standard_normal(reg.total)).astype(np.float32)
    V = (1e-6 * rng.random(reg.total) + 1e-7 * rng.standard_normal(reg.total) ** 2).astype(np.float32)
    if t is None:
        t = int(rng.integers(0, 10_000))
    return State(P=P.astype(np.float32), M=M, V=V, t=t)


# ------------------------------------------------------------------ hypothesis
# Imported lazily: hypothesis is a test dependency, the suite runs without it.

def strategies():
    """(configs, cases) hypothesis strategies.

    configs(): a valid small Config (D % H == 0, E even) of any member of
        the family (SPEC 21): either norm, grouped heads (n_kv_head dividing
        n_head), tied or not, a rotated part R = rotary * E of any even size,
        q/k/v biases or not, and other epsilons and rope bases.
    cases(precisions): (config, batch, tokens (B, T+1), state, precision)."""
    from hypothesis import strategies as st

    @st.composite
    def configs(draw):
        H = draw(st.integers(1, 3))
        # head dim, even for the rope pairs; d_model >= 8, because with fewer
        # features layernorm's gradient is nearly all cancellation and any two
        # float32 implementations differ by ~1e-4 from each other
        E = draw(st.sampled_from([4, 6, 8]) if H > 1 else st.just(8))
        # each draw shrinks to the field's default, so a minimal failing case
        # keeps only the fields it needs: R to E, the divisors from H down
        R = E - 2 * draw(st.integers(0, E // 2 - 1))  # the rotated elements of a head, even
        return Config(vocab=draw(st.integers(2, 40)), context=draw(st.integers(1, 9)),
                      d_model=H * E, n_layer=draw(st.integers(1, 2)), n_head=H,
                      d_ff=draw(st.integers(1, 20)),
                      norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
                      norm_eps=draw(st.sampled_from([Fraction(1, 100000), Fraction(1, 1000000)])),
                      n_kv_head=draw(st.sampled_from([d for d in range(H, 0, -1) if H % d == 0])),
                      tied=not draw(st.booleans()),
                      rope_base=draw(st.sampled_from([Fraction(10000), Fraction(500000)])),
                      rotary=Fraction(R, E), qkv_bias=draw(st.booleans()))

    @st.composite
    def cases(draw, precisions=("fp32",)):
        config = draw(configs())
        batch = draw(st.integers(1, 2))
        seed = draw(st.integers(0, 2**32 - 1))
        fresh = draw(st.booleans())
        if fresh:
            state = fresh_state(config, seed=seed)
        else:
            state = random_state(config, seed, scale=draw(st.sampled_from([0.0, 1.0, 10.0])))
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, config.vocab, size=(batch, config.context + 1), dtype=np.int64)
        if (tokens == tokens.flat[0]).all():
            # one id everywhere makes every v row equal, so the exact q and k
            # gradients are zero and their relative error is rounding noise / 0
            tokens.flat[0] = (tokens.flat[0] + 1) % config.vocab
        precision = draw(st.sampled_from(list(precisions)))
        return config, batch, tokens, state, precision

    return configs, cases
