"""The product kernel of the project's own (accelerated/cuda/gemm.py and
kernels/gemm_sm90.cu) without a GPU: the host's arithmetic (tensor-map
geometry, the shapes taken, the tiles and the grid) against brute-force
counts, each variant's shared memory within Hopper's limit, the variants'
table against the source's instantiations, and, where NVIDIA's NVRTC is
installed, the source compiled for sm_90a with the wgmma instructions
kept (and, with cuobjdump, the ping-pong kernels' barrier arrivals where
they belong). The kernels themselves run in tests/cuda/test_gemm_sm90.py (on an
H100/H200) and dev/cuda/gemm_check.py."""

import importlib.util
import os
import re

import pytest
from hypothesis import given, settings, strategies as st

from coppelius.accelerated.cuda import gemm

SHARED_LIMIT = 227 * 1024  # a Hopper block's dynamic shared memory at most


def test_every_variant_fits_a_hopper_multiprocessor():
    for name, v in gemm.VARIANTS.items():
        # a slab of A's bm rows and B's bn (again: dres's and h's bm rows, W_gu's 2 bn
        # gate and up rows, W_down's bn columns), 64 K-columns of bfloat16
        stage = ((2 * v.bm + 3 * v.bn) if v.again else (v.bm + v.bn)) * gemm.BK * 2
        assert gemm.shared_bytes(v) >= v.stages * stage + 1024, name
        assert gemm.shared_bytes(v) <= SHARED_LIMIT, (name, gemm.shared_bytes(v))
        # at most 128 float32 accumulators a thread, or again's 192 (g | u and da);
        # what 232 registers hold without spills (the compile test below)
        accumulators = v.mt * (3 if v.again else 1) * v.bn // 2
        assert accumulators <= (192 if v.again else 128), name


def test_the_variants_are_the_sources_instantiations():
    with open(f"{gemm.KERNEL_DIR}/gemm_sm90.cu", encoding="utf-8") as f:
        source = f.read()
    found = {}
    for macro, name, mt, bn, stages, epi, pingpong in re.findall(
            r"^(GEMM_KERNEL(?:_PAIR)?)\((\w+), (\d+), (\d+), (\d+), EPI_(\w+), (true|false)\)",
            source, re.M):
        found[name] = gemm.Variant(int(mt), int(bn), int(stages), epi.lower(),
                                   pingpong == "true", 2 if macro.endswith("PAIR") else 1)
    for name, mt, bn, stages, epi, pingpong, ta in re.findall(
            r"^GEMM_KERNEL_T\((\w+), (\d+), (\d+), (\d+), EPI_(\w+), (true|false), (true|false)\)",
            source, re.M):
        found[name] = gemm.Variant(int(mt), int(bn), int(stages), epi.lower(),
                                   pingpong == "true", layout="mn" if ta == "true" else "kn")
    for name, mt, bn, stages, pingpong in re.findall(
            r"^GEMM_KERNEL_SPLIT\((\w+), (\d+), (\d+), (\d+), (true|false)\)", source, re.M):
        found[name] = gemm.Variant(int(mt), int(bn), int(stages), "f32_tma", pingpong == "true",
                                   layout="mn", split=True)
    for name, mt, bn, stages, buffers in re.findall(
            r"^GEMM_KERNEL_AGAIN\((\w+), (\d+), (\d+), (\d+), (\d+)\)", source, re.M):
        found[name] = gemm.Variant(int(mt), int(bn), int(stages), "dswiglu_again", True,
                                   layout="kn", buffers=int(buffers))
    for name, mt, bn, stages, pingpong, R in re.findall(
            r"^GEMM_KERNEL_ROPE\((\w+), (\d+), (\d+), (\d+), (true|false), (\d+)\)", source, re.M):
        found[name] = gemm.Variant(int(mt), int(bn), int(stages), "rope", pingpong == "true",
                                   rope=int(R))
    assert found == gemm.VARIANTS
    # the epilogues staged through shared memory: the kernel's list is gemm.py's
    # (shared_bytes places the barriers after their staging buffers)
    # (and dswiglu_again's kernel of its own, always staged)
    staged = re.search(r"constexpr bool STAGED = ([^;]*);", source).group(1)
    assert sorted([e.lower() for e in re.findall(r"EPI_(\w+)", staged)] + ["dswiglu_again"]) \
        == sorted(gemm.STAGED)


