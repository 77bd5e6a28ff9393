// ---------------------------------------------------------------- after cuDNN's attention

// cuDNN's attention backward writes dq and dk as bfloat16 operands (dqk
// (BT,2D), heads side by side): the rope backward of rope.cu on that input,
// widened exactly to float32 -> dqkv[:, :2D] (row stride 3D) operands.
__device__ __forceinline__ float operand_value(floatX x) {
#ifdef OPERAND_BF16
    return __uint_as_float(((unsigned int)x) << 16);
#else
    return x;
#endif
}

extern "C" __global__ void rope_backward_operand(const floatX* __restrict__ dqk,
                                                 floatX* __restrict__ dqkv,
                                                 const float* __restrict__ cos_t,
                                                 const float* __restrict__ sin_t, int BT, int T,
                                                 int D, int H) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= 2 * D) return;
    int E = D / H, half = E / 2, e = col % E;
    int head = col - e;
    int j = e < half ? e : e - half;
    for (int row = blockIdx.y; row < BT; row += gridDim.y) {
        const floatX* g = dqk + (long long)row * 2 * D;
        int t = row % T;
        float d1 = operand_value(g[head + j]), d2 = operand_value(g[head + j + half]);
        float c = cos_t[t * half + j], s = sin_t[t * half + j];
        float v = e < half ? __fadd_rn(__fmul_rn(d1, c), __fmul_rn(d2, s))
                           : __fsub_rn(__fmul_rn(d2, c), __fmul_rn(d1, s));
        dqkv[(long long)row * 3 * D + col] = to_operand(v);
    }
}
