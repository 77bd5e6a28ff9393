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
// The warp kernels' backward from LN_SHARED_FROM chunks a lane keeps the
// block's weight and bias gradient sums in shared memory (dynamic: 2 x
// LN_WARPS x 32 NC float4s, each lane its own; the same additions in the
// same order as in registers, so the same bits), which leaves the lane's
// registers to the row and lets two blocks share a multiprocessor.
#define LN_SHARED_FROM 8
// blocks per SM the backward's registers are held to, so that enough loads are
// in flight: two (16 warps) up to 512 features a row, else one
// (LN_REGISTER_BLOCKS: the sums in registers, rmsnorm's too); two where the
// sums are in shared memory
#define LN_REGISTER_BLOCKS(NC) ((NC) <= 4 ? 2 : 1)
#define LN_BLOCKS(NC) ((NC) >= LN_SHARED_FROM ? 2 : LN_REGISTER_BLOCKS(NC))

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
// out[d] = the warps' values of column d in `stage` ([warp][32 NC] float4s:
// column d = 4 (lane + 32 k) + i of a warp's), added in warp order
template <int NC>
__device__ __forceinline__ void staged_column_sums(const float4* stage, float* out, int D) {
    int warps = blockDim.x >> 5;
    const float* s = reinterpret_cast<const float*>(stage);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float t = s[d];
        for (int w = 1; w < warps; w++) t = __fadd_rn(t, s[w * 128 * NC + d]);
        out[d] = t;
    }
}

template <int NC>
__device__ __forceinline__ void block_column_sums(const float (&g)[NC][4],
                                                  float4 (*stage)[32 * NC], float* out, int D) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int k = 0; k < NC; k++)
        stage[warp][lane + 32 * k] = make_float4(g[k][0], g[k][1], g[k][2], g[k][3]);
    __syncthreads();
    staged_column_sums<NC>(stage[0], out, D);
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
// and dout of the member's features are added to its sums (RegisterSums or
// SharedSums).
template <int NC, int TEAM, class Sums>
__device__ __forceinline__ void layernorm_backward_row(
        const float* __restrict__ dout, const float* dres, const float* __restrict__ x,
        const float* __restrict__ mean, const float* __restrict__ rstd,
        const float* __restrict__ w, const float* __restrict__ b, floatX* __restrict__ h,
        float* dx, floatX* __restrict__ dx_op, int row, int t, int D, bool vec,
        Sums& sums, float* red) {
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
        float wk[4], gw[4], gb[4];
        if (4 * c < D) load_chunk(wk, w, c, D, vec, 0.0f);
        sums.get(k, gw, gb);
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
                gw[i] = __fadd_rn(gw[i], __fmul_rn(dy, xhat));
                gb[i] = __fadd_rn(gb[i], dy);
            }
        }
        sums.put(k, gw, gb);
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

// A member's weight and bias gradient sums of its chunks k < NC, zero to
// start: get(k, ...) reads chunk k's 4 + 4, put(k, ...) writes them back.
// RegisterSums: in the member's registers.
template <int NC>
struct RegisterSums {
    float w[NC][4], b[NC][4];
    __device__ __forceinline__ RegisterSums() {
        zero_chunks<NC>(w);
        zero_chunks<NC>(b);
    }
    __device__ __forceinline__ void get(int k, float (&gw)[4], float (&gb)[4]) const {
#pragma unroll
        for (int i = 0; i < 4; i++) gw[i] = w[k][i], gb[i] = b[k][i];
    }
    __device__ __forceinline__ void put(int k, const float (&gw)[4], const float (&gb)[4]) {
#pragma unroll
        for (int i = 0; i < 4; i++) w[k][i] = gw[i], b[k][i] = gb[i];
    }
};

// SharedSums: in shared memory, the lane's float4s w[32 k] and b[32 k]
// (in a warp's rows of 32 NC float4s: block_column_sums' layout)
struct SharedSums {
    float4 *w, *b;
    __device__ __forceinline__ void get(int k, float (&gw)[4], float (&gb)[4]) const {
        const float4 u = w[32 * k], v = b[32 * k];
        gw[0] = u.x, gw[1] = u.y, gw[2] = u.z, gw[3] = u.w;
        gb[0] = v.x, gb[1] = v.y, gb[2] = v.z, gb[3] = v.w;
    }
    __device__ __forceinline__ void put(int k, const float (&gw)[4], const float (&gb)[4]) {
        w[32 * k] = make_float4(gw[0], gw[1], gw[2], gw[3]);
        b[32 * k] = make_float4(gb[0], gb[1], gb[2], gb[3]);
    }
};

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
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int last = min(rows, ((int)blockIdx.x + 1) * chunk);
    float* part = partials + (long long)blockIdx.x * 2 * D;
    if constexpr (NC >= LN_SHARED_FROM) {
        // [0][warp]: the warps' dw sums, [1][warp]: their db sums (the launcher's
        // 2 * LN_WARPS * 32 * NC float4s of dynamic shared memory)
        extern __shared__ float4 ln_sums[];
        SharedSums sums{ln_sums + warp * 32 * NC + lane, ln_sums + (warps + warp) * 32 * NC + lane};
#pragma unroll
        for (int k = 0; k < NC; k++) sums.w[32 * k] = sums.b[32 * k] = make_float4(0, 0, 0, 0);
        for (int row = (int)blockIdx.x * chunk + warp; row < last; row += warps)
            layernorm_backward_row<NC, 32>(dout, dres, x, mean, rstd, w, b, h, dx, dx_op, row,
                                           lane, D, vec, sums, 0);
        __syncthreads();
        staged_column_sums<NC>(ln_sums, part, D);
        staged_column_sums<NC>(ln_sums + warps * 32 * NC, part + D, D);
    } else {
        __shared__ float4 stage[LN_WARPS][32 * NC];  // every warp's dw or db
        RegisterSums<NC> sums;
        for (int row = (int)blockIdx.x * chunk + warp; row < last; row += warps)
            layernorm_backward_row<NC, 32>(dout, dres, x, mean, rstd, w, b, h, dx, dx_op, row,
                                           lane, D, vec, sums, 0);
        // the warps' sums, added in warp order: dw, then db
        block_column_sums<NC>(sums.w, stage, part, D);
        block_column_sums<NC>(sums.b, stage, part + D, D);
    }
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
    RegisterSums<NC> sums;
    int last = min(rows, ((int)blockIdx.x + 1) * chunk);
    for (int row = (int)blockIdx.x * chunk; row < last; row++)
        layernorm_backward_row<NC, LN_WIDE>(dout, dres, x, mean, rstd, w, b, h, dx, dx_op, row, t,
                                            D, vec, sums, red);
    float* part = partials + (long long)blockIdx.x * 2 * D;
    store_wide_sums<NC>(sums.w, part, t, D);
    store_wide_sums<NC>(sums.b, part + D, t, D);
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
