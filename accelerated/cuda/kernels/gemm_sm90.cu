// ---------------------------------------------------------------- gemm_sm90

// Row-major C (M,N) = A (M,K) @ B (N,K)^T: bfloat16 operands, float32
// accumulation, on Hopper (sm_90a), as the forward's products compute them
// (x @ W^T, W (out, in) row-major: both operands K-major), and the
// backward's with transposed operands (below); C float32 or, for a product
// whose result is only an operand, bfloat16. A module of its own
// (accelerated/cuda/gemm.py), compiled for sm_90a after common.cuh,
// swiglu.cu and rope.cu, whose formulas the epilogues share.
//
// The design (dev/cuda/NOTES.md, "A product kernel of the project's own"):
// - a persistent grid (one block per multiprocessor), the (BM x BN) output
//   tiles taken in row-major order, tile i by block i mod gridDim.x;
// - three warpgroups: the first, one thread, loads the K-slabs of A (BM x 64)
//   and B (BN x 64) with the tensor copy engine (TMA, 128-byte swizzle)
//   into a ring of STAGES shared-memory stages, each completing on its
//   `full` barrier; the other two each multiply 64 rows of the tile with
//   wgmma (m64nBNk16, both operands from shared memory), keep one batch in
//   flight, and hand a stage back on its `empty` barrier;
// - the K order is fixed (slab after slab, 16 at a time within a slab) and
//   no atomics: a replay gives the same bits;
// - the epilogue works on the float32 accumulators in registers: EPI_F32
//   stores them; EPI_SWIGLU (B the fused (2F, D) gate/up weights, each tile
//   BN/2 gate columns and the same BN/2 up columns) stores gu (M, 2F) and
//   a (M, F) = silu(g) * u as the swiglu kernel computes it, as bfloat16;
//   EPI_F32_TMA, EPI_SWIGLU_TMA, EPI_ROPE, EPI_BF16_TMA and EPI_DSWIGLU store
//   through shared memory and the copy engine (`staged`); EPI_DSWIGLU (the
//   down product's dX, da = dres W_down) does the SwiGLU's backward on da
//   in registers: no float32 da is written; EPI_SWIGLU_A stores a alone,
//   for dswiglu_again (a kernel of its own, below), which computes the gate
//   and up products again beside da in the SwiGLU backward's tile.
//
// Layouts (TA, TB): the forward's, both operands K-major (A (M,K), B (N,K)
// row-major), and the backward's: TB, B given as (K,N) row-major (N-major:
// dX = dY W, W (out, in) = (K, N)); TA with TB, A given as (K,M) row-major
// too (M-major: dW = dY^T X over the rows). A transposed operand's slab
// is 64-column boxes of its rows (64 elements, 128 bytes, by 64 K-rows),
// one after another, read by wgmma with its transpose bit (smem_desc_mn).
//
// Shapes: K and N multiples of 8 (TMA's 16-byte row strides, and the
// epilogues' pairs of columns; with TA, gemm.py asks M too), M any
// otherwise; the last tiles' rows and columns past the matrix are
// read as zeros (TMA) and not stored.

typedef unsigned long long u64;

// A CUtensorMap, encoded on the host (gemm.py: cuTensorMapEncodeTiled) and
// kept in device memory, 64-byte aligned.
struct __align__(64) TensorMap { u64 word[16]; };

#define GEMM_BM 128
#define GEMM_BK 64
#define GEMM_THREADS 384
#define EPI_F32 0
#define EPI_SWIGLU 1
#define EPI_F32_TMA 2
#define EPI_ROPE 3
#define EPI_SWIGLU_TMA 4
#define EPI_BF16_TMA 5
#define EPI_DSWIGLU 6
#define EPI_SWIGLU_A 7

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// -- barriers (mbarrier, in shared memory) ---------------------------------
__device__ __forceinline__ void bar_init(u64* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// the arrival of the thread that issues the copies, and the bytes they bring
__device__ __forceinline__ void bar_expect(u64* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
                 "r"(bytes) : "memory");
}

__device__ __forceinline__ void bar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ bool bar_try(u64* bar, unsigned parity) {
    unsigned done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    return done;
}

// wait until the barrier's phase of this parity has completed (a fresh
// barrier counts its phase "-1", of parity 1, as completed). With
// GEMM_WATCHDOG defined (dev/cuda/gemm_check.py), a wait of more than two
// seconds prints where it waits and traps, instead of hanging the device.
__device__ __forceinline__ void bar_wait(u64* bar, unsigned parity) {
#ifdef GEMM_WATCHDOG
    u64 start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (unsigned spins = 1; !bar_try(bar, parity); spins++) {
        if (spins % 1024 == 0) {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (now - start > 2000000000ull) {
                printf("gemm watchdog: block %d thread %d waits on barrier %u parity %u\n",
                       blockIdx.x, threadIdx.x, smem_addr(bar), parity);
                __trap();
            }
        }
    }
#else
    while (!bar_try(bar, parity)) {
    }
#endif
}

// the arrival on barrier `bar` of the block of rank `cta` in the cluster
// (the same shared-memory offset there)
__device__ __forceinline__ void bar_arrive_cta(u64* bar, unsigned cta) {
    asm volatile(
        "{\n.reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(
            smem_addr(bar)),
        "r"(cta) : "memory");
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// every thread of the cluster's blocks (not necessarily converged)
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// With GEMM_TRACE defined (dev/cuda/epilogue_trace.py), the multiplying
// warpgroups record the SM's clock at five points of each of their first
// TRACE_TILES tiles into gemm_trace (block, warpgroup, tile, point): before
// the wait for their turn, after it, after the first slab's wait, at the
// mainloop's end and at the epilogue's end. Without it, nothing.
#ifdef GEMM_TRACE
#define TRACE_TILES 32
__device__ u64 gemm_trace[132 * 2 * TRACE_TILES * 8];
#define TRACE_AT(point, tile)                                                               \
    if (t == 0 && (tile) < TRACE_TILES && blockIdx.x < 132)                               \
        gemm_trace[((blockIdx.x * 2 + c) * TRACE_TILES + (tile)) * 8 + (point)] = clock64();
#else
#define TRACE_AT(point, tile)
#endif
#define TRACE(point) TRACE_AT(point, mine)  // before the tile's count moves on
#define TRACE_DONE(point) TRACE_AT(point, mine - 1)  // after

// -- the tensor copy engine ---------------------------------------------------
// the box of `map` at element coordinates (x along K, y along rows) -> dst,
// completing on bar
__device__ __forceinline__ void tma_load(void* dst, const TensorMap* map, u64* bar, int x, int y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_addr(dst)),
        "l"((u64)map), "r"(smem_addr(bar)), "r"(x), "r"(y) : "memory");
}

// the same box into dst of every block of the cluster in `mask`, each
// completing on its own barrier at bar's offset
__device__ __forceinline__ void tma_load_multicast(void* dst, const TensorMap* map, u64* bar, int x,
                                                   int y, unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
        "l"((u64)map), "r"(smem_addr(bar)), "r"(x), "r"(y), "h"(mask) : "memory");
}

// the box at src (shared memory) to map's tensor at (x, y), by the copy
// engine; the box's parts past the tensor are not written
__device__ __forceinline__ void tma_store(const TensorMap* map, const void* src, int x, int y) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                     (u64)map),
                 "r"(smem_addr(src)), "r"(x), "r"(y) : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// all but the newest N store groups have read their shared memory
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
// ordinary shared-memory stores made visible to the copy engine
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// the 128 threads of one warpgroup (named barrier id, 1 or 2)
__device__ __forceinline__ void warpgroup_sync(int id) {
    asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}

