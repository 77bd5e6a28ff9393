// ---------------------------------------------------------------- rmsnorm

// RMSNorm (SPEC 21): per row rstd = 1 / sqrt(mean(x^2) + eps), y = (x * rstd) * w;
// a weight and no bias. The layout and the partition of the work are
// layernorm's (this file follows layernorm.cu in the module and uses its
// teams, LN_WARPS, LN_WIDE, LN_BLOCKS, team_sum, block_column_sums and
// store_wide_sums): a row in the registers of a warp (kernels _c<NC>, NC =
// 1, 2, 4, 8) or of a block of LN_WIDE threads (_w<NC>, NC = 2, 4, 8),
// member t holding the chunks (4 features each) c = t + TEAM k, k < NC.
// vec: 16-byte loads and stores (load_chunk, common.cuh).

// xhat = x * rstd and h = xhat * w: the forward's output, and the
// backward's recomputation of it from the kept x and rstd (the same
// operations: the same bits)
__device__ __forceinline__ float rmsnorm_xhat(float x, float rs) { return __fmul_rn(x, rs); }
__device__ __forceinline__ float rmsnorm_out(float xhat, float w) { return __fmul_rn(xhat, w); }

// Row `row` by its team, member t (red: team_sum's shared memory):
// x_prev (+ add -> x_out, the residual add, when add is given) -> h operand, rstd
template <int NC, int TEAM>
__device__ __forceinline__ void rmsnorm_forward_row(
        const float* __restrict__ x_prev, const float* __restrict__ add, float* __restrict__ x_out,
        floatX* __restrict__ h, float* __restrict__ rstd, const float* __restrict__ w, int row,
        int t, int D, float eps, bool vec, float* red) {
    long long o = (long long)row * D;
    float v[NC][4];
    load_residual_row<NC, TEAM>(v, x_prev, add, x_out, o, t, D, vec);
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NC; k++) {
        if (4 * (t + TEAM * k) < D) {
#pragma unroll
            for (int i = 0; i < 4; i++) ss += v[k][i] * v[k][i];  // zero past D
        }
    }
    float ms = team_sum<TEAM>(ss, red) / (float)D;
    float rs = 1.0f / sqrtf(ms + eps);
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int c = t + TEAM * k;
        if (4 * c < D) {
            float wk[4], y[4];
            load_chunk(wk, w, c, D, vec, 0.0f);
#pragma unroll
            for (int i = 0; i < 4; i++) y[i] = rmsnorm_out(rmsnorm_xhat(v[k][i], rs), wk[i]);
            store_operand_chunk(h + o, c, D, vec, y);
        }
    }
    if (t == 0) rstd[row] = rs;
}

// Row `row` of the backward by its team, member t:
//   dxhat = dout * w
//   dx = rstd * (dxhat - xhat * mean(dxhat * xhat))
// plus the residual gradient dres when given (dx may be dres: a thread
// reads its chunk, then writes it). dx_op: the same values as an operand
// (null under fp32). h (null: not written): the forward's output h = xhat * w
// again, as an operand, for the weight gradient of the product that read it.
// The weight gradient terms dout * xhat of the member's features are added to gw.
template <int NC, int TEAM>
__device__ __forceinline__ void rmsnorm_backward_row(
        const float* __restrict__ dout, const float* dres, const float* __restrict__ x,
        const float* __restrict__ rstd, const float* __restrict__ w, floatX* __restrict__ h,
        float* dx, floatX* __restrict__ dx_op, int row, int t, int D, bool vec,
        float (&gw)[NC][4], float* red) {
    long long o = (long long)row * D;
    // every load of the row first (x, dout and dres), so they are in
    // flight together; x becomes xhat and dout dxhat in place
    float xh[NC][4], dxh[NC][4], r[NC][4];
    load_backward_row<NC, TEAM>(xh, dxh, r, x, dout, dres, o, t, D, vec);
    float rs = rstd[row];
    float s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int c = t + TEAM * k;
        float wk[4];
        if (4 * c < D) load_chunk(wk, w, c, D, vec, 0.0f);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (4 * c + i < D) {
                float dy = dxh[k][i];
                float xhat = rmsnorm_xhat(xh[k][i], rs);
                float dxhat = __fmul_rn(dy, wk[i]);
                xh[k][i] = xhat;
                dxh[k][i] = dxhat;
                s2 += dxhat * xhat;
                gw[k][i] = __fadd_rn(gw[k][i], __fmul_rn(dy, xhat));
            }
        }
    }
    float m2 = team_sum<TEAM>(s2, red) / (float)D;
#pragma unroll
    for (int k = 0; k < NC; k++) {
        int c = t + TEAM * k;
        if (4 * c < D) {
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                v[i] = __fmul_rn(rs, __fsub_rn(dxh[k][i], __fmul_rn(xh[k][i], m2)));
                if (dres != 0) v[i] = __fadd_rn(r[k][i], v[i]);
            }
            store_chunk(dx + o, c, D, vec, v);
            if (dx_op != 0) store_operand_chunk(dx_op + o, c, D, vec, v);
            if (h != 0) {  // w again (from the L1 cache), not held in registers
                float wk[4];
                load_chunk(wk, w, c, D, vec, 0.0f);
#pragma unroll
                for (int i = 0; i < 4; i++) v[i] = rmsnorm_out(xh[k][i], wk[i]);
                store_operand_chunk(h + o, c, D, vec, v);
            }
        }
    }
}

