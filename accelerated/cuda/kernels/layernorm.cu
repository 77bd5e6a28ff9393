// ---------------------------------------------------------------- layernorm

// A row is held in registers by a team of threads: a warp (rows of up to
// 1024 features, several rows per block), or for wider rows a whole block
// of LN_WIDE threads (up to 8192 features, one row at a time). Team member
// t holds the chunks (4 features each) c = t + TEAM k, k < NC, and the
// team's sums are warp_sum's butterfly, then (a block) the warps' sums in
// block_sum's fixed order: every member gets the same bits. Each kernel is
// compiled for NC = 1, 2, 4, 8 as a warp (name suffix _c<NC>) and NC = 2,
// 4, 8 as a block (_w<NC>): the launcher takes the narrowest that holds D,
// so registers hold no empty chunks. vec: 16-byte loads and stores
// (load_chunk, common.cuh).
#define LN_CHUNKS 8   // the largest NC: rows of up to 1024 features (a warp), 8192 (a block)
#define LN_WARPS 8    // warps (rows at once) per block
#define LN_WIDE 256   // threads of the block holding one row of the wide kernels (_w<NC>)
// blocks per SM the backward's registers are held to: three (24 warps) up to
// 512 features per row, so enough loads are in flight; one for wider rows
#define LN_BLOCKS(NC) ((NC) <= 4 ? 2 : 1)

// h = xhat * w + b, xhat = (x - mean) * rstd: the forward's output, and the
// backward's recomputation of it from the kept x, mean and rstd (the same
// operations: the same bits)
__device__ __forceinline__ float layernorm_xhat(float x, float mu, float rs) {
    return __fmul_rn(__fsub_rn(x, mu), rs);
}
__device__ __forceinline__ float layernorm_out(float xhat, float w, float b) {
    return __fadd_rn(__fmul_rn(xhat, w), b);
}

// The sum over a row's team (TEAM = 32: the calling warp; else the whole
// block, red: 32 floats of shared memory): every member gets the same bits.
template <int TEAM>
__device__ __forceinline__ float team_sum(float v, float* red) {
    return TEAM == 32 ? warp_sum(v) : block_sum(v, red);
}

// The first loads of a norm's rows (layernorm's and rmsnorm's): lane
// member t's chunks of row offset `o`, zeros past D.
// Forward: x_prev, plus add when given (the residual add, stored to x_out).
template <int NC, int TEAM>
__device__ __forceinline__ void load_residual_row(
        float (&v)[NC][4], const float* __restrict__ x_prev, const float* __restrict__ add,
        float* __restrict__ x_out, long long o, int t, int D, bool vec) {
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int c = t + TEAM * k;
        if (4 * c < D) {
            load_chunk(v[k], x_prev + o, c, D, vec, 0.0f);
            if (add != 0) {
                float a[4];
                load_chunk(a, add + o, c, D, vec, 0.0f);
#pragma unroll
                for (int i = 0; i < 4; i++) v[k][i] = __fadd_rn(v[k][i], a[i]);
                store_chunk(x_out + o, c, D, vec, v[k]);
            }
        }
    }
}

// Backward: x, dout and dres (when given) at once, so the loads are in flight together.
template <int NC, int TEAM>
__device__ __forceinline__ void load_backward_row(
        float (&xh)[NC][4], float (&dxh)[NC][4], float (&r)[NC][4], const float* __restrict__ x,
        const float* __restrict__ dout, const float* dres, long long o, int t, int D,
        bool vec) {
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int c = t + TEAM * k;
        if (4 * c < D) {
            load_chunk(xh[k], x + o, c, D, vec, 0.0f);
            load_chunk(dxh[k], dout + o, c, D, vec, 0.0f);
            if (dres != 0) load_chunk(r[k], dres + o, c, D, vec, 0.0f);
        }
    }
}