// -- wgmma ------------------------------------------------------------------------
// The shared-memory matrix descriptor of a K-major tile in TMA's 128-byte
// swizzle: rows of 64 bfloat16 (128 bytes), 8-row groups 1024 bytes apart;
// p the first element of the 16 K-columns a wgmma reads (a step of 16 along
// K is 32 bytes into the swizzled row, as the hardware applies the swizzle
// to the address).
__device__ __forceinline__ u64 smem_desc(const void* p) {
    u64 a = smem_addr(p);
    return ((a & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// The descriptor of an M- or N-major tile in the 128-byte swizzle, as the
// copy engine writes 64-column boxes of a (K, M) row-major matrix: each box
// 64 K-rows of 128 bytes (64 bfloat16 of M or N), the boxes 8192 bytes
// apart (the leading offset: the next 64 columns), 8-row groups 1024 bytes
// apart (the stride offset: the next 8 K-rows); p the first of the 16
// K-rows a wgmma reads (a step of 16 along K is 2048 bytes).
__device__ __forceinline__ u64 smem_desc_mn(const void* p) {
    u64 a = smem_addr(p);
    return ((a & 0x3FFFF) >> 4) | ((u64)(8192 >> 4) << 16) | ((u64)(1024 >> 4) << 32) |
           ((u64)1 << 62);
}

// the descriptor of a slab's 16 K-columns k (K-major) or K-rows k (M-major)
// of the 64-row (or 64-column) block at p
template <bool T>
__device__ __forceinline__ u64 slab_desc(const unsigned char* p, int k) {
    if constexpr (T) return smem_desc_mn(p + 2048 * k);
    else return smem_desc(p + 32 * k);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// D (64 x 256) += A (64 x 16) B (16 x 256): 128 float32 accumulators a thread;
// TA, TB: the operands M- and N-major (the transpose bits)
template <int TA, int TB>
__device__ __forceinline__ void wgmma_n256(float (&d)[128], u64 a, u64 b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, %131, %132;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(a), "l"(b), "r"(accumulate), "n"(TA), "n"(TB));
}

// D (64 x 128) += A (64 x 16) B (16 x 128): 64 float32 accumulators a thread
template <int TA, int TB>
__device__ __forceinline__ void wgmma_n128(float (&d)[64], u64 a, u64 b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, %67, %68;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(accumulate), "n"(TA), "n"(TB));
}


// D (64 x 64) += A (64 x 16) B (16 x 64): 32 float32 accumulators a thread
template <int TA, int TB>
__device__ __forceinline__ void wgmma_n64(float (&d)[32], u64 a, u64 b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, %35, %36;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(accumulate), "n"(TA), "n"(TB));
}

template <int BN, bool TA, bool TB>
__device__ __forceinline__ void wgmma_tile(float (&d)[BN / 2], u64 a, u64 b, int accumulate) {
    if constexpr (BN == 256) wgmma_n256<TA, TB>(d, a, b, accumulate);
    else wgmma_n128<TA, TB>(d, a, b, accumulate);
}

// -- the kernel -------------------------------------------------------------------
// The epilogue of one warpgroup's 64 x BN accumulators d, rows from `row`
// (this thread's first; its second is row + 8), the tile's first column
// col0 (EPI_SWIGLU: its first gate column).
template <int BN, int EPI>
__device__ __forceinline__ void store_tile(const float (&d)[BN / 2], int row, int col0, int M,
                                           int N, float* __restrict__ C, int ldc,
                                           unsigned short* __restrict__ H) {
    const int lane = threadIdx.x % 32;
    if constexpr (EPI == EPI_F32) {
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
            const int col = col0 + j * 8 + 2 * (lane % 4);
            if (col < N) {
                if (row < M)
                    *reinterpret_cast<float2*>(C + (long long)row * ldc + col) =
                        make_float2(d[4 * j], d[4 * j + 1]);
                if (row + 8 < M)
                    *reinterpret_cast<float2*>(C + (long long)(row + 8) * ldc + col) =
                        make_float2(d[4 * j + 2], d[4 * j + 3]);
            }
        }
    } else {
        constexpr int UP = BN / 16;  // the up columns' first index j
        const int F = N / 2;
#pragma unroll
        for (int j = 0; j < BN / 16; j++) {
            const int col = col0 + j * 8 + 2 * (lane % 4);
            if (col < F) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = row + 8 * h;
                    if (r < M) {
                        const float g0 = d[4 * j + 2 * h], g1 = d[4 * j + 2 * h + 1];
                        const float u0 = d[4 * (j + UP) + 2 * h], u1 = d[4 * (j + UP) + 2 * h + 1];
                        float* gu = C + (long long)r * ldc;
                        *reinterpret_cast<float2*>(gu + col) = make_float2(g0, g1);
                        *reinterpret_cast<float2*>(gu + F + col) = make_float2(u0, u1);
                        *reinterpret_cast<unsigned*>(H + (long long)r * F + col) =
                            pack_bf16x2(swiglu_value(g0, sigmoid(g0), u0),
                                        swiglu_value(g1, sigmoid(g1), u1));
                    }
                }
            }
        }
    }
}

// a stage handed back: to this block's loads, and with CL 2 to the peer's
// too (whose copies write into this block's stage)
template <int CL>
__device__ __forceinline__ void release(u64* bar) {
    if constexpr (CL == 2) {
        bar_arrive_cta(bar, 0);
        bar_arrive_cta(bar, 1);
    } else {
        bar_arrive(bar);
    }
}

// The epilogues through the copy engine: a warpgroup's tile as Q chunks of
// 64*MT rows of 128 bytes (32 float32 or 64 bfloat16 columns), each written
// by the threads into one of the warpgroup's NBUF staging buffers (TMA's
// 128-byte swizzle: the 16-byte chunk c of row r at chunk c ^ (r mod 8),
// `swizzled`) and stored by the engine while the threads fill the other
// (NBUF 2; with one, a chunk's fill waits until the engine has read the
// one before); the warpgroup goes on to its next tile without waiting for
// the stores.
// Rows and columns past a map's tensor are clipped by the engine.
// fill(q, buf) writes chunk q; store(q, buf) (one thread) issues its copy.
// `id`: the warpgroup's named barrier.
__device__ __forceinline__ unsigned char* swizzled(unsigned char* buf, int r, int byte) {
    return buf + r * 128 + (((byte >> 4) ^ (r & 7)) << 4) + (byte & 15);
}

template <int MT, int Q, int NBUF = 2, class Fill, class Store>
__device__ __forceinline__ void staged(unsigned char* staging, int id, Fill fill, Store store) {
    constexpr int CHUNK = 64 * MT * 128;
    const int t = threadIdx.x % 128;
#pragma unroll
    for (int q = 0; q < Q; q++) {
        unsigned char* buf = staging + (q % NBUF) * CHUNK;
        // the store NBUF chunks back (this buffer's) has read it; a tile's first chunk
        // where Q is no multiple of NBUF: every store (the previous tile's may be this
        // buffer's)
        if (t == 0) {
            if (Q % NBUF && q == 0) bulk_wait_read<0>();
            else bulk_wait_read<NBUF - 1>();
        }
        warpgroup_sync(id);
#ifndef GEMM_PROBE_NO_FILL  // dev/cuda/epilogue_trace.py's parts of the epilogue
        fill(q, buf);
#endif
        fence_async_shared();
        warpgroup_sync(id);
        if (t == 0) {
#ifndef GEMM_PROBE_NO_STORE
            store(q, buf);
#endif
            bulk_commit();
        }
    }
}

