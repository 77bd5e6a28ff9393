#ifdef OPERAND_BF16
typedef unsigned short floatX;  // bfloat16 bits
#else
typedef float floatX;
#endif

#define NEG_INF __int_as_float(0xff800000)

// Programmatic dependent launch (accelerated/cuda/dependent_launch.py): on
// sm_90 and later every kernel of the project is launched allowed to start
// while the kernel before it in the stream still runs. This, each kernel's
// first statement, waits until that kernel has completed and its writes
// are visible (and so every kernel before it: each waited the same way),
// then lets the next kernel's blocks be launched: they wait here in turn,
// so nothing any kernel reads or writes moves past its predecessor's end;
// what overlaps is the launch and the blocks' placement, the gaps between
// kernels. Before sm_90 (and launched without the attribute) it is nothing.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define AFTER_PRIOR_GRIDS() \
    asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define AFTER_PRIOR_GRIDS()
#endif

// float32 -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN,
// a value past the largest bfloat16 rounds to infinity (as ml_dtypes does)
__device__ __forceinline__ unsigned short bf16_bits(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// two bfloat16 bits in one word, lo in the low half: the same rounding as
// bf16_bits (to nearest even, past the largest to infinity; a NaN stays a
// NaN, its payload not kept), one instruction on sm_80 and later
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned u;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(u) : "f"(hi), "f"(lo));
    return u;
#else
    return (unsigned)bf16_bits(lo) | ((unsigned)bf16_bits(hi) << 16);
#endif
}

__device__ __forceinline__ floatX to_operand(float x) {
#ifdef OPERAND_BF16
    return bf16_bits(x);
#else
    return x;
#endif
}

// butterfly sums leave lanes with differently ordered sums: broadcast lane 0's
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return __shfl_sync(0xffffffffu, v, 0);
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// sum over the block (blockDim.x a multiple of 32); every thread gets the
// same value. red: 32 floats of shared memory.
__device__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // red may still be read by a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? red[lane] : 0.0f);
}

__device__ float block_max(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? red[lane] : NEG_INF);
}

// ---------------------------------------------------------------- vector access
// A "chunk" is 4 consecutive elements. The bandwidth-bound kernels move a
// chunk with one 16-byte load or store (float4; 8 bytes for 4 bfloat16
// operands) where the launcher found every pointer 16-byte aligned and the
// row length a multiple of 4 (`vec`); else element by element, the same
// values in the same order, with a bound on each element (n: the row's
// length). Either way a thread owns whole chunks, so in-place updates (dx
// over dres) read each element before writing it.

__device__ __forceinline__ void load_chunk(float (&a)[4], const float* row, int c, int n,
                                           bool vec, float fill) {
    if (vec) {
        float4 v = *reinterpret_cast<const float4*>(row + 4 * c);
        a[0] = v.x;
        a[1] = v.y;
        a[2] = v.z;
        a[3] = v.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++) a[i] = 4 * c + i < n ? row[4 * c + i] : fill;
    }
}

__device__ __forceinline__ void store_chunk(float* row, int c, int n, bool vec,
                                            const float (&a)[4]) {
    if (vec) {
        *reinterpret_cast<float4*>(row + 4 * c) = make_float4(a[0], a[1], a[2], a[3]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (4 * c + i < n) row[4 * c + i] = a[i];
    }
}

// four operands (rounded to bfloat16 under bf16: one 8-byte store)
__device__ __forceinline__ void store_operand_chunk(floatX* row, int c, int n, bool vec,
                                                    const float (&a)[4]) {
#ifdef OPERAND_BF16
    if (vec) {
        uint2 u;
        u.x = pack_bf16x2(a[0], a[1]);
        u.y = pack_bf16x2(a[2], a[3]);
        *reinterpret_cast<uint2*>(row + 4 * c) = u;
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (4 * c + i < n) row[4 * c + i] = bf16_bits(a[i]);
    }
#else
    store_chunk(row, c, n, vec, a);
#endif
}

// ---------------------------------------------------------------- the gradient
// G is the registry's flat vector of N float32 elements, stored in S
// segments (the step's: one per layer, the embedding's and the final
// norm's, each a buffer of its own in the memory plan's arena, live from
// its first gradient to AdamW; or one segment, a flat buffer). gseg
// (S, 2): each segment's first element and device address, by first
// element. The address of element j: in the last segment starting at or
// before j, found by bisection (every thread of a block looks up the same
// few entries, from the L1 cache).
__device__ __forceinline__ float* grad_at(const long long* __restrict__ gseg, int S,
                                          long long j) {
    int lo = 0, hi = S - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (gseg[2 * mid] <= j) lo = mid;
        else hi = mid - 1;
    }
    return reinterpret_cast<float*>(gseg[2 * lo + 1]) + (j - gseg[2 * lo]);
}