// Row `row` by its team, member t (red: team_sum's shared memory)
template <int NC, int TEAM>
__device__ __forceinline__ void layernorm_forward_row(
        const float* __restrict__ x_prev, const float* __restrict__ add, float* __restrict__ x_out,
        floatX* __restrict__ h, float* __restrict__ mean, float* __restrict__ rstd,
        const float* __restrict__ w, const float* __restrict__ b, int row, int t, int D,
        float eps, bool vec, float* red) {
    long long o = (long long)row * D;
    float v[NC][4];
    load_residual_row<NC, TEAM>(v, x_prev, add, x_out, o, t, D, vec);
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < NC; k++) {
        if (4 * (t + TEAM * k) < D) {
#pragma unroll
            for (int i = 0; i < 4; i++) sum += v[k][i];  // zero past D
        }
    }
    float mu = team_sum<TEAM>(sum, red) / (float)D;
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NC; k++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (4 * (t + TEAM * k) + i < D) {
                float c = __fsub_rn(v[k][i], mu);
                ss += c * c;
            }
        }
    }
    float var = team_sum<TEAM>(ss, red) / (float)D;
    float rs = 1.0f / sqrtf(var + eps);
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int c = t + TEAM * k;
        if (4 * c < D) {
            float wk[4], bk[4], y[4];
            load_chunk(wk, w, c, D, vec, 0.0f);
            load_chunk(bk, b, c, D, vec, 0.0f);
#pragma unroll
            for (int i = 0; i < 4; i++) y[i] = layernorm_out(layernorm_xhat(v[k][i], mu, rs),
                                                             wk[i], bk[i]);
            store_operand_chunk(h + o, c, D, vec, y);
        }
    }
    if (t == 0) {
        mean[row] = mu;
        rstd[row] = rs;
    }
}

// out[d] (d < D) = the sum over the block's warps, in warp order, of each
// warp's g[k][i] for column d = 4 (lane + 32 k) + i: every warp stores its
// values at once (16-byte stores, no bank conflicts), then each thread adds
// the LN_WARPS values of its columns in warp order. (Warp by warp through
// one shared row, the same sums took 8 us per launch, a barrier per warp.)
template <int NC>
__device__ __forceinline__ void block_column_sums(const float (&g)[NC][4],
                                                  float4 (*stage)[32 * NC], float* out, int D) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int k = 0; k < NC; k++)
        stage[warp][lane + 32 * k] = make_float4(g[k][0], g[k][1], g[k][2], g[k][3]);
    __syncthreads();
    const float* s = reinterpret_cast<const float*>(stage);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float t = s[d];
        for (int w = 1; w < warps; w++) t = __fadd_rn(t, s[w * 128 * NC + d]);
        out[d] = t;
    }
    __syncthreads();  // the next call stores over stage
}

// Row `row` of the backward by its team, member t (red: team_sum's):
//   dxhat = dout * w
//   dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
// plus the residual gradient dres when given (dx may be dres: a thread
// reads its chunk, then writes it). dx_op: the same values as an operand
// (null under fp32, where the products read dx). h (null: not written):
// the forward's output h = xhat * w + b again, as an operand (the step
// keeps no h per layer; the weight gradient of the product that read it
// runs after this kernel). The weight and bias gradient terms dout * xhat
// and dout of the member's features are added to gw and gb.
template <int NC, int TEAM>
__device__ __forceinline__ void layernorm_backward_row(
        const float* __restrict__ dout, const float* dres, const float* __restrict__ x,
        const float* __restrict__ mean, const float* __restrict__ rstd,
        const float* __restrict__ w, const float* __restrict__ b, floatX* __restrict__ h,
        float* dx, floatX* __restrict__ dx_op, int row, int t, int D, bool vec,
        float (&gw)[NC][4], float (&gb)[NC][4], float* red) {
    long long o = (long long)row * D;
    // every load of the row first (x, dout and dres), so they are in
    // flight together; x becomes xhat and dout dxhat in place
    float xh[NC][4], dxh[NC][4], r[NC][4];
    load_backward_row<NC, TEAM>(xh, dxh, r, x, dout, dres, o, t, D, vec);
    float mu = mean[row], rs = rstd[row];
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int c = t + TEAM * k;
        float wk[4];
        if (4 * c < D) load_chunk(wk, w, c, D, vec, 0.0f);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (4 * c + i < D) {
                float dy = dxh[k][i];
                float xhat = layernorm_xhat(xh[k][i], mu, rs);
                float dxhat = __fmul_rn(dy, wk[i]);
                xh[k][i] = xhat;
                dxh[k][i] = dxhat;
                s1 += dxhat;
                s2 += dxhat * xhat;
                gw[k][i] = __fadd_rn(gw[k][i], __fmul_rn(dy, xhat));
                gb[k][i] = __fadd_rn(gb[k][i], dy);
            }
        }
    }
    float m1 = team_sum<TEAM>(s1, red) / (float)D;
    float m2 = team_sum<TEAM>(s2, red) / (float)D;
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int c = t + TEAM * k;
        if (4 * c < D) {
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                v[i] = __fmul_rn(rs, __fsub_rn(__fsub_rn(dxh[k][i], m1),
                                               __fmul_rn(xh[k][i], m2)));
                if (dres != 0) v[i] = __fadd_rn(r[k][i], v[i]);
            }
            store_chunk(dx + o, c, D, vec, v);
            if (dx_op != 0) store_operand_chunk(dx_op + o, c, D, vec, v);
            if (h != 0) {  // w again (from the L1 cache), not held in registers
                float wk[4], bk[4];
                load_chunk(wk, w, c, D, vec, 0.0f);
                load_chunk(bk, b, c, D, vec, 0.0f);
#pragma unroll
                for (int i = 0; i < 4; i++) v[i] = layernorm_out(xh[k][i], wk[i], bk[i]);
                store_operand_chunk(h + o, c, D, vec, v);
            }
        }
    }
}