def test_the_rope_arguments_are_checked():
    v = gemm.VARIANTS["gemm_rope64_c_n128_s6"]
    good = gemm.Rope(out=1 << 20, ld=1536, cos=1 << 21, sin=1 << 22, T=1024, rotated=16)
    gemm.check_rope(v, 1536, good)
    gemm.check_rope(gemm.VARIANTS["gemm_f32t_c_n128_s6"], 1536, None)
    for N, rope in ((1536, None), (1560, good), (1536, gemm.Rope(1 << 20, 1536, 4, 8, 1024, 16)),
                    (1536, gemm.Rope(1 << 20, 1536, 8, 8, 1024, 25)),
                    (1536, gemm.Rope(1 << 20, 1536, 8, 8, 0, 16))):
        with pytest.raises(ValueError):
            gemm.check_rope(v, N, rope)
    with pytest.raises(ValueError):
        gemm.check_rope(gemm.VARIANTS["gemm_f32t_c_n128_s6"], 1536, good)


def test_a_plan_checks_its_outputs():
    """check_plan (the real and the stand-in plans'): H given exactly for
    the SwiGLU variants, a's rows whole 16-byte strides for the copy
    engine's SwiGLU epilogue (F a multiple of 8), the rope's arguments."""
    args = dict(M=1000, K=512, A=1 << 20, lda=512, B=1 << 21, ldb=512, C=1 << 22)
    gemm.check_plan("gemm_swiglut_c_n128_s6", N=2816, ldc=2816, H=1 << 23, **args)
    gemm.check_plan("gemm_swiglu_c_n128_s6", N=2824, ldc=2824, H=1 << 23, **args)
    with pytest.raises(ValueError, match="F = 1412"):
        gemm.check_plan("gemm_swiglut_c_n128_s6", N=2824, ldc=2824, H=1 << 23, **args)
    for name, H in (("gemm_swiglut_c_n128_s6", 0), ("gemm_f32t_c_n128_s6", 1 << 23)):
        with pytest.raises(ValueError, match="H is"):
            gemm.check_plan(name, N=2816, ldc=2816, H=H, **args)
    with pytest.raises(ValueError, match="rope arguments"):
        gemm.check_plan("gemm_rope64_c_n128_s6", N=1536, ldc=1536, **args)
    # the dswiglu variants: their outputs given exactly for them, F a multiple of 8,
    # gu's rows 2F long at least, dgu and a 16-byte aligned
    back = dict(M=1000, K=512, A=1 << 20, lda=512, B=1 << 21, ldb=1408, C=1 << 22)
    d = gemm.Dswiglu(dgu=1 << 23, a=1 << 24)
    gemm.check_plan("gemm_dswiglu_kn_p_m1n128_s6", N=1408, ldc=2816, dswiglu=d, **back)
    with pytest.raises(ValueError, match="dswiglu arguments"):
        gemm.check_plan("gemm_dswiglu_kn_p_m1n128_s6", N=1408, ldc=2816, **back)
    with pytest.raises(ValueError, match="dswiglu arguments"):
        gemm.check_plan("gemm_f32t_kn_c_n128_s6", N=1408, ldc=1408, dswiglu=d, **back)
    with pytest.raises(ValueError, match="at least 2F"):
        gemm.check_plan("gemm_dswiglu_kn_p_m1n128_s6", N=1408, ldc=1408, dswiglu=d, **back)
    with pytest.raises(ValueError, match="aligned"):
        gemm.check_plan("gemm_dswiglu_kn_p_m1n128_s6", N=1408, ldc=2816,
                        dswiglu=gemm.Dswiglu(1 << 23, (1 << 24) + 8), **back)
    # dswiglu_again: h and W_gu given exactly for it (gu not read: C 0), each
    # 16-byte aligned with 16-byte rows; swiglu_a: a alone (C 0), F a multiple of 8
    again = gemm.Dswiglu(dgu=1 << 23, a=1 << 24, h=1 << 25, ldh=512, w=1 << 26, ldw=512)
    gemm.check_plan("gemm_dswiglu_again_p_m2n64_s3", N=1408, ldc=0, **{**back, "C": 0},
                    dswiglu=again)
    for variant, dswiglu, match in (("gemm_dswiglu_again_p_m2n64_s3", d, "again variants"),
                                    ("gemm_dswiglu_kn_p_m1n128_s6", again, "again variants")):
        with pytest.raises(ValueError, match=match):
            gemm.check_plan(variant, N=1408, ldc=2816, dswiglu=dswiglu, **back)
    for bad in (dict(h=(1 << 25) + 8), dict(ldw=516), dict(a=(1 << 24) + 4)):
        with pytest.raises(ValueError, match="aligned|multiples of 16"):
            gemm.check_plan("gemm_dswiglu_again_p_m2n64_s3", N=1408, ldc=0,
                            dswiglu=gemm.Dswiglu(**{**again.__dict__, **bad}),
                            **{**back, "C": 0})
    gemm.check_plan("gemm_swiglua_p_m2n128_s4", N=2816, ldc=0, H=1 << 23, **{**args, "C": 0})
    with pytest.raises(ValueError, match="F = 1412"):
        gemm.check_plan("gemm_swiglua_p_m2n128_s4", N=2824, ldc=0, H=1 << 23,
                        **{**args, "C": 0})
    with pytest.raises(ValueError, match="A given as"):
        gemm.check_plan("gemm_f32t_mn_p_m1n128_s6", M=1004, N=512, K=512, A=1 << 20, lda=1008,
                        B=1 << 21, ldb=512, C=1 << 22, ldc=512)