// One block per `chunk` consecutive rows (the partition of the weight
// gradient's partial sums, layernorm's: partials[block], D values;
// layernorm_param_grads adds the blocks in order). Warp kernels: warp w
// takes the block's rows w, w + LN_WARPS, ..., each lane summing its terms
// in row order, then the warps' sums added in warp order.
template <int NC>
__device__ __forceinline__ void rmsnorm_backward_rows(
        const float* __restrict__ dout, const float* dres, const float* __restrict__ x,
        const float* __restrict__ rstd, const float* __restrict__ w, floatX* __restrict__ h,
        float* dx, floatX* __restrict__ dx_op, float* __restrict__ partials, int rows, int D,
        int chunk, bool vec) {
    __shared__ float4 stage[LN_WARPS][32 * NC];  // every warp's dw
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float gw[NC][4];
    zero_chunks<NC>(gw);
    int last = min(rows, ((int)blockIdx.x + 1) * chunk);
    for (int row = (int)blockIdx.x * chunk + warp; row < last; row += warps)
        rmsnorm_backward_row<NC, 32>(dout, dres, x, rstd, w, h, dx, dx_op, row, lane, D, vec, gw,
                                     0);
    // the warps' sums, added in warp order
    block_column_sums<NC>(gw, stage, partials + (long long)blockIdx.x * D, D);
}

// Wide kernels: the block's LN_WIDE threads take its rows one after
// another, each thread summing its features' terms in row order.
template <int NC>
__device__ __forceinline__ void rmsnorm_backward_wide(
        const float* __restrict__ dout, const float* dres, const float* __restrict__ x,
        const float* __restrict__ rstd, const float* __restrict__ w, floatX* __restrict__ h,
        float* dx, floatX* __restrict__ dx_op, float* __restrict__ partials, int rows, int D,
        int chunk, bool vec) {
    __shared__ float red[32];
    int t = threadIdx.x;
    float gw[NC][4];
    zero_chunks<NC>(gw);
    int last = min(rows, ((int)blockIdx.x + 1) * chunk);
    for (int row = (int)blockIdx.x * chunk; row < last; row++)
        rmsnorm_backward_row<NC, LN_WIDE>(dout, dres, x, rstd, w, h, dx, dx_op, row, t, D, vec,
                                          gw, red);
    store_wide_sums<NC>(gw, partials + (long long)blockIdx.x * D, t, D);
}

#define RMSNORM_KERNELS(NC)                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * LN_WARPS) rmsnorm_forward_c##NC(           \
            const float* __restrict__ x_prev, const float* __restrict__ add,                     \
            float* __restrict__ x_out, floatX* __restrict__ h, float* __restrict__ rstd,         \
            const float* __restrict__ w, int rows, int D, float eps, int vec) {                  \
        AFTER_PRIOR_GRIDS();                                                                     \
        int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);                           \
        if (row >= rows) return;                                                                 \
        rmsnorm_forward_row<NC, 32>(x_prev, add, x_out, h, rstd, w, row, threadIdx.x & 31, D,    \
                                    eps, vec != 0, 0);                                           \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * LN_WARPS, LN_BLOCKS(NC))                   \
    rmsnorm_backward_c##NC(                                                                      \
            const float* __restrict__ dout, const float* dres, const float* __restrict__ x,      \
            const float* __restrict__ rstd, const float* __restrict__ w,                         \
            floatX* __restrict__ h, float* dx, floatX* __restrict__ dx_op,                       \
            float* __restrict__ partials, int rows, int D, int chunk, int vec) {                 \
        AFTER_PRIOR_GRIDS();                                                                     \
        rmsnorm_backward_rows<NC>(dout, dres, x, rstd, w, h, dx, dx_op, partials, rows, D,       \
                                  chunk, vec != 0);                                              \
    }

// the wide kernels: one block of LN_WIDE threads per row (grid: rows), or
// per `chunk` rows in the backward (grid: the partials' blocks)
#define RMSNORM_WIDE_KERNELS(NC)                                                                  \
    extern "C" __global__ void __launch_bounds__(LN_WIDE) rmsnorm_forward_w##NC(                 \
            const float* __restrict__ x_prev, const float* __restrict__ add,                     \
            float* __restrict__ x_out, floatX* __restrict__ h, float* __restrict__ rstd,         \
            const float* __restrict__ w, int rows, int D, float eps, int vec) {                  \
        AFTER_PRIOR_GRIDS();                                                                     \
        __shared__ float red[32];                                                                \
        rmsnorm_forward_row<NC, LN_WIDE>(x_prev, add, x_out, h, rstd, w, blockIdx.x,             \
                                         threadIdx.x, D, eps, vec != 0, red);                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(LN_WIDE, 1) rmsnorm_backward_w##NC(             \
            const float* __restrict__ dout, const float* dres, const float* __restrict__ x,      \
            const float* __restrict__ rstd, const float* __restrict__ w,                         \
            floatX* __restrict__ h, float* dx, floatX* __restrict__ dx_op,                       \
            float* __restrict__ partials, int rows, int D, int chunk, int vec) {                 \
        AFTER_PRIOR_GRIDS();                                                                     \
        rmsnorm_backward_wide<NC>(dout, dres, x, rstd, w, h, dx, dx_op, partials, rows, D,       \
                                  chunk, vec != 0);                                              \
    }

RMSNORM_KERNELS(1)
RMSNORM_KERNELS(2)
RMSNORM_KERNELS(4)
RMSNORM_KERNELS(8)
RMSNORM_WIDE_KERNELS(2)
RMSNORM_WIDE_KERNELS(4)
RMSNORM_WIDE_KERNELS(8)