// this thread's row of 64-row block m, half h, in a warpgroup's staged tile
__device__ __forceinline__ int staged_row(int m, int h) {
    const int t = threadIdx.x % 128;
    return m * 64 + (t / 32) * 16 + (t % 32) / 4 + 8 * h;
}

// the float32 accumulators of the groups j0 .. j0+3 (32 columns) into a chunk
template <int MT, int BN>
__device__ __forceinline__ void fill_f32(const float (&d)[MT][BN / 2], int j0, unsigned char* buf) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int jj = 0; jj < 4; jj++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int j = j0 + jj;
                *reinterpret_cast<float2*>(swizzled(buf, staged_row(m, h), jj * 32 + 8 * (lane % 4))) =
                    make_float2(d[m][4 * j + 2 * h], d[m][4 * j + 2 * h + 1]);
            }
}

// 64 bfloat16 columns (8 groups of 8) into a chunk: pair(m, jj, h), this
// thread's two values of group jj in block m, half h, rounded
template <int MT, class Pair>
__device__ __forceinline__ void fill_bf16(unsigned char* buf, Pair pair) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int jj = 0; jj < 8; jj++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float2 v = pair(m, jj, h);
                *reinterpret_cast<unsigned*>(
                    swizzled(buf, staged_row(m, h), jj * 16 + 4 * (lane % 4))) =
                    pack_bf16x2(v.x, v.y);
            }
}

// EPI_F32_TMA: the 64*MT x BN accumulators to C, 32 columns a chunk. map:
// C's (box 32 x 64*MT), (x0, y0) the warpgroup's first column and row.
template <int MT, int BN>
__device__ __forceinline__ void store_tile_tma(const float (&d)[MT][BN / 2], unsigned char* staging,
                                               const TensorMap* map, int x0, int y0, int id) {
    staged<MT, BN / 32>(
        staging, id, [&](int q, unsigned char* buf) { fill_f32<MT, BN>(d, 4 * q, buf); },
        [&](int q, unsigned char* buf) { tma_store(map, buf, x0 + 32 * q, y0); });
}

// EPI_BF16_TMA: the 64*MT x BN accumulators rounded to bfloat16 operands,
// 64 columns a chunk (a product whose result is only another product's
// operand). map: the operands' (box 64 x 64*MT).
template <int MT, int BN>
__device__ __forceinline__ void store_tile_bf16(const float (&d)[MT][BN / 2],
                                                unsigned char* staging, const TensorMap* map,
                                                int x0, int y0, int id) {
    staged<MT, BN / 64>(
        staging, id,
        [&](int q, unsigned char* buf) {
            fill_bf16<MT>(buf, [&](int m, int jj, int h) {
                const int j = 8 * q + jj;
                return make_float2(d[m][4 * j + 2 * h], d[m][4 * j + 2 * h + 1]);
            });
        },
        [&](int q, unsigned char* buf) { tma_store(map, buf, x0 + 64 * q, y0); });
}

// EPI_DSWIGLU: this thread's gate and up values for its accumulators of a
// da tile (rows from y0, columns from x0 of F), from gu (M, 2F) float32,
// its row stride ld: g at gu[r][c], u at gu[r][F + c]; zeros past the
// matrix. Loaded before the tile's mainloop, so that their latency hides
// under the products (64 * MT * BN float32 of each a warpgroup, MT * BN / 2
// registers of each a thread beside its MT * BN / 2 accumulators).
template <int MT, int BN>
__device__ __forceinline__ void dswiglu_inputs(float2 (&g)[MT][BN / 8][2],
                                               float2 (&u)[MT][BN / 8][2], int y0, int x0,
                                               int M, int F, const float* __restrict__ gu,
                                               int ld) {
    static_assert(MT * BN <= 128, "the inputs' registers beside the accumulators");
    const int t = threadIdx.x % 128, lane = t % 32;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = y0 + staged_row(m, h);
            const float* row = gu + (long long)r * ld;
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                const int col = x0 + 8 * j + 2 * (lane % 4);
                const bool in = r < M && col < F;
                g[m][j][h] = in ? __ldg(reinterpret_cast<const float2*>(row + col))
                                : make_float2(0.0f, 0.0f);
                u[m][j][h] = in ? __ldg(reinterpret_cast<const float2*>(row + F + col))
                                : make_float2(0.0f, 0.0f);
            }
        }
}

// EPI_DSWIGLU's epilogue: da (the accumulators), g and u -> dg, du and a =
// silu(g) u again (kernels/swiglu.cu's swiglu_grad, the swiglu_backward
// kernel's formula, on the float32 product), each rounded to a bfloat16
// operand, 64 columns a chunk: dg to dgu's gate half (maps[0]), du to its
// up half (maps[1]), a to a (maps[2]); each map bfloat16, box 64 x 64*MT.
// The results replace their inputs in the registers.
template <int MT, int BN>
__device__ __forceinline__ void store_tile_dswiglu(float (&d)[MT][BN / 2], float2 (&g)[MT][BN / 8][2],
                                                   float2 (&u)[MT][BN / 8][2],
                                                   unsigned char* staging, const TensorMap* maps,
                                                   int x0, int y0, int id) {
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float dg0, du0, a0, dg1, du1, a1;
                swiglu_grad(d[m][4 * j + 2 * h], g[m][j][h].x, u[m][j][h].x, dg0, du0, a0);
                swiglu_grad(d[m][4 * j + 2 * h + 1], g[m][j][h].y, u[m][j][h].y, dg1, du1, a1);
                d[m][4 * j + 2 * h] = dg0;
                d[m][4 * j + 2 * h + 1] = dg1;
                g[m][j][h] = make_float2(du0, du1);
                u[m][j][h] = make_float2(a0, a1);
            }
    constexpr int PER = BN / 64;  // chunks of each output
    staged<MT, 3 * PER>(
        staging, id,
        [&](int q, unsigned char* buf) {
            const int which = q / PER, j0 = 8 * (q % PER);
            fill_bf16<MT>(buf, [&](int m, int jj, int h) {
                const int j = j0 + jj;
                if (which == 0) return make_float2(d[m][4 * j + 2 * h], d[m][4 * j + 2 * h + 1]);
                return which == 1 ? g[m][j][h] : u[m][j][h];
            });
        },
        [&](int q, unsigned char* buf) {
            tma_store(&maps[q / PER], buf, x0 + 64 * (q % PER), y0);
        });
}

