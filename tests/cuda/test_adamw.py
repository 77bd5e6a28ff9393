"""The AdamW family (accelerated/cuda/adamw.py, kernels/adamw.cu, SPEC 7):
the bias corrections, the norm and clip scale, the update and the
gradient sum, bitwise against the reference."""

import numpy as np
import pytest

from coppelius.reference.adamw import (AdamWConstants, adamw_update, bias_corrections,
                                       learning_rates, schedule_table)
from coppelius.reference.config import Hyper
from coppelius.reference.params import registry
from coppelius.reference.precision import round_bf16
from coppelius.accelerated.cuda.adamw import adamw_blocks, NORM_BLOCKS
from coppelius.accelerated.cuda.buffers import gradient_segments

from .helpers import (CONFIG, PRECISIONS, kernels, dev, host, empty, placed, as_float,
                      check_bitwise, gradient)

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


# ------------------------------------------------------------------ AdamW

def test_bias_corrections_bitwise_for_t_up_to_10000():
    hyper = Hyper()
    ts = np.arange(1, 10001, dtype=np.int32)
    c1, c2 = empty((ts.size,)), empty((ts.size,))
    k = kernels()
    k.adamw_bias_corrections_table(dev(ts), c1, c2, float(hyper.beta1), float(hyper.beta2))
    want = np.array([bias_corrections(hyper, int(t)) for t in ts], dtype=np.float32)
    check_bitwise("c1", host(c1), want[:, 0])
    check_bitwise("c2", host(c2), want[:, 1])
    # the in-graph kernel: advances t on the device, then its c1, c2 and the
    # schedule's a_t, b_t from the host table (row min(t, R - 1))
    cosine = Hyper(schedule="cosine", warmup=3, total=50, floor="1/10")
    for h in (hyper, cosine):
        rates = dev(schedule_table(h))
        for t0 in (0, 1, 2, 41, 49, 50, 9999):
            t, c = dev(np.array([t0], np.int32)), empty((4,))
            k.adamw_bias_corrections(t, c, float(h.beta1), float(h.beta2), rates)
            assert int(host(t)[0]) == t0 + 1
            want = [*bias_corrections(h, t0 + 1), *learning_rates(h, t0 + 1)]
            check_bitwise(f"c at t={t0 + 1}", host(c), np.array(want, np.float32))


