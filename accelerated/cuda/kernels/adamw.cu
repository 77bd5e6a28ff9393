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
    AFTER_PRIOR_GRIDS();
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
// G: S segments (gseg, grad_at). Item i < n4: elements 4i .. 4i+3, one
// 16-byte load (the launcher found every segment's start a multiple of 4 and
// its address 16-byte aligned; else n4 = 0), then the n - 4 n4 elements left
// one by one: the pass is bound by reading G once. Four loads are issued
// before their sums (the order of the sums is the loop's), to keep bytes in
// flight.
extern "C" __global__ void gradient_sum_squares(const long long* __restrict__ gseg, int S,
                                                long long n, long long n4,
                                                float* __restrict__ partial) {
    AFTER_PRIOR_GRIDS();
    __shared__ float red[32];
    float s = 0.0f;
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n4; i += 4 * stride) {
        float4 g[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            g[k] = *reinterpret_cast<const float4*>(grad_at(gseg, S, 4 * (i + k * stride)));
#pragma unroll
        for (int k = 0; k < 4; k++) {
            s = fmaf(g[k].x, g[k].x, s);
            s = fmaf(g[k].y, g[k].y, s);
            s = fmaf(g[k].z, g[k].z, s);
            s = fmaf(g[k].w, g[k].w, s);
        }
    }
    for (; i < n4; i += stride) {
        float4 g = *reinterpret_cast<const float4*>(grad_at(gseg, S, 4 * i));
        s = fmaf(g.x, g.x, s);
        s = fmaf(g.y, g.y, s);
        s = fmaf(g.z, g.z, s);
        s = fmaf(g.w, g.w, s);
    }
    // the elements from 4 n4 on, one by one
    for (long long j = 4 * n4 + (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n;
         j += stride) {
        float g = *grad_at(gseg, S, j);
        s = fmaf(g, g, s);
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
    AFTER_PRIOR_GRIDS();
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
    AFTER_PRIOR_GRIDS();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    c1[i] = bias_correction(beta1, ts[i]);
    c2[i] = bias_correction(beta2, ts[i]);
}

// SPEC 7, elementwise, each float32 operation rounded as the reference's:
//   g = G scale (clipping) ; m = b1 m + (1-b1) g ; v = b2 v + (1-b2) g g ;
//   p -= b_t p (decay only) ; p -= a_t (m / c1) / (sqrt(v / c2) + eps)
// c = (c1, c2, a_t, b_t) and norm[1] = scale come from the kernels above.
struct AdamW {
    float c1, c2, lr, lrwd, scale, b1, omb1, b2, omb2, eps;

    __device__ __forceinline__ void update(float& p, float& m, float& v, float g,
                                           bool decay) const {
        g = __fmul_rn(g, scale);
        m = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(omb1, g));
        v = __fadd_rn(__fmul_rn(b2, v), __fmul_rn(__fmul_rn(omb2, g), g));
        if (decay) p = __fsub_rn(p, __fmul_rn(lrwd, p));
        float step = __fdiv_rn(__fmul_rn(lr, __fdiv_rn(m, c1)),
                               __fadd_rn(__fsqrt_rn(__fdiv_rn(v, c2)), eps));
        p = __fsub_rn(p, step);
    }
};

// Weight decay: decay (R, 2) holds the decayed elements as R sorted,
// disjoint [start, end) runs (Registry.decay_ranges: one per run of adjacent
// matrices, 2L+1 of them), a few hundred bytes instead of a byte per
// parameter. The first run that ends after element j, by bisection (R: none);
// every thread of a block looks up the same few entries, from the L1 cache.
__device__ __forceinline__ int decay_run(const long long* __restrict__ decay, int R,
                                         long long j) {
    int lo = 0, hi = R;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (decay[2 * mid + 1] <= j) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// Whether element j decays, r the first run that ends after some element
// <= j (advanced past the runs that end at or before j)
__device__ __forceinline__ bool decays(const long long* __restrict__ decay, int R, int& r,
                                       long long j) {
    while (r < R && decay[2 * r + 1] <= j) r++;
    return r < R && decay[2 * r] <= j;
}

// Under bf16 the new parameters are also written as bfloat16 operands (Pb),
// so the next step's products need no rounding pass over P. Item i < n4:
// chunk i of every vector (16-byte loads and stores; 8 bytes of Pb); then
// one item per element from 4 * n4 on (n4 = 0: every element alone). G:
// S segments (gseg, grad_at). The pass moves about 30 bytes per parameter:
// bandwidth-bound.
//
// Sharded optimizer state (SPEC 23): the vectors are one shard's, from
// element `base` of the parameter vector on (P, Pb the shard's slice, M, V
// and G the shard's own); the decay runs are the whole vector's, looked up
// at base + j. base = 0: the whole vector.
//
// With `partial` (clipping off: the norm is only recorded, and the scale is
// 1) the pass also sums the squares of the G it reads, in float32 (SPEC 7:
// any order), each block's into partial[block], and gradient_norm_clip
// finishes the norm after it: no pass over G of its own.
extern "C" __global__ void adamw_update(float* __restrict__ P, float* __restrict__ M,
                                        float* __restrict__ Vm,
                                        const long long* __restrict__ gseg, int S,
                                        const long long* __restrict__ decay, int R,
                                        long long base, unsigned short* __restrict__ Pb,
                                        const float* __restrict__ c,
                                        const float* __restrict__ norm, long long n,
                                        long long n4, float b1, float omb1, float b2, float omb2,
                                        float eps, float* __restrict__ partial) {
    AFTER_PRIOR_GRIDS();
    __shared__ float red[32];
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    float s = 0.0f;  // the squares of this thread's g (with partial)
    if (i < n4 + (n - 4 * n4)) {
        AdamW k = {c[0], c[1], c[2], c[3], partial != 0 ? 1.0f : norm[1],
                   b1, omb1, b2, omb2, eps};
        if (i < n4) {
            float4 p = reinterpret_cast<float4*>(P)[i], m = reinterpret_cast<float4*>(M)[i];
            float4 v = reinterpret_cast<float4*>(Vm)[i];
            long long j = 4 * i;
            float4 g = *reinterpret_cast<const float4*>(grad_at(gseg, S, j));
            long long d = base + j;  // the element's index in the whole vector
            int r = decay_run(decay, R, d);
            k.update(p.x, m.x, v.x, g.x, decays(decay, R, r, d));
            k.update(p.y, m.y, v.y, g.y, decays(decay, R, r, d + 1));
            k.update(p.z, m.z, v.z, g.z, decays(decay, R, r, d + 2));
            k.update(p.w, m.w, v.w, g.w, decays(decay, R, r, d + 3));
            reinterpret_cast<float4*>(P)[i] = p;
            reinterpret_cast<float4*>(M)[i] = m;
            reinterpret_cast<float4*>(Vm)[i] = v;
            if (Pb != 0) {
                uint2 u;
                u.x = pack_bf16x2(p.x, p.y);
                u.y = pack_bf16x2(p.z, p.w);
                reinterpret_cast<uint2*>(Pb)[i] = u;
            }
            s = fmaf(g.x, g.x, s);
            s = fmaf(g.y, g.y, s);
            s = fmaf(g.z, g.z, s);
            s = fmaf(g.w, g.w, s);
        } else {
            long long e = i + 3 * n4;  // element 4 * n4 + (i - n4)
            float p = P[e], m = M[e], v = Vm[e], g = *grad_at(gseg, S, e);
            int r = decay_run(decay, R, base + e);
            k.update(p, m, v, g, decays(decay, R, r, base + e));
            P[e] = p;
            M[e] = m;
            Vm[e] = v;
            if (Pb != 0) Pb[e] = bf16_bits(p);
            s = fmaf(g, g, s);
        }
    }
    if (partial != 0) {  // the whole block (partial is the same for every thread)
        s = block_sum(s, red);
        if (threadIdx.x == 0) partial[blockIdx.x] = s;
    }
}

// Gradient accumulation (SPEC 19): G += Gm, elementwise, one float32 add
// (the reference's G = G + g, left to right over the micro-batches). Items
// as adamw_update's.
extern "C" __global__ void accumulate_gradient(float* __restrict__ G, const float* __restrict__ Gm,
                                               long long n, long long n4) {
    AFTER_PRIOR_GRIDS();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n4) {
        float4 a = reinterpret_cast<float4*>(G)[i];
        float4 b = reinterpret_cast<const float4*>(Gm)[i];
        reinterpret_cast<float4*>(G)[i] = make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y),
                                                      __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
        return;
    }
    i += 3 * n4;
    if (i < n) G[i] = __fadd_rn(G[i], Gm[i]);
}