// EPI_SWIGLU_TMA: the SwiGLU tile's (BN/2 gate columns, then the same BN/2
// up columns) gate and up halves as float32 to gu's two halves, 32 columns
// a chunk, then a = silu(g) u (the swiglu kernel's formula) as bfloat16, 64
// columns a chunk. maps: gu's gate half and up half (float32, box 32 x
// 64*MT, each F columns of gu's rows) and a's (bfloat16, box 64 x 64*MT);
// x0 the tile's first gate column, y0 the warpgroup's first row.
// EPI_SWIGLU_A (GU false): a alone, maps a's only (the backward computes
// g and u again: dswiglu_again).
template <int MT, int BN, bool GU = true>
__device__ __forceinline__ void store_tile_swiglu(const float (&d)[MT][BN / 2],
                                                  unsigned char* staging, const TensorMap* maps,
                                                  int x0, int y0, int id) {
    constexpr int UP = BN / 16;               // the up columns' first group
    constexpr int HALF = GU ? BN / 64 : 0;    // float32 chunks of a half
    staged<MT, 2 * HALF + BN / 128>(
        staging, id,
        [&](int q, unsigned char* buf) {
            if (q < 2 * HALF) {  // gate chunks, then up chunks
                fill_f32<MT, BN>(d, q < HALF ? 4 * q : UP + 4 * (q - HALF), buf);
                return;
            }
            fill_bf16<MT>(buf, [&](int m, int jj, int h) {
                const int j = 8 * (q - 2 * HALF) + jj;
                const float g0 = d[m][4 * j + 2 * h], g1 = d[m][4 * j + 2 * h + 1];
                const float u0 = d[m][4 * (j + UP) + 2 * h];
                const float u1 = d[m][4 * (j + UP) + 2 * h + 1];
                return make_float2(swiglu_value(g0, sigmoid(g0), u0),
                                   swiglu_value(g1, sigmoid(g1), u1));
            });
        },
        [&](int q, unsigned char* buf) {
            if (q < 2 * HALF)
                tma_store(&maps[q < HALF ? 0 : 1], buf, x0 + 32 * (q % HALF), y0);
            else
                tma_store(&maps[GU ? 2 : 0], buf, x0 + 64 * (q - 2 * HALF), y0);
        });
}

// EPI_ROPE: the q | k | v product's epilogue, heads of R columns rotated
// whole (E = R) and every tile's columns whole heads: the first `rotated`
// heads of a row (q's and k's) rotated as kernels/rope.cu's rope_forward
// rotates them (its rope_first and rope_second on the float32 product,
// the pair's other element in this thread's registers R/16 groups of 8
// columns away), v's passed, each rounded to a bfloat16 operand, 64
// columns a chunk, into the operand matrix: no float32 q | k | v is
// written. rc, rs: this thread's cos and sin (rope_tables, loaded before
// the mainloop). map: the operands' (box 64 x 64*MT).
template <int MT, int BN, int R>
__device__ __forceinline__ void store_tile_rope(const float (&d)[MT][BN / 2],
                                                unsigned char* staging, const TensorMap* map,
                                                int x0, int y0, int id,
                                                const float2 (&rc)[MT][2][R / 16],
                                                const float2 (&rs)[MT][2][R / 16], int rotated) {
    static_assert(R % 16 == 0 && BN % R == 0 && BN % 64 == 0, "tiles of whole heads");
    constexpr int PAIR = R / 16;  // groups between a pair's elements
    staged<MT, BN / 64>(
        staging, id,
        [&](int q, unsigned char* buf) {
            fill_bf16<MT>(buf, [&](int m, int jj, int h) {
                const int j = 8 * q + jj;                // the group of 8 columns
                const bool first = (8 * j) % R < R / 2;  // in its head's first half
                const int jp = first ? j + PAIR : j - PAIR;
                float v0 = d[m][4 * j + 2 * h], v1 = d[m][4 * j + 2 * h + 1];
                if ((x0 + 8 * j) / R < rotated) {
                    const float p0 = d[m][4 * jp + 2 * h], p1 = d[m][4 * jp + 2 * h + 1];
                    const float2 c = rc[m][h][j % PAIR], s = rs[m][h][j % PAIR];
                    if (first) {
                        v0 = rope_first(v0, p0, c.x, s.x);
                        v1 = rope_first(v1, p1, c.y, s.y);
                    } else {
                        v0 = rope_second(p0, v0, c.x, s.x);
                        v1 = rope_second(p1, v1, c.y, s.y);
                    }
                }
                return make_float2(v0, v1);
            });
        },
        [&](int q, unsigned char* buf) { tma_store(map, buf, x0 + 64 * q, y0); });
}

// EPI_ROPE's cos and sin for this thread's accumulators of a tile of rows
// from y0 (the warpgroup's first): for each 64-row block m and half h, the
// rows' positions (row mod T) and the R/16 pairs of columns it holds in
// half a head, from the tables cs, sn (T, R/2). Loaded before the tile's
// mainloop, only where the tile has rotated heads, so that their latency
// hides under the products (the tables, 2 T R/2 float32, do not stay in
// the first-level cache beside the stages).
template <int MT, int R>
__device__ __forceinline__ void rope_tables(float2 (&rc)[MT][2][R / 16], float2 (&rs)[MT][2][R / 16],
                                            int y0, const float* __restrict__ cs,
                                            const float* __restrict__ sn, int T) {
    static_assert(MT * R <= 128, "the tables' registers beside the accumulators");
    const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const long long base =
                (long long)((y0 + m * 64 + warp * 16 + lane / 4 + 8 * h) % T) * (R / 2) +
                2 * (lane % 4);
#pragma unroll
            for (int g = 0; g < R / 16; g++) {
                rc[m][h][g] = __ldg(reinterpret_cast<const float2*>(cs + base + 8 * g));
                rs[m][h][g] = __ldg(reinterpret_cast<const float2*>(sn + base + 8 * g));
            }
        }
}

// Two schedules of the multiplying warpgroups over the block's tiles:
// - cooperative (PINGPONG false, MT 1): a tile is 128 x BN, each warpgroup
//   its 64 rows, both on every slab (a stage goes back when both are done);
// - ping-pong: a tile is 64*MT x BN, and the warpgroups take the block's
//   tiles in turn, each on the slabs of its own tiles only (the ring
//   holds them in tile order), so one's epilogue runs while the other
//   multiplies. Their mainloops take turns (the `order` barriers: each
//   starts when the other's is done), which also keeps every wait on a
//   stage's barrier at most one phase ahead of it, as a parity wait needs.
// - CL = 2: clusters of two blocks, on tiles (tm, tn) and (tm + 1, tn),
//   share B's slabs: each block loads half of a slab and the copy engine
//   writes it into both (multicast), so a stage goes back when the
//   warpgroups of both blocks are done with it.
// maps: A's (box 64 x BM; TA: 64 x 64, BM/64 of them a slab) and B's (box
// 64 x BN; EPI_SWIGLU or CL 2: 64 x BN/2; TB: 64 x 64, BN/64 of them),
// and with EPI_F32_TMA C's (float32, box 32 x 64*MT), with EPI_SWIGLU_TMA
// gu's gate and up halves' (float32, box 32 x 64*MT) and a's (bfloat16,
// box 64 x 64*MT; EPI_SWIGLU_A a's alone), with EPI_ROPE the
// operands' (bfloat16, box 64 x 64*MT; C is then not written). cs, sn, T,
// rotated: EPI_ROPE's (store_tile_rope); R its head width, else 0. EPI_BF16_TMA:
// C's (bfloat16 operands, box 64 x 64*MT). EPI_DSWIGLU (N = F, the da tile's
// columns): C = gu (M, 2F) float32 read, ldc its row stride, and the maps of
// dgu's gate and up halves and of a (bfloat16, box 64 x 64*MT).
// EPI_F32: C (M, ldc) float32, N columns. EPI_SWIGLU: N = 2F, C = gu (M, 2F),
// H = a (M, F) bfloat16 bits (EPI_SWIGLU_TMA: the same through its maps).
// SPLIT (the weight gradients, whose (out, in) tiles are too few for the
// grid): K cut into `rotated` splits of whole slabs, every one non-empty
// (gemm.py: split_k), item i the split i % splits of tile i / splits; each
// split's float32 partial into its M rows of C, a (splits M, N) workspace
// (M a multiple of BM), which gemm_splitk_reduce then sums in split order.
template <int MT, int BN, int STAGES, int EPI, bool PINGPONG, int CL, int R = 0, bool TA = false,
          bool TB = false, bool SPLIT = false>