def cuts_of(n, kind):
    """Where G is cut into segments: none (flat); at multiples of 4 (the
    16-byte path, bitwise the flat pass); one element past them (one element
    at a time)."""
    if kind == "flat" or n < 16:
        return ()
    cuts = sorted({4 * (n // 12), 4 * (n // 8), 4 * (n // 5)})
    return tuple(c + 1 for c in cuts) if kind == "odd" else tuple(cuts)


@pytest.mark.parametrize("n", [1, 1000, 100_003, 3_000_001])
def test_gradient_norm_and_clip_scale(n):
    """||G|| against the float64 norm (float32 partial sums: a relative error
    of a few 1e-7), bit-reproducible, and the clip scale c / n; G flat or in
    segments (the 16-byte pass over segments cut at multiples of 4 gives the
    flat pass's bits)."""
    G = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    want = float(np.sqrt(np.sum(G.astype(np.float64) ** 2)))
    k = kernels()
    partial, norm = empty((NORM_BLOCKS,)), empty((2,))
    norms = {}
    for kind in ("flat", "segments", "odd"):
        runs = []
        for clip in (0.0, want / 3, want * 2):
            k.gradient_norm(gradient(G, cuts_of(n, kind)), partial, norm, clip)
            got = host(norm)
            runs.append(got[0])
            assert abs(got[0] - want) <= 1e-6 * want, (kind, got[0], want)
            scale = np.float32(np.float32(clip) / got[0]) if 0 < clip < got[0] else np.float32(1)
            check_bitwise(f"scale at clip {clip}", got[1:], np.array([scale]))
        check_bitwise(f"norm, three runs ({kind})", np.array(runs[1:]), np.array(runs[:2]))
        norms[kind] = runs[0]
    check_bitwise("norm over segments", np.array([norms["segments"]]), np.array([norms["flat"]]))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("n, aligned, cuts", [(100_003, True, "segments"), (100_003, True, "odd"),
                                              (1_001, False, "flat"), (3, True, "flat")])
def test_adamw_update_bitwise(precision, n, aligned, cuts):
    """The same float32 operations as reference.adamw.adamw_update: 16-byte
    chunks then the n % 4 elements left, or (misaligned, or G's segments
    cut off the chunks) one at a time; G flat or in segments."""
    rng = np.random.default_rng(7)
    t = 17
    hyper = Hyper(lr="1/1000", weight_decay="3/10")
    P = rng.standard_normal(n).astype(np.float32)
    M = (1e-3 * rng.standard_normal(n)).astype(np.float32)
    V = (1e-5 * rng.random(n)).astype(np.float32)
    G = (1e-2 * rng.standard_normal(n)).astype(np.float32)
    # runs of 1 to 9 elements, decayed or not: boundaries inside 16-byte chunks
    decay = np.repeat(rng.random(n) < 0.5, rng.integers(1, 10, n))[:n]
    want = adamw_update(P, M, V, G, decay, hyper, t)
    dP, dM, dV = placed(P, aligned), dev(M), dev(V)
    Pb = empty((n,), np.uint16) if precision == "bf16" else None
    c = dev(np.array([*bias_corrections(hyper, t), *learning_rates(hyper, t)], np.float32))
    unclipped = dev(np.array([0.0, 1.0], np.float32))  # (norm, scale): scale 1 leaves G's bits
    kernels(precision).adamw_update(dP, dM, dV, gradient(G, cuts_of(n, cuts), aligned),
                                    dev(runs_of(decay)), Pb, c, unclipped,
                                    AdamWConstants.of(hyper))
    for name, got, w in zip("PMV", (dP, dM, dV), want):
        check_bitwise(name, host(got), w)
    if Pb is not None:
        check_bitwise("Pb", as_float(Pb, "bf16"), round_bf16(want[0]))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("n, aligned", [(3_000_001, True), (100_003, False), (3, True)])
def test_adamw_update_sums_the_norm_when_clipping_is_off(precision, n, aligned):
    """With `partial` (clipping off) AdamW's pass also sums G's squares:
    P, M, V and Pb bitwise those of the kernel given scale 1, and the norm
    finished from the partials within float32 summation of the float64
    norm, the same bits run after run; the norm buffer is not read (NaN).
    G in segments."""
    rng = np.random.default_rng(n)
    hyper = Hyper(lr="1/1000", weight_decay="3/10")
    P = rng.standard_normal(n).astype(np.float32)
    M = (1e-3 * rng.standard_normal(n)).astype(np.float32)
    V = (1e-5 * rng.random(n)).astype(np.float32)
    G = (1e-2 * rng.standard_normal(n)).astype(np.float32)
    decay = dev(runs_of(rng.random(n) < 0.5))
    c = dev(np.array([*bias_corrections(hyper, 3), *learning_rates(hyper, 3)], np.float32))
    k, consts = kernels(precision), AdamWConstants.of(hyper)
    want = []
    for fused in (False, True, True):
        dP, dM, dV = placed(P, aligned), dev(M), dev(V)
        Pb = empty((n,), np.uint16) if precision == "bf16" else None
        norm = dev(np.array([0.0, 1.0 if not fused else np.nan], np.float32))
        partial = empty((adamw_blocks(n),)) if fused else None
        G_dev = gradient(G, cuts_of(n, "segments" if aligned else "odd"))
        blocks = k.adamw_update(dP, dM, dV, G_dev, decay, Pb, c, norm, consts, partial=partial)
        got = [host(dP), host(dM), host(dV)] + ([as_float(Pb, "bf16")] if Pb is not None else [])
        if not fused:
            want = got
            continue
        for name, a, b in zip(["P", "M", "V", "Pb"], got, want):
            check_bitwise(name, a, b)
        k.gradient_norm_finish(partial, blocks, norm)
        n64 = float(np.sqrt(np.sum(G.astype(np.float64) ** 2)))
        got_norm = host(norm)
        assert abs(got_norm[0] - n64) <= 2e-6 * n64 and got_norm[1] == 1.0, (got_norm, n64)
        want.append(got_norm)
    check_bitwise("norm, twice", want[-1], want[-2])


def runs_of(mask):
    """(R, 2) int64 [start, end) of the runs of True in mask, as the kernel takes them."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return edges.reshape(-1, 2).astype(np.int64)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("decayed", ["none", "all", "registry"])
def test_adamw_update_decay_runs(precision, decayed):
    """No run, one run over everything, and the registry's own runs of the
    test preset (the step's), against the reference's update with the mask;
    G in the step's segments."""
    reg = registry(CONFIG)
    n = reg.total
    mask = {"none": np.zeros(n, bool), "all": np.ones(n, bool),
            "registry": reg.decay_mask()}[decayed]
    ranges = reg.decay_ranges() if decayed == "registry" else runs_of(mask)
    rng = np.random.default_rng(8)
    hyper = Hyper(lr="1/100", weight_decay="1/2")
    P, G = rng.standard_normal((2, n)).astype(np.float32)
    M, V = np.zeros(n, np.float32), np.zeros(n, np.float32)
    want = adamw_update(P, M, V, G, mask, hyper, 1)
    dP, dM, dV = dev(P), dev(M), dev(V)
    c = dev(np.array([*bias_corrections(hyper, 1), *learning_rates(hyper, 1)], np.float32))
    cuts = [start for start, _ in gradient_segments(CONFIG)][1:]
    kernels(precision).adamw_update(dP, dM, dV, gradient(G, cuts), dev(ranges.reshape(-1, 2)),
                                    empty((n,), np.uint16) if precision == "bf16" else None, c,
                                    dev(np.array([0.0, 1.0], np.float32)),
                                    AdamWConstants.of(hyper))
    for name, got, w in zip("PMV", (dP, dM, dV), want):
        check_bitwise(name, host(got), w)


@pytest.mark.parametrize("n, aligned", [(100_003, True), (1_001, False), (2, True)])
def test_accumulate_gradient_bitwise(n, aligned):
    """G += Gm: one float32 add per element (SPEC 19)."""
    rng = np.random.default_rng(n)
    G, Gm = rng.standard_normal((2, n)).astype(np.float32)
    dG = placed(G, aligned)
    kernels().accumulate_gradient(dG, dev(Gm))
    check_bitwise("G", host(dG), G + Gm)
