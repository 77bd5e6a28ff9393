#ifdef OPERAND_BF16
typedef unsigned short floatX;  // bfloat16 bits
#else
typedef float floatX;
#endif

#define NEG_INF __int_as_float(0xff800000)

// float32 -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN,
// a value past the largest bfloat16 rounds to infinity (as ml_dtypes does)
__device__ __forceinline__ unsigned short bf16_bits(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
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