__device__ __forceinline__ void gemm_tn(const TensorMap* __restrict__ maps, int M, int N, int K,
                                        float* __restrict__ C, int ldc,
                                        unsigned short* __restrict__ H,
                                        const float* __restrict__ cs,
                                        const float* __restrict__ sn, int T, int rotated) {
    static_assert(PINGPONG || MT == 1, "the cooperative tile is two warpgroups' 64 rows");
    static_assert(!TA || TB, "an M-major A with an N-major B (dW = dY^T X) only");
    constexpr int BM = PINGPONG ? 64 * MT : 128;  // a tile's rows
    constexpr int A_BYTES = BM * GEMM_BK * 2, B_BYTES = BN * GEMM_BK * 2;
    constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    extern __shared__ unsigned char smem_raw[];
    // the swizzle's atoms are 1024 bytes: the stages start 1024-aligned
    unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    // EPI_F32_TMA: two staging buffers per multiplying warpgroup, after the stages
    constexpr int CHUNK = 64 * (PINGPONG ? MT : 1) * 128;
    constexpr bool STAGED = EPI == EPI_F32_TMA || EPI == EPI_ROPE || EPI == EPI_SWIGLU_TMA ||
                            EPI == EPI_BF16_TMA || EPI == EPI_DSWIGLU || EPI == EPI_SWIGLU_A;
    constexpr bool SWI = EPI == EPI_SWIGLU || EPI == EPI_SWIGLU_TMA ||
                         EPI == EPI_SWIGLU_A;  // the gate/up tiles
    static_assert(!TB || (!SWI && CL == 1), "the N-major B: plain tiles, no clusters");
    static_assert(!SPLIT || (EPI == EPI_F32_TMA && CL == 1), "split partials: float32 tiles");
    constexpr int STAGING = STAGED ? 2 * 2 * CHUNK : 0;
    u64* full = reinterpret_cast<u64*>(smem + STAGES * STAGE_BYTES + STAGING);
    u64* empty = full + STAGES;
    u64* order = empty + STAGES;  // ping-pong: order[c], warpgroup c's turn to multiply

    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    const int F = N / 2;                  // SWI
    const int cols = SWI ? F : N;         // the tiles cover these columns
    const int width = SWI ? BN / 2 : BN;  // of them, a tile's
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (cols + width - 1) / width;
    const int slabs = (K + GEMM_BK - 1) / GEMM_BK;
    // the block's work: items first, first + step, ... of `items`; item i is
    // the tile (CL * (i / tiles_n) + rank, i % tiles_n)
    const unsigned rank = CL == 2 ? cluster_rank() : 0;
    const int splits = SPLIT ? rotated : 1, per = (slabs + splits - 1) / splits;
    const int items = SPLIT ? tiles_m * tiles_n * splits : (tiles_m + CL - 1) / CL * tiles_n;
    const int first = blockIdx.x / CL, step = gridDim.x / CL;
    // item i's tile (tm, tn) and slabs [k0, k1)
    auto work = [&](int i, int& tm, int& tn, int& k0, int& k1) {
        if constexpr (SPLIT) {
            const int tile = i / splits;
            tm = tile / tiles_n, tn = tile % tiles_n;
            k0 = (i % splits) * per, k1 = min(slabs, k0 + per);
        } else {
            tm = CL * (i / tiles_n) + rank, tn = i % tiles_n;
            k0 = 0, k1 = slabs;
        }
    };

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            bar_init(&full[s], 1);                  // the loading thread's arrival (and the bytes)
            bar_init(&empty[s], (PINGPONG ? 1 : 2) * CL);  // the multiplying warpgroups' arrivals
        }
        bar_init(&order[0], 1);
        bar_init(&order[1], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if constexpr (CL == 2) cluster_sync();  // the peer's barriers are ready too
    else __syncthreads();

    if (wg == 0) {  // the loads
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (t == 0) {
            int s = 0;
            unsigned phase = 0;
            for (int i = first; i < items; i += step) {
                int tm, tn, k0, k1;
                work(i, tm, tn, k0, k1);
                for (int kb = k0; kb < k1; kb++) {
                    bar_wait(&empty[s], phase ^ 1);
                    bar_expect(&full[s], STAGE_BYTES);
                    unsigned char* sa = smem + s * STAGE_BYTES;
                    if constexpr (TA) {  // (K, M): BM/64 boxes of 64 columns by 64 K-rows
#pragma unroll
                        for (int j = 0; j < BM / 64; j++)
                            tma_load(sa + j * 8192, &maps[0], &full[s], tm * BM + 64 * j,
                                     kb * GEMM_BK);
                    } else {
                        tma_load(sa, &maps[0], &full[s], kb * GEMM_BK, tm * BM);
                    }
                    if constexpr (TB) {  // (K, N): BN/64 boxes of 64 columns by 64 K-rows
#pragma unroll
                        for (int j = 0; j < BN / 64; j++)
                            tma_load(sa + A_BYTES + j * 8192, &maps[1], &full[s],
                                     tn * width + 64 * j, kb * GEMM_BK);
                    } else if constexpr (CL == 2) {  // this block's half of B, into both blocks
                        const int rows = rank * (SWI ? F : BN / 2) + tn * width;
                        tma_load_multicast(sa + A_BYTES + rank * (B_BYTES / 2), &maps[1], &full[s],
                                           kb * GEMM_BK, rows, 0x3);
                    } else if constexpr (SWI) {
                        tma_load(sa + A_BYTES, &maps[1], &full[s], kb * GEMM_BK, tn * width);
                        tma_load(sa + A_BYTES + B_BYTES / 2, &maps[1], &full[s], kb * GEMM_BK,
                                 F + tn * width);
                    } else {
                        tma_load(sa + A_BYTES, &maps[1], &full[s], kb * GEMM_BK, tn * width);
                    }
                    if (++s == STAGES) s = 0, phase ^= 1;
                }
            }
        }
    } else {  // the products
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        const int c = wg - 1, warp = t / 32, lane = t % 32;
        float d[MT][BN / 2];
        int s = 0, turn = 0, mine = 0;  // the block's tiles so far, and this warpgroup's
        unsigned phase = 0;
        for (int i = first; i < items; i += step, turn++) {
            if (PINGPONG && (turn & 1) != c) {  // the other warpgroup's: skip its slabs
                int tm, tn, k0, k1;
                work(i, tm, tn, k0, k1);
                const int at = s + (k1 - k0);
                phase ^= (at / STAGES) & 1;
                s = at % STAGES;
                continue;
            }
            int tm, tn, k0, k1;
            work(i, tm, tn, k0, k1);
            const int y0 = tm * BM + (PINGPONG ? 0 : c * 64);  // the warpgroup's first row
            constexpr int RG = EPI == EPI_ROPE ? R / 16 : 1;
            float2 rc[EPI == EPI_ROPE ? MT : 1][2][RG], rs[EPI == EPI_ROPE ? MT : 1][2][RG];
            if constexpr (EPI == EPI_ROPE)
                if (tn * width < rotated * R) rope_tables<MT, R>(rc, rs, y0, cs, sn, T);
            constexpr int DS = EPI == EPI_DSWIGLU ? MT : 1, DJ = EPI == EPI_DSWIGLU ? BN / 8 : 1;
            float2 dg_in[DS][DJ][2], du_in[DS][DJ][2];  // EPI_DSWIGLU: g and u (C = gu, ldc)
            if constexpr (EPI == EPI_DSWIGLU)
                dswiglu_inputs<MT, BN>(dg_in, du_in, y0, tn * width, M, N, C, ldc);
            TRACE(0);
            if (PINGPONG && (c == 1 || mine > 0))  // the other's mainloop before this one
                bar_wait(&order[c], (c == 1 ? mine : mine - 1) & 1);
#ifdef GEMM_PROBE_STAGGER  // (dev/cuda/epilogue_trace.py) cooperative: the second warpgroup
            // starts GEMM_PROBE_STAGGER slabs after the first, so that their epilogues part
            if (!PINGPONG && CL == 1 && c == 1 && mine == 0) bar_wait(&order[1], 0);
#endif
            TRACE(1);
            int held = -1;  // the stage the batch in flight reads
            for (int kb = k0; kb < k1; kb++) {
                bar_wait(&full[s], phase);
                if (kb == k0) TRACE(2);
                unsigned char* sa = smem + s * STAGE_BYTES + (PINGPONG ? 0 : c * 64 * 128);
                unsigned char* sb = smem + s * STAGE_BYTES + A_BYTES;
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < GEMM_BK / 16; k++)
#pragma unroll
                    for (int m = 0; m < MT; m++)
                        wgmma_tile<BN, TA, TB>(d[m], slab_desc<TA>(sa + m * 64 * 128, k),
                                               slab_desc<TB>(sb, k), kb > k0 || k > 0);
                wgmma_commit();
                wgmma_wait<1>();  // the previous batch is done: its stage goes back
                if (held >= 0 && t == 0) release<CL>(&empty[held]);
#ifdef GEMM_PROBE_STAGGER
                if (!PINGPONG && CL == 1 && c == 0 && mine == 0 && t == 0 &&
                    kb == min(k1, k0 + GEMM_PROBE_STAGGER) - 1)
                    bar_arrive(&order[1]);
#endif
                held = s;
                if (++s == STAGES) s = 0, phase ^= 1;
            }
            wgmma_wait<0>();
            if (held >= 0 && t == 0) release<CL>(&empty[held]);
            if (PINGPONG && t == 0) bar_arrive(&order[1 - c]);
            mine++;
            TRACE_DONE(3);
            // the accumulators: per 8 columns j, (row, 2 columns) twice, 8 rows
            // apart (ldc 0: none stored, dev/cuda/gemm_check.py's time of the rest)
            if (ldc > 0) {
                // the warpgroup's two staging buffers (the staged epilogues')
                unsigned char* staging = smem + STAGES * STAGE_BYTES + c * 2 * CHUNK;
                if constexpr (EPI == EPI_F32_TMA) {  // (SPLIT: the split's rows of C)
                    store_tile_tma<MT, BN>(d, staging, &maps[2], tn * width,
                                           y0 + (SPLIT ? M * (i % splits) : 0), 1 + c);
                } else if constexpr (EPI == EPI_ROPE) {
                    store_tile_rope<MT, BN, R>(d, staging, &maps[2], tn * width, y0, 1 + c, rc,
                                               rs, rotated);
                } else if constexpr (EPI == EPI_DSWIGLU) {
                    store_tile_dswiglu<MT, BN>(d, dg_in, du_in, staging, &maps[2], tn * width,
                                               y0, 1 + c);
                } else if constexpr (EPI == EPI_BF16_TMA) {
                    store_tile_bf16<MT, BN>(d, staging, &maps[2], tn * width, y0, 1 + c);
                } else if constexpr (EPI == EPI_SWIGLU_TMA || EPI == EPI_SWIGLU_A) {
                    store_tile_swiglu<MT, BN, EPI == EPI_SWIGLU_TMA>(d, staging, &maps[2],
                                                                     tn * width, y0, 1 + c);
                } else {
#pragma unroll
                    for (int m = 0; m < MT; m++)
                        store_tile<BN, EPI>(
                            d[m], tm * BM + (PINGPONG ? m * 64 : c * 64) + warp * 16 + lane / 4,
                            tn * width, M, N, C, ldc, H);
                }
            }
            TRACE_DONE(4);
        }
        // the last stores have read their buffers before the block's memory goes
        if (STAGED && t == 0) bulk_wait_all();
    }
    // no block leaves while its peer may still arrive on its barriers
    if constexpr (CL == 2) cluster_sync();
}

