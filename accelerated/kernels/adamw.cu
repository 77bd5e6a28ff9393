// ---------------------------------------------------------------- AdamW

// c = float32(1 - beta^t), computed in float64 (SPEC 7)
__device__ __forceinline__ float bias_correction(double beta, int t) {
    return (float)(1.0 - pow(beta, (double)t));
}

// One thread: advance the device update count t and compute c1, c2 for the
// new t, and read a_t, b_t (lr and lr * weight_decay under the schedule) from
// the host's table, row min(t, rows - 1) (SPEC 7). Inside the graph, so a
// replay needs nothing from the host. c = (c1, c2, a_t, b_t).
extern "C" __global__ void adamw_bias_corrections(int* t, float* c, double beta1, double beta2,
                                                  const float* rates, int rows) {
    int tn = t[0] + 1;
    t[0] = tn;
    c[0] = bias_correction(beta1, tn);
    c[1] = bias_correction(beta2, tn);
    int row = tn < rows - 1 ? tn : rows - 1;
    c[2] = rates[2 * row];
    c[3] = rates[2 * row + 1];
}

// The gradient norm (SPEC 7), in two fixed-order passes so that every replay
// gives the same bits: each of gridDim.x blocks sums the squares of a strided
// set of G's elements into partial[block]; then one block sums the partials.
extern "C" __global__ void gradient_sum_squares(const float* G, long long n, float* partial) {
    __shared__ float red[32];
    float s = 0.0f;
    // float4 loads (G is a pool allocation, 256-byte aligned): the pass is
    // bound by reading G once, and wide loads keep more bytes in flight
    const float4* G4 = reinterpret_cast<const float4*>(G);
    long long n4 = n / 4;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (long long)gridDim.x * blockDim.x) {
        float4 g = G4[i];
        s = fmaf(g.x, g.x, s);
        s = fmaf(g.y, g.y, s);
        s = fmaf(g.z, g.z, s);
        s = fmaf(g.w, g.w, s);
    }
    if (blockIdx.x == 0) {  // the last n % 4 elements
        for (long long i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) s = fmaf(G[i], G[i], s);
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// norm = (n, scale): n = sqrt(sum of the partials); scale = float32(c / n)
// where clipping is on (clip > 0) and n > c, else 1 (a non-finite n never
// clips; the run stops on it). Multiplying by 1 is exact: unclipped steps
// keep their bits.
extern "C" __global__ void gradient_norm_clip(const float* partial, int blocks, float* norm,
                                              float clip) {
    __shared__ float red[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < blocks; i += blockDim.x) s += partial[i];
    s = block_sum(s, red);
    if (threadIdx.x == 0) {
        float n = __fsqrt_rn(s);
        norm[0] = n;
        norm[1] = (clip > 0.0f && isfinite(n) && n > clip) ? __fdiv_rn(clip, n) : 1.0f;
    }
}

// c1, c2 for n given update counts (the check of bias_correction)
extern "C" __global__ void adamw_bias_corrections_table(const int* ts, float* c1, float* c2,
                                                        int n, double beta1, double beta2) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    c1[i] = bias_correction(beta1, ts[i]);
    c2[i] = bias_correction(beta2, ts[i]);
}

// SPEC 7, elementwise, each float32 operation rounded as the reference's:
//   g = G scale (clipping) ; m = b1 m + (1-b1) g ; v = b2 v + (1-b2) g g ;
//   p -= b_t p (decay only) ; p -= a_t (m / c1) / (sqrt(v / c2) + eps)
// c = (c1, c2, a_t, b_t) and norm[1] = scale come from the kernels above.
// Under bf16 the new parameters are also written as bfloat16 operands (Pb),
// so the next step's products need no rounding pass over P.
extern "C" __global__ void adamw_update(float* P, float* M, float* Vm, const float* G,
                                        const unsigned char* decay, unsigned short* Pb,
                                        const float* c, const float* norm, long long n,
                                        float b1, float omb1, float b2, float omb2, float eps) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float c1 = c[0], c2 = c[1], lr = c[2], lrwd = c[3];
    float g = __fmul_rn(G[i], norm[1]);
    float m = __fadd_rn(__fmul_rn(b1, M[i]), __fmul_rn(omb1, g));
    float v = __fadd_rn(__fmul_rn(b2, Vm[i]), __fmul_rn(__fmul_rn(omb2, g), g));
    float p = P[i];
    if (decay[i]) p = __fsub_rn(p, __fmul_rn(lrwd, p));
    float step = __fdiv_rn(__fmul_rn(lr, __fdiv_rn(m, c1)),
                           __fadd_rn(__fsqrt_rn(__fdiv_rn(v, c2)), eps));
    p = __fsub_rn(p, step);
    P[i] = p;
    M[i] = m;
    Vm[i] = v;
    if (Pb != 0) Pb[i] = bf16_bits(p);
}

// Gradient accumulation (SPEC 19): G += Gm, elementwise, one float32 add
// (the reference's G = G + g, left to right over the micro-batches).
extern "C" __global__ void accumulate_gradient(float* G, const float* Gm, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) G[i] = __fadd_rn(G[i], Gm[i]);
}
