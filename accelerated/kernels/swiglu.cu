// ---------------------------------------------------------------- swiglu

// gu (BT,2F): gate then up projections -> a (BT,F) = silu(g) * u operand
extern "C" __global__ void swiglu_forward(const float* __restrict__ gu, floatX* __restrict__ a,
                                          int BT, int F) {
    int f = blockIdx.x * blockDim.x + threadIdx.x;
    if (f >= F) return;
    for (int r = blockIdx.y; r < BT; r += gridDim.y) {
        const float* row = gu + (long long)r * 2 * F;
        float g = row[f], u = row[F + f];
        float sig = 1.0f / (1.0f + expf(-g));
        a[(long long)r * F + f] = to_operand(__fmul_rn(__fmul_rn(g, sig), u));
    }
}

// da (BT,F) -> dgu (BT,2F) operands: dg then du
//   du = da * g * sig,  dg = da * u * (sig + g * sig * (1 - sig))
extern "C" __global__ void swiglu_backward(const float* __restrict__ da,
                                           const float* __restrict__ gu, floatX* __restrict__ dgu,
                                           int BT, int F) {
    int f = blockIdx.x * blockDim.x + threadIdx.x;
    if (f >= F) return;
    for (int r = blockIdx.y; r < BT; r += gridDim.y) {
        const float* row = gu + (long long)r * 2 * F;
        float g = row[f], u = row[F + f];
        float sig = 1.0f / (1.0f + expf(-g));
        float d = da[(long long)r * F + f];
        float du = __fmul_rn(__fmul_rn(d, g), sig);
        float gs = __fmul_rn(g, sig);
        float dg = __fmul_rn(__fmul_rn(d, u), __fadd_rn(sig, __fmul_rn(gs, __fsub_rn(1.0f, sig))));
        dgu[(long long)r * 2 * F + f] = to_operand(dg);
        dgu[(long long)r * 2 * F + F + f] = to_operand(du);
    }
}