// The down product's dX with the SwiGLU's backward in its epilogue, the
// gate and up products computed again in the same tile (gemm_dswiglu_again):
// nothing of the forward's gate/up product is kept but its operand h.
// A tile is 64*MT rows (ping-pong: one warpgroup's) by BF columns of F;
// each slab of K = d_model brings dres's and h's 64*MT x 64 (A's, K-major),
// W_gu's BF gate and BF up rows (K-major, the forward's SwiGLU tile) and
// W_down's 64 K-rows of the tile's BF columns (N-major, BF/64 boxes: dX =
// dres W_down), and the warpgroup multiplies both: gu (64 x 2BF per 64
// rows: gate, then up) as the forward's gate/up kernel does (wgmma on the
// same slabs in the same K order: the forward's float32 g and u, bit for
// bit; gemm_check and tests/cuda/test_gemm_sm90.py compare them) and da
// (64 x BF). The epilogue is EPI_DSWIGLU's (swiglu_grad on da, g, u in
// registers) and stores dg, du and a as bfloat16 through NBUF staging
// buffers per warpgroup (what room the stages leave).
// maps: dres's and h's (box 64 x 64*MT), W_gu's (2F, K) (box 64 x BF),
// W_down's (K, F) (box 64 x 64), then dgu's gate and up halves' and a's
// (bfloat16, box 64 x 64*MT). N = F.
template <int STAGES, int MT, int BF, int NBUF>
__device__ __forceinline__ void dswiglu_again(const TensorMap* __restrict__ maps, int M, int F,
                                              int K) {
    static_assert(MT * 3 * BF / 2 <= 192 && BF % 64 == 0, "192 accumulators a thread at most");
    constexpr int BM = 64 * MT;
    constexpr int A_BYTES = BM * GEMM_BK * 2;       // dres's slab, then h's
    constexpr int GU_BYTES = 2 * BF * GEMM_BK * 2;  // the gate rows, then the up rows
    constexpr int WD_BYTES = GEMM_BK * BF * 2;      // W_down's 64 K-rows of the tile's columns
    constexpr int STAGE_BYTES = 2 * A_BYTES + GU_BYTES + WD_BYTES;
    constexpr int CHUNK = BM * 128;  // a staging buffer
    constexpr int UP = BF / 8;       // the up columns' first group in gu
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    u64* full = reinterpret_cast<u64*>(smem + STAGES * STAGE_BYTES + 2 * NBUF * CHUNK);
    u64* empty = full + STAGES;
    u64* order = empty + STAGES;
    // the count of tiles, after the barriers (gemm.shared_bytes), which the
    // products' warpgroups read at each tile: in their registers, beside 192
    // accumulators, ptxas spilled it
    volatile int* bound = reinterpret_cast<volatile int*>(order + 2);

    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (F + BF - 1) / BF;
    const int slabs = (K + GEMM_BK - 1) / GEMM_BK, items = tiles_m * tiles_n;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            bar_init(&full[s], 1);
            bar_init(&empty[s], 1);
        }
        bar_init(&order[0], 1);
        bar_init(&order[1], 1);
        *bound = items;
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {  // the loads
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (t == 0) {
            int s = 0;
            unsigned phase = 0;
            for (int i = blockIdx.x; i < items; i += gridDim.x) {
                const int tm = i / tiles_n, tn = i % tiles_n;
                for (int kb = 0; kb < slabs; kb++) {
                    bar_wait(&empty[s], phase ^ 1);
                    bar_expect(&full[s], STAGE_BYTES);
                    unsigned char* sa = smem + s * STAGE_BYTES;
                    unsigned char* sw = sa + 2 * A_BYTES;
                    tma_load(sa, &maps[0], &full[s], kb * GEMM_BK, tm * BM);
                    tma_load(sa + A_BYTES, &maps[1], &full[s], kb * GEMM_BK, tm * BM);
                    tma_load(sw, &maps[2], &full[s], kb * GEMM_BK, tn * BF);
                    tma_load(sw + GU_BYTES / 2, &maps[2], &full[s], kb * GEMM_BK, F + tn * BF);
#pragma unroll
                    for (int j = 0; j < BF / 64; j++)
                        tma_load(sw + GU_BYTES + j * 8192, &maps[3], &full[s], tn * BF + 64 * j,
                                 kb * GEMM_BK);
                    if (++s == STAGES) s = 0, phase ^= 1;
                }
            }
        }
    } else {  // the products, ping-pong (gemm_tn's schedule)
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        const int c = wg - 1;
        float gu[MT][BF], da[MT][BF / 2];
        int s = 0, turn = 0, mine = 0;
        unsigned phase = 0;
        for (int i = blockIdx.x; i < *bound; i += gridDim.x, turn++) {
            if ((turn & 1) != c) {  // the other warpgroup's tile: skip its slabs
                const int at = s + slabs;
                phase ^= (at / STAGES) & 1;
                s = at % STAGES;
                continue;
            }
            const int tm = i / tiles_n, tn = i % tiles_n;
            TRACE(0);
            if (c == 1 || mine > 0) bar_wait(&order[c], (c == 1 ? mine : mine - 1) & 1);
            TRACE(1);
            int held = -1;
            for (int kb = 0; kb < slabs; kb++) {
                bar_wait(&full[s], phase);
                if (kb == 0) TRACE(2);
                unsigned char* sa = smem + s * STAGE_BYTES;
                unsigned char* sw = sa + 2 * A_BYTES;
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < GEMM_BK / 16; k++) {
#pragma unroll
                    for (int m = 0; m < MT; m++)  // g | u = h W_gu^T: the forward's order
                        wgmma_tile<2 * BF, false, false>(
                            gu[m], slab_desc<false>(sa + A_BYTES + m * 8192, k),
                            slab_desc<false>(sw, k), kb > 0 || k > 0);
#pragma unroll
                    for (int m = 0; m < MT; m++) {  // da = dres W_down
                        if constexpr (BF == 64)
                            wgmma_n64<false, true>(da[m], slab_desc<false>(sa + m * 8192, k),
                                                   slab_desc<true>(sw + GU_BYTES, k),
                                                   kb > 0 || k > 0);
                        else
                            wgmma_tile<BF, false, true>(da[m], slab_desc<false>(sa + m * 8192, k),
                                                        slab_desc<true>(sw + GU_BYTES, k),
                                                        kb > 0 || k > 0);
                    }
                }
                wgmma_commit();
                wgmma_wait<1>();
                if (held >= 0 && t == 0) bar_arrive(&empty[held]);
                held = s;
                if (++s == STAGES) s = 0, phase ^= 1;
            }
            // every product issued: the other warpgroup's turn. Then the last slab
            // back, and the SwiGLU backward computed in the first chunks' fill: with
            // it in a loop of its own before them, ptxas (its fast sigmoid) moved
            // both arrivals below it, and the other warpgroup's products waited for
            // it (dev/cuda/NOTES.md, "The sigmoid"; dev/cuda/arrive_check.py)
            if (t == 0) bar_arrive(&order[1 - c]);
            wgmma_wait<0>();
            if (held >= 0 && t == 0) bar_arrive(&empty[held]);
            mine++;
            TRACE_DONE(3);
            constexpr int PER = BF / 64;  // chunks of each output
            unsigned char* staging = smem + STAGES * STAGE_BYTES + c * NBUF * CHUNK;
            staged<MT, 3 * PER, NBUF>(
                staging, 1 + c,
                [&](int q, unsigned char* buf) {
                    const int which = q / PER, j0 = 8 * (q % PER);
                    fill_bf16<MT>(buf, [&](int m, int jj, int h) {
                        if (which == 0) {  // dg stored; du into g's registers, a into u's
                            float dg[2];
#pragma unroll
                            for (int e = 0; e < 2; e++) {
                                const int x = 4 * (j0 + jj) + 2 * h + e;
                                swiglu_grad(da[m][x], gu[m][x], gu[m][x + 4 * UP], dg[e],
                                            gu[m][x], gu[m][x + 4 * UP]);
                            }
                            return make_float2(dg[0], dg[1]);
                        }
                        const int j = j0 + jj + (which == 2 ? UP : 0);  // du's groups, a's
                        return make_float2(gu[m][4 * j + 2 * h], gu[m][4 * j + 2 * h + 1]);
                    });
                },
                [&](int q, unsigned char* buf) {
                    tma_store(&maps[4 + q / PER], buf, tn * BF + 64 * (q % PER), tm * BM);
                });
            TRACE_DONE(4);
        }
        if (t == 0) bulk_wait_all();
    }
}

