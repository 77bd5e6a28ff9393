// ---------------------------------------------------------------- layernorm

// One warp per row; the row lives in registers, LN_LANE features per lane
// (feature d = lane + 32 k), so rows of up to 32 * LN_LANE features.
#define LN_LANE 32
#define LN_WARPS 4  // rows per block of layernorm_backward: its partials' partition

// With `add` (the residual branch), x = x_prev + add is written to x_out
// first (the residual add fused in); else x = x_prev. h (rows,D) =
// (x - mean) * rstd * w + b as an operand; mean, rstd (rows) kept for the
// backward. Biased variance, as the reference: mean((x - mu)^2).
extern "C" __global__ void layernorm_forward(const float* __restrict__ x_prev,
                                             const float* __restrict__ add,
                                             float* __restrict__ x_out, floatX* __restrict__ h,
                                             float* __restrict__ mean, float* __restrict__ rstd,
                                             const float* __restrict__ w,
                                             const float* __restrict__ b,
                                             int rows, int D, float eps) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    long long o = (long long)row * D;
    float v[LN_LANE];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < LN_LANE; k++) {
        int d = lane + 32 * k;
        v[k] = 0.0f;
        if (d < D) {
            float xv = x_prev[o + d];
            if (add != 0) {
                xv = __fadd_rn(xv, add[o + d]);
                x_out[o + d] = xv;
            }
            v[k] = xv;
            sum += xv;
        }
    }
    float mu = warp_sum(sum) / (float)D;
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < LN_LANE; k++) {
        if (lane + 32 * k < D) {
            float c = __fsub_rn(v[k], mu);
            ss += c * c;
        }
    }
    float var = warp_sum(ss) / (float)D;
    float rs = 1.0f / sqrtf(var + eps);
#pragma unroll
    for (int k = 0; k < LN_LANE; k++) {
        int d = lane + 32 * k;
        if (d < D) {
            float xhat = __fmul_rn(__fsub_rn(v[k], mu), rs);
            h[o + d] = to_operand(__fadd_rn(__fmul_rn(xhat, w[d]), b[d]));
        }
    }
    if (lane == 0) {
        mean[row] = mu;
        rstd[row] = rs;
    }
}

// One warp per row, LN_WARPS rows per block. Per row:
//   dxhat = dout * w
//   dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
// plus the residual gradient dres when given (dx may be dres: each element is
// read, then written, by one thread). dx_op: the same values as an operand
// (null under fp32, where the products read dx). The weight and bias
// gradient terms of the block's rows are summed in row order into
// partials[block] (2D: dw then db); layernorm_param_grads adds the blocks in
// order. shared: LN_WARPS * 2D floats.
extern "C" __global__ void layernorm_backward(const float* __restrict__ dout, const float* dres,
                                              const float* __restrict__ x,
                                              const float* __restrict__ mean,
                                              const float* __restrict__ rstd,
                                              const float* __restrict__ w, float* dx,
                                              floatX* __restrict__ dx_op,
                                              float* __restrict__ partials, int rows, int D) {
    extern __shared__ float shared[];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int row = blockIdx.x * LN_WARPS + warp;
    float* terms_w = shared + warp * 2 * D;  // this row's dout * xhat, then dout
    float* terms_b = terms_w + D;
    if (row < rows) {
        long long o = (long long)row * D;
        float mu = mean[row], rs = rstd[row];
        float xh[LN_LANE], dxh[LN_LANE];
        float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
        for (int k = 0; k < LN_LANE; k++) {
            int d = lane + 32 * k;
            xh[k] = 0.0f;
            dxh[k] = 0.0f;
            if (d < D) {
                float xhat = __fmul_rn(__fsub_rn(x[o + d], mu), rs);
                float dy = dout[o + d];
                float dxhat = __fmul_rn(dy, w[d]);
                xh[k] = xhat;
                dxh[k] = dxhat;
                s1 += dxhat;
                s2 += dxhat * xhat;
                terms_w[d] = __fmul_rn(dy, xhat);
                terms_b[d] = dy;
            }
        }
        float m1 = warp_sum(s1) / (float)D;
        float m2 = warp_sum(s2) / (float)D;
#pragma unroll
        for (int k = 0; k < LN_LANE; k++) {
            int d = lane + 32 * k;
            if (d < D) {
                float v = __fmul_rn(rs, __fsub_rn(__fsub_rn(dxh[k], m1), __fmul_rn(xh[k], m2)));
                if (dres != 0) v = __fadd_rn(dres[o + d], v);
                dx[o + d] = v;
                if (dx_op != 0) dx_op[o + d] = to_operand(v);
            }
        }
    } else {
        for (int d = lane; d < D; d += 32) {
            terms_w[d] = 0.0f;
            terms_b[d] = 0.0f;
        }
    }
    __syncthreads();
    float* part = partials + (long long)blockIdx.x * 2 * D;
    for (int d = threadIdx.x; d < 2 * D; d += blockDim.x) {
        float s = 0.0f;
        for (int k = 0; k < LN_WARPS; k++) s += shared[k * 2 * D + d];
        part[d] = s;
    }
}

// Every layernorm's weight and bias gradient at once: norm n's partials
// (chunks, 2D) summed in chunk order into G[offsets[n] .. + 2D) (its weight
// then its bias, adjacent in the registry).
extern "C" __global__ void layernorm_param_grads(const float* partials, const long long* offsets,
                                                 float* G, int norms, int chunks, int D) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)norms * 2 * D) return;
    int n = (int)(i / (2 * D)), c = (int)(i % (2 * D));
    const float* p = partials + (long long)n * chunks * 2 * D + c;
    float s = 0.0f;
#pragma unroll 8
    for (int k = 0; k < chunks; k++) s += p[(long long)k * 2 * D];
    G[offsets[n] + c] = s;
}