def test_map_geometry_is_innermost_first_in_bytes():
    g = gemm.map_geometry(rows=1000, cols=200, ld=264, box_rows=128)
    assert g.dims == (200, 1000) and g.strides == (528,) and g.box == (64, 128)
    assert gemm.map_geometry(1000, 520, 520, 64, item=4).box == (32, 64)  # C's, float32
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        gemm.map_geometry(10, 20, 20, 64)  # 40-byte rows
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        gemm.map_geometry(10, 6, 6, 64, item=4)
    with pytest.raises(ValueError, match="below"):
        gemm.map_geometry(10, 64, 56, 64)
    with pytest.raises(ValueError, match="1 to 256"):
        gemm.map_geometry(10, 64, 64, 512)


def test_shapes_the_kernel_refuses():
    gemm.check_shape(1, 8, 8, "f32")
    for M, N, K in ((0, 8, 8), (8, 12, 8), (8, 8, 20)):
        with pytest.raises(ValueError):
            gemm.check_shape(M, N, K, "f32")


@settings(max_examples=200, deadline=None)
@given(M=st.integers(1, 3000), N=st.integers(1, 400).map(lambda n: 8 * n),
       name=st.sampled_from(sorted(gemm.VARIANTS)), sms=st.integers(2, 200))
def test_tiles_cover_the_output_once_and_the_grid_is_whole_clusters(M, N, name, sms):
    """The kernel's tiles, counted by walking the output: each (row,
    column) of C (of gu's gate half with the SwiGLU epilogue, whose tiles
    also carry the up half) lies in exactly one tile, and in clusters of
    two the tiles come in vertical pairs."""
    v = gemm.VARIANTS[name]
    cols, width = (N // 2, v.bn // 2) if v.swiglu else (N, v.bn)
    origins = set()
    r = 0
    while r < M:
        c = 0
        while c < cols:
            origins.add((r, c))
            c += width
        r += v.bm
    pairs_m = -(-M // (v.bm * v.cluster))
    assert gemm.tiles(M, N, v) == (len(origins) if v.cluster == 1 else
                                   pairs_m * v.cluster * -(-cols // width))
    assert gemm.tiles(M, N, v) >= len(origins)
    g = gemm.grid(M, N, v, sms)
    assert g % v.cluster == 0 and 0 < g <= sms or gemm.tiles(M, N, v) < v.cluster
    assert g <= gemm.tiles(M, N, v)


# the spills a compiler is known to make, by NVRTC's (major, minor): kernel -> bytes of
# spill stores and loads at most. NVRTC 13.0 (PyTorch's CUDA 13 environment) spills in the
# again kernel past 8,192 rows, which was measured faster than the alternative with its
# spill (dev/cuda/NOTES.md, "a spill with the device's compiler"); 13.5 spills nothing
KNOWN_SPILLS = {(13, 0): {"gemm_dswiglu_again_p_m2n64_s3": (92, 152)}}


def spills(log: str) -> dict:
    """ptxas -v's log -> {kernel: (bytes of spill stores, of spill loads)}."""
    out, kernel = {}, None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            kernel = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and kernel:
            out[kernel] = (int(m.group(1)), int(m.group(2)))
    return out


def test_the_source_compiles_for_sm90a_with_wgmma():
    """No kernel spills (but what KNOWN_SPILLS allows this NVRTC, and no
    more), setmaxnreg is honoured (ptxas warns C7508 when it is not), and
    every variant is in the module."""
    import ctypes

    try:
        lib = gemm.nvrtc_library()
    except gemm.GemmError:
        pytest.skip("NVIDIA's NVRTC is not installed (pip install nvidia-cuda-nvrtc)")
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    cubin, log = gemm.compile_cubin(lib, options=gemm.compile_options()
                                    + ["--ptxas-options=-v"])
    assert cubin[:4] == b"\x7fELF"
    assert "C7508" not in log
    found = spills(log)
    assert set(gemm.VARIANTS) <= set(found)
    allowed = KNOWN_SPILLS.get((major.value, minor.value), {})
    over = {k: b for k, b in found.items()
            if any(x > y for x, y in zip(b, allowed.get(k, (0, 0))))}
    assert not over, (f"NVRTC {major.value}.{minor.value} spills", over)


def test_the_products_rule():
    """products.choose: the own kernel for the forward's bf16 x @ W^T with a
    float32 result at or above the row floor, aligned; cuBLAS for every
    other layout, type, scaling, batch, a wide classifier, a K past the measured
    shapes or a small M."""
    from coppelius.accelerated.cuda import products

    base = dict(trans_a=False, trans_b=True, m=8192, n=1536, k=512, A=1 << 20, lda=512,
                B=1 << 21, ldb=512, C=1 << 22, ldc=1536, ab_type="bfloat16", c_type="float32",
                beta=0.0, batch=1)
    assert products.choose(**base) == "gemm_f32t_p_m2n128_s4"
    assert products.choose(**{**base, "k": 1408, "lda": 1408, "ldb": 1408}) == \
        "gemm_f32t_c_n256_s4"
    for change in ({"trans_a": True}, {"ab_type": "float32"},
                   {"c_type": "bfloat16"}, {"beta": 1.0}, {"batch": 2}, {"m": 1024},
                   {"n": 12288, "ldc": 12288}, {"n": 1540, "ldc": 1540}, {"A": (1 << 20) + 8},
                   {"lda": 516}, {"k": 2048, "lda": 2048, "ldb": 2048}):
        assert products.choose(**{**base, **change}) is None, change
    # the backward's dX = dY W (B given as (k, n)): float32 or bfloat16 results, K to 1024
    back = {**base, "trans_b": False, "n": 512, "ldb": 512, "ldc": 512}
    assert products.choose(**back) == products.BACKWARD_INPUT["float32"]
    assert products.choose(**{**back, "c_type": "bfloat16"}) == \
        products.BACKWARD_INPUT["bfloat16"]
    for change in ({"k": 1536, "lda": 1536}, {"m": 1024}, {"beta": 1.0},
                   {"c_type": "bfloat16", "ldc": 516}, {"trans_a": True}):
        assert products.choose(**{**back, **change}) is None, change
    for name in products.BACKWARD_INPUT.values():
        assert gemm.VARIANTS[name].layout == "kn"
    dsw = dict(m=8192, F=1408, k=512, A=1 << 20, lda=512, W=1 << 21, ldw=1408, gu=1 << 22,
               dgu=1 << 23, a=1 << 24)
    assert products.choose_dswiglu(**dsw) == products.DSWIGLU
    assert gemm.VARIANTS[products.DSWIGLU].epilogue == "dswiglu"
    for change in ({"m": 1024}, {"F": 1412, "ldw": 1412}, {"k": 1536, "lda": 1536},
                   {"a": (1 << 24) + 8}):
        assert products.choose_dswiglu(**{**dsw, **change}) is None, change
    for name in (products.choose(**base), products.SWIGLU, products.SWIGLU_ANY_F,
                 *products.ROPE.values(), *products.ROPE_FEW_ROWS.values()):
        assert name in gemm.VARIANTS
    assert gemm.VARIANTS[products.SWIGLU].epilogue == "swiglu_tma"
    assert gemm.VARIANTS[products.SWIGLU_ANY_F].epilogue == "swiglu"
    pointers = (512, 1 << 21, 512, 1 << 22, 1 << 23)
    assert products.choose_swiglu(8192, 1408, 512, 1 << 20, *pointers) == products.SWIGLU
    # F = 1412: a's rows are no whole 16 bytes for the copy engine
    assert products.choose_swiglu(8192, 1412, 512, 1 << 20, *pointers) == products.SWIGLU_ANY_F
    assert products.choose_swiglu(1024, 1408, 512, 1 << 20, *pointers) is None
    assert products.choose_swiglu(8192, 5632, 2048, 1 << 20, 2048, 1 << 21, 2048, 1 << 22,
                                  1 << 23) is None  # d_model 2048: not measured faster
    for E in (64, 128):
        rope = dict(n=1536, k=512, A=1 << 20, lda=512, W=1 << 21, ldw=512, out=1 << 22,
                    ldo=1536, E=E, R=E)
        assert gemm.VARIANTS[products.choose_rope(8192, **rope)].rope == E
        assert products.choose_rope(8192, **rope) == products.ROPE[E]
        assert products.choose_rope(1024, **rope) == products.ROPE_FEW_ROWS[E]
        assert products.choose_rope(8192, **{**rope, "R": E // 2}) is None  # partial rotary
    assert products.choose_rope(8192, 1536, 512, 1 << 20, 512, 1 << 21, 512, 1 << 22, 1536,
                                96, 96) is None  # no variant of that head width


def test_the_splits_of_k_are_whole_slabs_none_empty():
    """split_k: for every product shape, the kernel's splits (per =
    ceil(slabs / splits) slabs each, the last the rest) are all non-empty
    and cover K; tiles x splits fills at most the multiprocessors, and the
    partials fit the workspace."""
    v = next(v for v in gemm.VARIANTS.values() if v.split)
    plain = gemm.VARIANTS["gemm_f32t_mn_p_m1n128_s6"]
    assert gemm.split_k(512, 512, 8192, plain, 132) == 1
    for sms in (1, 7, 132):
        for M, N in ((64, 128), (512, 512), (1536, 512), (2816, 512), (512, 1408), (4096, 4096)):
            for K in (8, 64, 65, 640, 1000, 8192, 32768):
                splits = gemm.split_k(M, N, K, v, sms)
                slabs = -(-K // gemm.BK)
                per = -(-slabs // splits)
                assert 1 <= splits <= slabs and (splits - 1) * per < slabs <= splits * per
                tiles = gemm.tiles(M, N, v)
                assert splits == 1 or tiles * splits <= sms
                assert splits * M * N * 4 <= max(gemm.workspace_bytes(v, sms), M * N * 4) \
                    or splits == 1
                assert gemm.grid(M, N, v, sms, splits) == min(sms, tiles * splits)
    with pytest.raises(ValueError, match="whole tiles"):
        gemm.check_plan("gemm_f32t_mn_p_m1n128_s6_splitk", M=520, N=512, K=8192, A=1 << 20,
                        lda=520, B=1 << 21, ldb=512, C=1 << 22, ldc=512)


def test_the_rule_for_the_gate_up_products_again():
    """products.gate_up_again: the input gradients' shapes (rows at the
    floor and up, d_model up to AGAIN_MAX_K) with F a multiple of 8; the again
    kernel's tile by rows (the wide tile up to AGAIN_WIDE_ROWS, measured
    faster there); buffers its plan refuses go back to the kept path."""
    from coppelius.accelerated.cuda import products

    floor = products.MIN_ROWS
    assert products.gate_up_again(8192, 1408, 512)
    for m, F, k in ((floor - 1, 1408, 512), (8192, 1412, 512), (8192, 1408, 2048),
                    (8192, 2048, products.AGAIN_MAX_K + 256)):
        assert not products.gate_up_again(m, F, k), (m, F, k)
    d = gemm.Dswiglu(dgu=1 << 23, a=1 << 24, h=1 << 25, ldh=512, w=1 << 26, ldw=512)
    args = (1408, 512, 1 << 20, 512, 1 << 21, 1408)
    assert products.choose_dswiglu_again(8192, *args, d) == products.DSWIGLU_AGAIN[True]
    assert products.choose_dswiglu_again(32768, *args, d) == products.DSWIGLU_AGAIN[False]
    assert products.choose_dswiglu_again(32768, *args, gemm.Dswiglu(1 << 23, 1 << 24,
                                                                    (1 << 25) + 8, 512,
                                                                    1 << 26, 512)) is None
    assert products.choose_dswiglu_again(floor - 1, *args, d) is None


def test_the_ping_pong_arrivals_come_before_the_epilogue():
    """Each ping-pong kernel's thread 0 arrives at the order barrier (the
    other warpgroup's turn to multiply) and at the last slab's empty barrier
    within a hundred instructions of the tile's last wgmma wait, not after
    its epilogue's arithmetic, where ptxas puts an arrival nothing depends on
    when it may (the again kernel's did so with the fast sigmoid, and the
    other warpgroup's products then waited for the SwiGLU backward:
    dev/cuda/NOTES.md, "The sigmoid"). Needs NVRTC and cuobjdump/nvdisasm."""
    try:
        gemm.nvrtc_library()
    except gemm.GemmError:
        pytest.skip("NVIDIA's NVRTC is not installed (pip install nvidia-cuda-nvrtc)")
    path = os.path.join(os.path.dirname(__file__), "..", "dev", "cuda", "arrive_check.py")
    spec = importlib.util.spec_from_file_location("arrive_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    if check.cuobjdump() is None:
        pytest.skip("cuobjdump is not installed (pip install nvidia-cuda-cuobjdump "
                    "nvidia-cuda-nvdisasm)")
    found = check.placements(gemm.compile_options())
    assert {v for v, var in gemm.VARIANTS.items() if var.pingpong} <= set(found)
    for name, (arrivals, work) in found.items():
        early = [a for a in arrivals if -5 <= a <= 100]
        assert len(early) >= 2, (name, arrivals, work[:1], work[-1:])