// The split products' sum: C (M, N) = the splits' partials, ws (splits, M, N)
// float32 packed, added in split order (a fixed order: a replay gives the
// same bits); N a multiple of 4, four columns a thread.
extern "C" __global__ void gemm_splitk_reduce(const float* __restrict__ ws, float* __restrict__ C,
                                              int M, int N, int ldc, int splits) {
    AFTER_PRIOR_GRIDS();
    const long long quads = (long long)M * N / 4;
    for (long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x; q < quads;
         q += (long long)gridDim.x * blockDim.x) {
        float4 acc = reinterpret_cast<const float4*>(ws)[q];
        for (int s = 1; s < splits; s++) {
            const float4 p = reinterpret_cast<const float4*>(ws)[s * quads + q];
            acc = make_float4(__fadd_rn(acc.x, p.x), __fadd_rn(acc.y, p.y), __fadd_rn(acc.z, p.z),
                              __fadd_rn(acc.w, p.w));
        }
        const long long e = 4 * q;
        *reinterpret_cast<float4*>(C + (e / N) * ldc + e % N) = acc;
    }
}

// the instantiations (gemm.py: VARIANTS): c cooperative, p ping-pong, c2 and
// p2 in clusters of two; m the 64-row blocks of a warpgroup's tile, n the
// tile's columns, s the stages; kn and mn the backward's layouts (above);
// f32 / f32t / bf16t float32 from registers, float32 or bfloat16 operands
// through the copy engine
#define GEMM_PARAMETERS                                                                    \
    const TensorMap *__restrict__ maps, int M, int N, int K, float *__restrict__ C, int ldc,  \
        unsigned short *__restrict__ H, const float *__restrict__ cs,                         \
        const float *__restrict__ sn, int T, int rotated