template <int NC>
__device__ __forceinline__ void zero_chunks(float (&g)[NC][4]) {
#pragma unroll
    for (int k = 0; k < NC; k++)
#pragma unroll
        for (int i = 0; i < 4; i++) g[k][i] = 0.0f;
}

// A wide kernel's member t stores its features' sums g (chunks t + LN_WIDE k) to out
template <int NC>
__device__ __forceinline__ void store_wide_sums(const float (&g)[NC][4], float* out, int t,
                                                int D) {
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int c = t + LN_WIDE * k;
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (4 * c + i < D) out[4 * c + i] = g[k][i];
    }
}

// One block per `chunk` consecutive rows (the partition of the weight
// gradients' partial sums, one per block: layernorm_param_grads adds the
// blocks in order), each block's partials[block] (2D: dw then db) the
// block's rows' terms in a fixed order.
// Warp kernels (_c<NC>): LN_WARPS warps, warp w taking the block's rows
// w, w + LN_WARPS, ...; each lane sums its terms over its warp's rows in
// row order, then the warps' sums are added in warp order.
template <int NC>
__device__ __forceinline__ void layernorm_backward_rows(
        const float* __restrict__ dout, const float* dres, const float* __restrict__ x,
        const float* __restrict__ mean, const float* __restrict__ rstd,
        const float* __restrict__ w, const float* __restrict__ b, floatX* __restrict__ h,
        float* dx, floatX* __restrict__ dx_op, float* __restrict__ partials, int rows, int D,
        int chunk, bool vec) {
    __shared__ float4 stage[LN_WARPS][32 * NC];  // every warp's dw or db
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float gw[NC][4], gb[NC][4];
    zero_chunks<NC>(gw);
    zero_chunks<NC>(gb);
    int last = min(rows, ((int)blockIdx.x + 1) * chunk);
    for (int row = (int)blockIdx.x * chunk + warp; row < last; row += warps)
        layernorm_backward_row<NC, 32>(dout, dres, x, mean, rstd, w, b, h, dx, dx_op, row, lane,
                                       D, vec, gw, gb, 0);
    // the warps' sums, added in warp order: dw, then db
    float* part = partials + (long long)blockIdx.x * 2 * D;
    block_column_sums<NC>(gw, stage, part, D);
    block_column_sums<NC>(gb, stage, part + D, D);
}

// Wide kernels (_w<NC>): the block's LN_WIDE threads take its rows one
// after another, each thread summing its features' terms in row order.
template <int NC>
__device__ __forceinline__ void layernorm_backward_wide(
        const float* __restrict__ dout, const float* dres, const float* __restrict__ x,
        const float* __restrict__ mean, const float* __restrict__ rstd,
        const float* __restrict__ w, const float* __restrict__ b, floatX* __restrict__ h,
        float* dx, floatX* __restrict__ dx_op, float* __restrict__ partials, int rows, int D,
        int chunk, bool vec) {
    __shared__ float red[32];
    int t = threadIdx.x;
    float gw[NC][4], gb[NC][4];
    zero_chunks<NC>(gw);
    zero_chunks<NC>(gb);
    int last = min(rows, ((int)blockIdx.x + 1) * chunk);
    for (int row = (int)blockIdx.x * chunk; row < last; row++)
        layernorm_backward_row<NC, LN_WIDE>(dout, dres, x, mean, rstd, w, b, h, dx, dx_op, row, t,
                                            D, vec, gw, gb, red);
    float* part = partials + (long long)blockIdx.x * 2 * D;
    store_wide_sums<NC>(gw, part, t, D);
    store_wide_sums<NC>(gb, part + D, t, D);
}

