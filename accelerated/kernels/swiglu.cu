// ---------------------------------------------------------------- swiglu

// Row-wise 2-D grids as rope's. vec (F a multiple of 4, pointers 16-byte
// aligned): a thread takes a chunk of 4 features (16-byte loads of g and u,
// one chunk store); else one feature.

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// gu (BT,2F): gate then up projections -> a (BT,F) = silu(g) * u operand
extern "C" __global__ void swiglu_forward(const float* __restrict__ gu, floatX* __restrict__ a,
                                          int BT, int F, int vec) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= (vec ? F / 4 : F)) return;
    for (int r = blockIdx.y; r < BT; r += gridDim.y) {
        const float* row = gu + (long long)r * 2 * F;
        floatX* out = a + (long long)r * F;
        if (vec) {
            float g[4], u[4], y[4];
            load_chunk(g, row, c, F, true, 0.0f);
            load_chunk(u, row + F, c, F, true, 0.0f);
#pragma unroll
            for (int i = 0; i < 4; i++) y[i] = __fmul_rn(__fmul_rn(g[i], sigmoid(g[i])), u[i]);
            store_operand_chunk(out, c, F, true, y);
        } else {
            float g = row[c], u = row[F + c];
            out[c] = to_operand(__fmul_rn(__fmul_rn(g, sigmoid(g)), u));
        }
    }
}

// da (BT,F) -> dgu (BT,2F) operands: dg then du
//   du = da * g * sig,  dg = da * u * (sig + g * sig * (1 - sig))
__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du) {
    float sig = sigmoid(g);
    du = __fmul_rn(__fmul_rn(d, g), sig);
    float gs = __fmul_rn(g, sig);
    dg = __fmul_rn(__fmul_rn(d, u), __fadd_rn(sig, __fmul_rn(gs, __fsub_rn(1.0f, sig))));
}

extern "C" __global__ void swiglu_backward(const float* __restrict__ da,
                                           const float* __restrict__ gu, floatX* __restrict__ dgu,
                                           int BT, int F, int vec) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= (vec ? F / 4 : F)) return;
    for (int r = blockIdx.y; r < BT; r += gridDim.y) {
        const float* row = gu + (long long)r * 2 * F;
        const float* drow = da + (long long)r * F;
        floatX* out = dgu + (long long)r * 2 * F;
        if (vec) {
            float g[4], u[4], d[4], dg[4], du[4];
            load_chunk(g, row, c, F, true, 0.0f);
            load_chunk(u, row + F, c, F, true, 0.0f);
            load_chunk(d, drow, c, F, true, 0.0f);
#pragma unroll
            for (int i = 0; i < 4; i++) swiglu_grad(d[i], g[i], u[i], dg[i], du[i]);
            store_operand_chunk(out, c, F, true, dg);
            store_operand_chunk(out + F, c, F, true, du);
        } else {
            float dg, du;
            swiglu_grad(drow[c], row[c], row[F + c], dg, du);
            out[c] = to_operand(dg);
            out[F + c] = to_operand(du);
        }
    }
}