#define GEMM_KERNEL(NAME, MT, BN, STAGES, EPI, PINGPONG)                                      \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) NAME(GEMM_PARAMETERS) {     \
        AFTER_PRIOR_GRIDS();                                                                  \
        gemm_tn<MT, BN, STAGES, EPI, PINGPONG, 1>(maps, M, N, K, C, ldc, H, cs, sn, T,        \
                                                  rotated);                                   \
    }
#define GEMM_KERNEL_PAIR(NAME, MT, BN, STAGES, EPI, PINGPONG)                                 \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) __cluster_dims__(2, 1, 1)   \
        NAME(GEMM_PARAMETERS) {                                                               \
        AFTER_PRIOR_GRIDS();                                                                  \
        gemm_tn<MT, BN, STAGES, EPI, PINGPONG, 2>(maps, M, N, K, C, ldc, H, cs, sn, T,        \
                                                  rotated);                                   \
    }
#define GEMM_KERNEL_ROPE(NAME, MT, BN, STAGES, PINGPONG, R)                                   \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) NAME(GEMM_PARAMETERS) {     \
        AFTER_PRIOR_GRIDS();                                                                  \
        gemm_tn<MT, BN, STAGES, EPI_ROPE, PINGPONG, 1, R>(maps, M, N, K, C, ldc, H, cs, sn,   \
                                                          T, rotated);                        \
    }

// the backward's layouts: kn (B N-major, dX = dY W), mn (A M-major too, dW = dY^T X)
#define GEMM_KERNEL_T(NAME, MT, BN, STAGES, EPI, PINGPONG, TA)                                \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) NAME(GEMM_PARAMETERS) {     \
        AFTER_PRIOR_GRIDS();                                                                  \
        gemm_tn<MT, BN, STAGES, EPI, PINGPONG, 1, 0, TA, true>(maps, M, N, K, C, ldc, H, cs,  \
                                                              sn, T, rotated);                \
    }

// the weight gradients with K split (SPLIT, above): rotated carries the splits
#define GEMM_KERNEL_SPLIT(NAME, MT, BN, STAGES, PINGPONG)                                     \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) NAME(GEMM_PARAMETERS) {     \
        AFTER_PRIOR_GRIDS();                                                                  \
        gemm_tn<MT, BN, STAGES, EPI_F32_TMA, PINGPONG, 1, 0, true, true, true>(               \
            maps, M, N, K, C, ldc, H, cs, sn, T, rotated);                                     \
    }

// the SwiGLU backward with the gate/up product again (dswiglu_again: its tiles
// 64*MT rows, ping-pong, by BF columns of F; NBUF staging buffers)
#define GEMM_KERNEL_AGAIN(NAME, MT, BF, STAGES, NBUF)                                         \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) NAME(GEMM_PARAMETERS) {     \
        AFTER_PRIOR_GRIDS();                                                                  \
        dswiglu_again<STAGES, MT, BF, NBUF>(maps, M, N, K);                                   \
    }

GEMM_KERNEL(gemm_f32_c_n256_s4, 1, 256, 4, EPI_F32, false)
GEMM_KERNEL(gemm_f32_c_n128_s6, 1, 128, 6, EPI_F32, false)
GEMM_KERNEL(gemm_f32_p_m2n128_s6, 2, 128, 6, EPI_F32, true)
GEMM_KERNEL(gemm_f32_p_m1n128_s8, 1, 128, 8, EPI_F32, true)
GEMM_KERNEL_PAIR(gemm_f32_c2_n256_s4, 1, 256, 4, EPI_F32, false)
GEMM_KERNEL_PAIR(gemm_f32_c2_n128_s6, 1, 128, 6, EPI_F32, false)
GEMM_KERNEL_PAIR(gemm_f32_p2_m2n128_s6, 2, 128, 6, EPI_F32, true)
GEMM_KERNEL(gemm_f32t_c_n256_s4, 1, 256, 4, EPI_F32_TMA, false)
GEMM_KERNEL(gemm_f32t_c_n128_s6, 1, 128, 6, EPI_F32_TMA, false)
GEMM_KERNEL(gemm_f32t_p_m2n128_s4, 2, 128, 4, EPI_F32_TMA, true)
GEMM_KERNEL(gemm_f32t_p_m1n256_s4, 1, 256, 4, EPI_F32_TMA, true)
GEMM_KERNEL(gemm_swiglu_c_n256_s4, 1, 256, 4, EPI_SWIGLU, false)
GEMM_KERNEL(gemm_swiglu_c_n128_s6, 1, 128, 6, EPI_SWIGLU, false)
GEMM_KERNEL_PAIR(gemm_swiglu_c2_n256_s4, 1, 256, 4, EPI_SWIGLU, false)
GEMM_KERNEL_PAIR(gemm_swiglu_c2_n128_s6, 1, 128, 6, EPI_SWIGLU, false)
GEMM_KERNEL_PAIR(gemm_swiglu_p2_m2n128_s6, 2, 128, 6, EPI_SWIGLU, true)
GEMM_KERNEL(gemm_swiglut_c_n128_s6, 1, 128, 6, EPI_SWIGLU_TMA, false)
GEMM_KERNEL(gemm_swiglut_c_n256_s4, 1, 256, 4, EPI_SWIGLU_TMA, false)
GEMM_KERNEL(gemm_swiglut_p_m2n128_s4, 2, 128, 4, EPI_SWIGLU_TMA, true)
GEMM_KERNEL(gemm_swiglut_p_m1n256_s4, 1, 256, 4, EPI_SWIGLU_TMA, true)
GEMM_KERNEL(gemm_swiglua_p_m2n128_s4, 2, 128, 4, EPI_SWIGLU_A, true)
GEMM_KERNEL(gemm_swiglua_p_m1n256_s4, 1, 256, 4, EPI_SWIGLU_A, true)
GEMM_KERNEL(gemm_swiglua_c_n256_s4, 1, 256, 4, EPI_SWIGLU_A, false)
GEMM_KERNEL_ROPE(gemm_rope64_c_n128_s6, 1, 128, 6, false, 64)
GEMM_KERNEL_ROPE(gemm_rope128_c_n128_s6, 1, 128, 6, false, 128)
GEMM_KERNEL_ROPE(gemm_rope64_p_m1n256_s4, 1, 256, 4, true, 64)
GEMM_KERNEL_ROPE(gemm_rope128_p_m1n128_s6, 1, 128, 6, true, 128)
GEMM_KERNEL_ROPE(gemm_rope128_p_m1n256_s4, 1, 256, 4, true, 128)
GEMM_KERNEL_T(gemm_f32t_kn_c_n128_s6, 1, 128, 6, EPI_F32_TMA, false, false)
GEMM_KERNEL_T(gemm_f32t_kn_p_m2n128_s4, 2, 128, 4, EPI_F32_TMA, true, false)
GEMM_KERNEL_T(gemm_bf16t_kn_p_m2n128_s4, 2, 128, 4, EPI_BF16_TMA, true, false)
GEMM_KERNEL_T(gemm_f32t_mn_p_m1n128_s6, 1, 128, 6, EPI_F32_TMA, true, true)
GEMM_KERNEL_T(gemm_dswiglu_kn_p_m1n128_s6, 1, 128, 6, EPI_DSWIGLU, true, false)
GEMM_KERNEL_SPLIT(gemm_f32t_mn_p_m1n128_s6_splitk, 1, 128, 6, true)
GEMM_KERNEL_AGAIN(gemm_dswiglu_again_p_m2n64_s3, 2, 64, 3, 1)
GEMM_KERNEL_AGAIN(gemm_dswiglu_again_p_m1n128_s3, 1, 128, 3, 2)