#define LAYERNORM_KERNELS(NC)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * LN_WARPS) layernorm_forward_c##NC(         \
            const float* __restrict__ x_prev, const float* __restrict__ add,                     \
            float* __restrict__ x_out, floatX* __restrict__ h, float* __restrict__ mean,         \
            float* __restrict__ rstd, const float* __restrict__ w, const float* __restrict__ b, \
            int rows, int D, float eps, int vec) {                                               \
        AFTER_PRIOR_GRIDS();                                                                     \
        int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);                           \
        if (row >= rows) return;                                                                 \
        layernorm_forward_row<NC, 32>(x_prev, add, x_out, h, mean, rstd, w, b, row,              \
                                      threadIdx.x & 31, D, eps, vec != 0, 0);                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * LN_WARPS, LN_BLOCKS(NC))                   \
    layernorm_backward_c##NC(                                                                    \
            const float* __restrict__ dout, const float* dres, const float* __restrict__ x,      \
            const float* __restrict__ mean, const float* __restrict__ rstd,                      \
            const float* __restrict__ w, const float* __restrict__ b, floatX* __restrict__ h,    \
            float* dx, floatX* __restrict__ dx_op, float* __restrict__ partials, int rows,       \
            int D, int chunk, int vec) {                                                         \
        AFTER_PRIOR_GRIDS();                                                                     \
        layernorm_backward_rows<NC>(dout, dres, x, mean, rstd, w, b, h, dx, dx_op, partials,     \
                                    rows, D, chunk, vec != 0);                                   \
    }

// the wide kernels: one block of LN_WIDE threads per row (grid: rows), or
// per `chunk` rows in the backward (grid: the partials' blocks)
#define LAYERNORM_WIDE_KERNELS(NC)                                                                \
    extern "C" __global__ void __launch_bounds__(LN_WIDE) layernorm_forward_w##NC(               \
            const float* __restrict__ x_prev, const float* __restrict__ add,                     \
            float* __restrict__ x_out, floatX* __restrict__ h, float* __restrict__ mean,         \
            float* __restrict__ rstd, const float* __restrict__ w, const float* __restrict__ b, \
            int rows, int D, float eps, int vec) {                                               \
        AFTER_PRIOR_GRIDS();                                                                     \
        __shared__ float red[32];                                                                \
        layernorm_forward_row<NC, LN_WIDE>(x_prev, add, x_out, h, mean, rstd, w, b, blockIdx.x,  \
                                           threadIdx.x, D, eps, vec != 0, red);                  \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(LN_WIDE, 1) layernorm_backward_w##NC(           \
            const float* __restrict__ dout, const float* dres, const float* __restrict__ x,      \
            const float* __restrict__ mean, const float* __restrict__ rstd,                      \
            const float* __restrict__ w, const float* __restrict__ b, floatX* __restrict__ h,    \
            float* dx, floatX* __restrict__ dx_op, float* __restrict__ partials, int rows,       \
            int D, int chunk, int vec) {                                                         \
        AFTER_PRIOR_GRIDS();                                                                     \
        layernorm_backward_wide<NC>(dout, dres, x, mean, rstd, w, b, h, dx, dx_op, partials,     \
                                    rows, D, chunk, vec != 0);                                   \
    }

LAYERNORM_KERNELS(1)
LAYERNORM_KERNELS(2)
LAYERNORM_KERNELS(4)
LAYERNORM_KERNELS(8)
LAYERNORM_WIDE_KERNELS(2)
LAYERNORM_WIDE_KERNELS(4)
LAYERNORM_WIDE_KERNELS(8)

// Every norm's parameter gradients at once: a layernorm's weight and bias
// (width = 2D, adjacent in the registry), or an rmsnorm's weight (width =
// D; rmsnorm.cu writes its partials in the same partition). Norm n's
// partials (chunks, width), at the address partials[n] (each norm's are a
// buffer of their own, live from its backward on), summed in chunk order
// into G[offsets[n] .. + width) (in one segment of G: gseg, grad_at). A
// block of 8 x 32 threads takes 32 adjacent columns of one norm: thread
// (g, j) sums the chunks g, g + 8, ... of column j in order, then the 8 sums
// are added in order of g.
#define LN_GROUPS 8
extern "C" __global__ void __launch_bounds__(32 * LN_GROUPS)
layernorm_param_grads(const float* const* __restrict__ partials,
                      const long long* __restrict__ offsets,
                      const long long* __restrict__ gseg, int S, int norms, int chunks,
                      int width) {
    AFTER_PRIOR_GRIDS();
    __shared__ float group[LN_GROUPS][32];
    int j = threadIdx.x & 31, g = threadIdx.x >> 5;
    int blocks_per_norm = (width + 31) / 32;
    int n = blockIdx.x / blocks_per_norm;
    int col = (blockIdx.x - n * blocks_per_norm) * 32 + j;
    float s = 0.0f;
    if (col < width) {
        const float* p = partials[n] + col;
#pragma unroll 4
        for (int k = g; k < chunks; k += LN_GROUPS) s = __fadd_rn(s, p[(long long)k * width]);
    }
    group[g][j] = s;
    __syncthreads();
    if (g == 0 && col < width) {
        float t = group[0][j];
        for (int i = 1; i < LN_GROUPS; i++) t = __fadd_rn(t, group[i][j]);
        *grad_at(gseg, S, offsets[n] + col) = t;
    }
}
