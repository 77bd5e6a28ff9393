// ---------------------------------------------------------------- swiglu

// Row-wise 2-D grids as rope's. vec (F a multiple of 4, pointers 16-byte
// aligned): a thread takes a chunk of 4 features (16-byte loads of g and u,
// one chunk store); else one feature.

// sigmoid(g) = 1 / (1 + exp(-g)), one body for every SwiGLU kernel and
// epilogue (the backward's recomputation of a is the forward's bits). With
// bfloat16 operands every use rounds its result to one, and the fast
// exponential and division (a few units of float32's last place, 2^-24
// each, against bfloat16's 2^-8) change a few in a million of them by one
// unit; the IEEE division held the gate/up product's epilogue to 54 us a
// layer at B = 8, 37 with these (dev/cuda/NOTES.md, "The sigmoid"). Float32 operands
// keep the accurate forms, and so does a build with SIGMOID_EXACT defined
// (dev/cuda/side_by_side.py sigmoid).
#if defined(OPERAND_BF16) && !defined(SIGMOID_EXACT)
__device__ __forceinline__ float sigmoid(float g) { return __fdividef(1.0f, 1.0f + __expf(-g)); }
#else
__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }
#endif

// silu(g) * u = (g * sig) * u, sig = sigmoid(g): the forward's value, and
// the backward's recomputation of it (the same operations: the same bits)
__device__ __forceinline__ float swiglu_value(float g, float sig, float u) {
    return __fmul_rn(__fmul_rn(g, sig), u);
}

// gu (BT,2F): gate then up projections -> a (BT,F) = silu(g) * u operand
extern "C" __global__ void swiglu_forward(const float* __restrict__ gu, floatX* __restrict__ a,
                                          int BT, int F, int vec) {
    AFTER_PRIOR_GRIDS();
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
            for (int i = 0; i < 4; i++) y[i] = swiglu_value(g[i], sigmoid(g[i]), u[i]);
            store_operand_chunk(out, c, F, true, y);
        } else {
            float g = row[c], u = row[F + c];
            out[c] = to_operand(swiglu_value(g, sigmoid(g), u));
        }
    }
}

// da (BT,F) -> dgu (BT,2F) operands: dg then du
//   du = da * g * sig,  dg = da * u * (sig + g * sig * (1 - sig))
// and h = silu(g) * u, recomputed as the forward computes it
__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du,
                                            float& h) {
    float sig = sigmoid(g);
    du = __fmul_rn(__fmul_rn(d, g), sig);
    float gs = __fmul_rn(g, sig);
    dg = __fmul_rn(__fmul_rn(d, u), __fadd_rn(sig, __fmul_rn(gs, __fsub_rn(1.0f, sig))));
    h = swiglu_value(g, sig, u);
}

// The step keeps one a (BT,F) for every layer (the forward's is read at once
// by the down product): the backward writes the forward's operand again into
// a, for the down weight's gradient, which is read after this kernel. a may
// be null (not written).
extern "C" __global__ void swiglu_backward(const float* __restrict__ da,
                                           const float* __restrict__ gu, floatX* __restrict__ dgu,
                                           floatX* __restrict__ a, int BT, int F, int vec) {
    AFTER_PRIOR_GRIDS();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= (vec ? F / 4 : F)) return;
    for (int r = blockIdx.y; r < BT; r += gridDim.y) {
        const float* row = gu + (long long)r * 2 * F;
        const float* drow = da + (long long)r * F;
        floatX* out = dgu + (long long)r * 2 * F;
        if (vec) {
            float g[4], u[4], d[4], dg[4], du[4], h[4];
            load_chunk(g, row, c, F, true, 0.0f);
            load_chunk(u, row + F, c, F, true, 0.0f);
            load_chunk(d, drow, c, F, true, 0.0f);
#pragma unroll
            for (int i = 0; i < 4; i++) swiglu_grad(d[i], g[i], u[i], dg[i], du[i], h[i]);
            store_operand_chunk(out, c, F, true, dg);
            store_operand_chunk(out + F, c, F, true, du);
            if (a != 0) store_operand_chunk(a + (long long)r * F, c, F, true, h);
        } else {
            float dg, du, h;
            swiglu_grad(drow[c], row[c], row[F + c], dg, du, h);
            out[c] = to_operand(dg);
            out[F + c] = to_operand(du);
            if (a != 0) a[(long long)r * F + c] = to_operand(h);
        }
    }
}
