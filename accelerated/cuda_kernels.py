"""CUDA kernels of the CuPy backend and their launchers (llm.c style: the
kernel source first, then one launcher per kernel; names follow the
reference's layer functions).

Shapes use the project's letters: B batch, T context, D d_model, H heads,
E = D/H head dim, F d_ff, V vocab, BT = B*T rows. Activations are row-major
float32. `floatX` is the type of a matrix-product operand under the
precision policy (SPEC section 6): float for fp32, the bits of a bfloat16
(unsigned short, rounded to nearest even) for bf16. A kernel that produces
a tensor whose only use is as a matrix-product operand writes it as floatX
directly, so the bf16 policy costs no separate rounding pass. The module is
compiled once per policy (`-DOPERAND_BF16` selects bf16); no header is
included, so NVRTC compiles it as is.

Determinism: no kernel uses atomics. Every reduction runs in a fixed order
(warp shuffles in a fixed tree, then shared memory in warp order), so a
replay gives the same bits every time and resume is exact (SPEC 9).
Layernorm's weight gradients reduce in two passes (per-block partials, then
the blocks in order); the embedding gradient of an id is summed by one
block over the positions holding it, in position order, as the reference's
np.add.at does.

Elementwise formulas that the reference writes as separate float32
operations use the _rn intrinsics (no fused multiply-add) where that makes
the kernel reproduce the reference's rounding exactly: AdamW, rope, the
layernorm normalization. Division and sqrtf are IEEE (no fast math).
"""

from __future__ import annotations

import math

import numpy as np

try:
    import cupy
except ImportError:  # the backend is simply unavailable
    cupy = None

# ---------------------------------------------------------------------------
# kernel source
# ---------------------------------------------------------------------------

SOURCE = r"""
#ifdef OPERAND_BF16
typedef unsigned short floatX;  // bfloat16 bits
#else
typedef float floatX;
#endif

#define NEG_INF __int_as_float(0xff800000)

// float32 -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN,
// a value past the largest bfloat16 rounds to infinity (as ml_dtypes does)
__device__ __forceinline__ unsigned short bf16_bits(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ floatX to_operand(float x) {
#ifdef OPERAND_BF16
    return bf16_bits(x);
#else
    return x;
#endif
}

// butterfly sums leave lanes with differently ordered sums: broadcast lane 0's
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return __shfl_sync(0xffffffffu, v, 0);
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// sum over the block (blockDim.x a multiple of 32); every thread gets the
// same value. red: 32 floats of shared memory.
__device__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // red may still be read by a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? red[lane] : 0.0f);
}

__device__ float block_max(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? red[lane] : NEG_INF);
}

// ---------------------------------------------------------------- precision

// x (n) float32 -> out (n) bfloat16 bits
extern "C" __global__ void round_bf16(const float* x, unsigned short* out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = bf16_bits(x[i]);
}

// ---------------------------------------------------------------- embedding

// ids: row b of the id buffer starts at b * ids_stride (T+1 for a training
// input, whose last id is only a target). x (BT,D) = W[ids]
extern "C" __global__ void embedding_forward(const int* __restrict__ ids, int ids_stride, int T,
                                             const float* __restrict__ W, float* __restrict__ x,
                                             int BT, int D) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= BT * D) return;
    int r = i / D, d = i % D;
    int id = ids[(r / T) * ids_stride + r % T];
    x[i] = W[(long long)id * D + d];
}

// One block per position p (BT blocks), one thread per feature (D <= 1024).
// The block of the first position holding id v adds dx over every position
// holding v, in position order (the order of the reference's np.add.at),
// to the unembedding gradient already in dW[v]; the blocks of later
// positions of v do nothing, and rows of ids that occur nowhere are not
// touched. Per tile of ids, warp 0 lists the matching positions in order
// (ballots), then every thread adds their rows. No atomics.
#define EMBEDDING_TILE 1024
__device__ __forceinline__ int id_at(const int* ids, int ids_stride, int T, int r) {
    return ids[(r / T) * ids_stride + r % T];
}

extern "C" __global__ void embedding_backward(const float* __restrict__ dx,
                                              const int* __restrict__ ids, int ids_stride, int T,
                                              int BT, float* __restrict__ dW, int D) {
    __shared__ int tile[EMBEDDING_TILE];  // ids of positions base .. base + n
    __shared__ int hits[EMBEDDING_TILE];  // the positions among them holding v, in order
    __shared__ int count;
    int p = blockIdx.x, d = threadIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int v = id_at(ids, ids_stride, T, p);
    int earlier = 0;
    for (int q = threadIdx.x; q < p; q += blockDim.x) earlier |= id_at(ids, ids_stride, T, q) == v;
    if (__syncthreads_or(earlier)) return;  // uniform: the whole block leaves
    float acc = 0.0f;
    for (int base = p; base < BT; base += EMBEDDING_TILE) {
        int n = min(EMBEDDING_TILE, BT - base);
        for (int k = threadIdx.x; k < n; k += blockDim.x) tile[k] = id_at(ids, ids_stride, T, base + k);
        __syncthreads();
        if (warp == 0) {
            int c = 0;
            for (int k0 = 0; k0 < n; k0 += 32) {
                int k = k0 + lane;
                bool hit = k < n && tile[k] == v;
                unsigned mask = __ballot_sync(0xffffffffu, hit);
                if (hit) hits[c + __popc(mask & ((1u << lane) - 1u))] = base + k;
                c += __popc(mask);
            }
            if (lane == 0) count = c;
        }
        __syncthreads();
        if (d < D)
            for (int m = 0; m < count; m++) acc += dx[(long long)hits[m] * D + d];
        __syncthreads();  // tile, hits and count are rewritten by the next pass
    }
    if (d < D) dW[(long long)v * D + d] = dW[(long long)v * D + d] + acc;
}

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

// ---------------------------------------------------------------- rope

// The row-wise elementwise kernels run on a 2-D grid: x over the columns of
// a row, y over the rows (striding by gridDim.y), so a thread finds its
// column and row without dividing.

// qkv (BT,3D) float32, the q, k, v projections side by side -> out (BT,3D)
// operands: q and k rotated, v as is. Half-split pairs: element j of a head
// pairs with element j + E/2; cos, sin (T,E/2).
extern "C" __global__ void rope_forward(const float* __restrict__ qkv, floatX* __restrict__ out,
                                        const float* __restrict__ cos_t,
                                        const float* __restrict__ sin_t, int BT, int T, int D,
                                        int H) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= 3 * D) return;
    int E = D / H, half = E / 2, e = col % E;
    int head = col - e;  // element 0 of this head in the row
    int j = e < half ? e : e - half;
    for (int row = blockIdx.y; row < BT; row += gridDim.y) {
        const float* x = qkv + (long long)row * 3 * D;
        float v;
        if (col >= 2 * D) {
            v = x[col];
        } else {
            int t = row % T;
            float x1 = x[head + j], x2 = x[head + j + half];
            float c = cos_t[t * half + j], s = sin_t[t * half + j];
            v = e < half ? __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s))
                         : __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
        }
        out[(long long)row * 3 * D + col] = to_operand(v);
    }
}

// dqk (BT,2D) float32 gradients of the rotated q, k -> dqkv[:, :2D] (row
// stride 3D) operands: the rotation by -theta (the rotation is orthogonal).
extern "C" __global__ void rope_backward(const float* __restrict__ dqk, floatX* __restrict__ dqkv,
                                         const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, int BT, int T, int D,
                                         int H) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= 2 * D) return;
    int E = D / H, half = E / 2, e = col % E;
    int head = col - e;
    int j = e < half ? e : e - half;
    for (int row = blockIdx.y; row < BT; row += gridDim.y) {
        const float* g = dqk + (long long)row * 2 * D;
        int t = row % T;
        float d1 = g[head + j], d2 = g[head + j + half];
        float c = cos_t[t * half + j], s = sin_t[t * half + j];
        float v = e < half ? __fadd_rn(__fmul_rn(d1, c), __fmul_rn(d2, s))
                           : __fsub_rn(__fmul_rn(d2, c), __fmul_rn(d1, s));
        dqkv[(long long)row * 3 * D + col] = to_operand(v);
    }
}

// ---------------------------------------------------------------- attention

// One warp per row of scores s (B*H*T rows of T), row r is query position
// i = r % T: p = softmax(s * scale) over j <= i (causal), written over s
// (float32, kept for the backward) and, under bf16, to p_op. Only the causal
// part j <= i is written, except under fp32, where the product p v reads s
// itself and its zeros above the diagonal are written too: under bf16 that
// product reads p_op, whose upper triangle is zero from its allocation on,
// and nothing reads the float32 p above the diagonal. Rows of up to
// 32 * SM_LANE scores are held in registers (score j = lane + 32 k): one
// read and one exp per score; longer rows are read three times.
#define SM_LANE 32
extern "C" __global__ void attention_softmax_forward(float* s, floatX* __restrict__ p_op, int rows,
                                                     int T, float scale) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    int i = r % T;
    float* sr = s + (long long)r * T;
    floatX* pr = p_op + (long long)r * T;  // not dereferenced when p_op is null
    float mx = NEG_INF, sum = 0.0f;
    if (T <= 32 * SM_LANE) {
        float e[SM_LANE];
#pragma unroll
        for (int k = 0; k < SM_LANE; k++) {
            int j = lane + 32 * k;
            e[k] = j <= i ? __fmul_rn(sr[j], scale) : NEG_INF;
            mx = fmaxf(mx, e[k]);
        }
        mx = warp_max(mx);
#pragma unroll
        for (int k = 0; k < SM_LANE; k++) {
            if (lane + 32 * k <= i) {
                e[k] = expf(__fsub_rn(e[k], mx));
                sum += e[k];
            }
        }
        sum = warp_sum(sum);
#pragma unroll
        for (int k = 0; k < SM_LANE; k++) {
            int j = lane + 32 * k;
            if (j <= i) {
                float p = e[k] / sum;
                sr[j] = p;
                if (p_op != 0) pr[j] = to_operand(p);
            } else if (p_op == 0 && j < T) {
                sr[j] = 0.0f;
            }
        }
        return;
    }
    for (int j = lane; j <= i; j += 32) mx = fmaxf(mx, __fmul_rn(sr[j], scale));
    mx = warp_max(mx);
    for (int j = lane; j <= i; j += 32) sum += expf(__fsub_rn(__fmul_rn(sr[j], scale), mx));
    sum = warp_sum(sum);
    for (int j = lane; j <= i; j += 32) {
        float p = expf(__fsub_rn(__fmul_rn(sr[j], scale), mx)) / sum;
        sr[j] = p;
        if (p_op != 0) pr[j] = to_operand(p);
    }
    if (p_op == 0)
        for (int j = i + 1 + lane; j < T; j += 32) sr[j] = 0.0f;
}

// One warp per row: ds = p * (dp - sum_j dp * p) * scale as an operand, and
// under bf16 p again as an operand (p_op) for the product dv = p^T dy. Only
// j <= i is read or written: above the diagonal p = 0, so ds = 0 there, and
// ds and p_op hold those zeros from their allocation on. Rows of up to
// 32 * SM_LANE in registers, as in the forward.
extern "C" __global__ void attention_softmax_backward(const float* __restrict__ p,
                                                      const float* __restrict__ dp,
                                                      floatX* __restrict__ ds,
                                                      floatX* __restrict__ p_op, int rows, int T,
                                                      float scale) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    int i = r % T;
    long long o = (long long)r * T;
    float dot = 0.0f;
    if (T <= 32 * SM_LANE) {
        float pv[SM_LANE], dv[SM_LANE];
#pragma unroll
        for (int k = 0; k < SM_LANE; k++) {
            int j = lane + 32 * k;
            pv[k] = 0.0f;
            dv[k] = 0.0f;
            if (j <= i) {
                pv[k] = p[o + j];
                dv[k] = dp[o + j];
                dot += dv[k] * pv[k];
            }
        }
        dot = warp_sum(dot);
#pragma unroll
        for (int k = 0; k < SM_LANE; k++) {
            int j = lane + 32 * k;
            if (j <= i) {
                ds[o + j] = to_operand(__fmul_rn(__fmul_rn(pv[k], __fsub_rn(dv[k], dot)), scale));
                if (p_op != 0) p_op[o + j] = to_operand(pv[k]);
            }
        }
        return;
    }
    for (int j = lane; j <= i; j += 32) dot += dp[o + j] * p[o + j];
    dot = warp_sum(dot);
    for (int j = lane; j <= i; j += 32) {
        float pj = p[o + j];
        ds[o + j] = to_operand(__fmul_rn(__fmul_rn(pj, __fsub_rn(dp[o + j], dot)), scale));
        if (p_op != 0) p_op[o + j] = to_operand(pj);
    }
}

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

// ---------------------------------------------------------------- loss

// One block per row of logits (BT,V); the target of row r = (b, t) is
// ids[b * ids_stride + t + 1]. ce = logsumexp(logits) - logits[target] and,
// for the mean over n rows (dce = 1/n), dlogits = (softmax - onehot) * dce
// as an operand. Loss and its gradient in one pass over the row.
extern "C" __global__ void crossentropy_forward_backward(const float* logits, const int* ids,
                                                         int ids_stride, int T, float* ce,
                                                         floatX* dlogits, int V, float dce) {
    __shared__ float red[32];
    int r = blockIdx.x;
    const float* l = logits + (long long)r * V;
    int target = ids[(r / T) * ids_stride + r % T + 1];
    float mx = NEG_INF;
    for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, l[j]);
    mx = block_max(mx, red);
    float s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(__fsub_rn(l[j], mx));
    s = block_sum(s, red);
    if (threadIdx.x == 0) ce[r] = __fsub_rn(__fadd_rn(logf(s), mx), l[target]);
    floatX* dl = dlogits + (long long)r * V;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float p = expf(__fsub_rn(l[j], mx)) / s;
        if (j == target) p = __fsub_rn(p, 1.0f);
        dl[j] = to_operand(__fmul_rn(p, dce));
    }
}

// One block: loss = sum(ce) / n in a fixed order
extern "C" __global__ void mean_loss(const float* ce, float* loss, int n) {
    __shared__ float red[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += ce[i];
    s = block_sum(s, red);
    if (threadIdx.x == 0) loss[0] = s / (float)n;
}

// ---------------------------------------------------------------- AdamW

// c = float32(1 - beta^t), computed in float64 (SPEC 7)
__device__ __forceinline__ float bias_correction(double beta, int t) {
    return (float)(1.0 - pow(beta, (double)t));
}

// One thread: advance the device update count t and compute c1, c2 for the
// new t. Inside the graph, so a replay needs nothing from the host.
extern "C" __global__ void adamw_bias_corrections(int* t, float* c, double beta1, double beta2) {
    int tn = t[0] + 1;
    t[0] = tn;
    c[0] = bias_correction(beta1, tn);
    c[1] = bias_correction(beta2, tn);
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
//   m = b1 m + (1-b1) g ; v = b2 v + (1-b2) g g ; p -= lr wd p (decay only)
//   p -= lr (m / c1) / (sqrt(v / c2) + eps)
// Under bf16 the new parameters are also written as bfloat16 operands (Pb),
// so the next step's products need no rounding pass over P.
extern "C" __global__ void adamw_update(float* P, float* M, float* Vm, const float* G,
                                        const unsigned char* decay, unsigned short* Pb,
                                        const float* c, long long n, float b1, float omb1,
                                        float b2, float omb2, float lr, float lrwd, float eps) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float c1 = c[0], c2 = c[1];
    float g = G[i];
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
"""

KERNELS = ("round_bf16", "embedding_forward", "embedding_backward", "layernorm_forward",
           "layernorm_backward", "layernorm_param_grads", "rope_forward", "rope_backward",
           "attention_softmax_forward", "attention_softmax_backward", "swiglu_forward",
           "swiglu_backward", "crossentropy_forward_backward", "mean_loss",
           "adamw_bias_corrections", "adamw_bias_corrections_table", "adamw_update")

EMBEDDING_TILE = 1024  # ids staged in shared memory per pass (as in the source)
LN_LANE = 32  # features per lane of the layernorm kernels (as in the source)
MAX_D = 32 * LN_LANE  # the widest row the layernorm kernels hold in registers
LAYERNORM_CHUNK = 4  # LN_WARPS: rows per block of layernorm_backward, its partials' partition
THREADS = 256  # elementwise kernels
WARPS = 8  # warp-per-row kernels: rows per block

NULL = np.uint64(0)  # a null pointer argument
i32, i64, f32, f64 = np.int32, np.int64, np.float32, np.float64


def compile_options(precision: str) -> tuple:
    return ("-DOPERAND_BF16",) if precision == "bf16" else ()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _threads_over(n: int, cap: int = 256) -> int:
    """A block of threads over n columns: a multiple of 32, at most cap."""
    return min(cap, 32 * _cdiv(n, 32))


def _opt(a):
    """An optional pointer argument: the array, or null."""
    return NULL if a is None else a


# ---------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------

class Kernels:
    """The module compiled for one precision policy, and one launcher per
    kernel. Arguments are contiguous CuPy arrays (RawKernel checks neither
    strides nor dtypes: the launchers pass explicit numpy scalars). Every
    launch goes to the current CuPy stream, so a launcher called inside a
    stream capture is recorded into the graph."""

    def __init__(self, precision: str):
        self.precision = precision
        module = cupy.RawModule(code=SOURCE, options=compile_options(precision))
        self.functions = {name: module.get_function(name) for name in KERNELS}
        self.launches = 0  # kernel launches so far (the capture counts its own)
        self.trace = None  # a list to log launched kernel names into, or None

    def _launch(self, name, grid, block, args, shared_mem=0):
        # grid: blocks, or a tuple of blocks per dimension
        self.launches += 1
        if self.trace is not None:
            self.trace.append(name)
        grid = tuple(int(g) for g in grid) if isinstance(grid, tuple) else (int(grid),)
        self.functions[name](grid, (int(block),), args, shared_mem=int(shared_mem))

    def _rowwise(self, name, rows, cols, args):
        # 2-D grid: x over the columns, y over the rows (the kernel strides by gridDim.y)
        self._launch(name, (_cdiv(cols, THREADS), min(rows, 65535)), THREADS, args)

    def _elementwise(self, name, n, args):
        assert n < 2**31 or name in ("round_bf16", "adamw_update"), (name, n)  # int indices
        self._launch(name, _cdiv(n, THREADS), THREADS, args)

    # -- precision
    def round_bf16(self, x, out):
        # x (n) float32 -> out (n) bfloat16 bits (uint16)
        self._elementwise("round_bf16", x.size, (x, out, i64(x.size)))

    # -- embedding
    def embedding_forward(self, ids, ids_stride, T, W, x):
        # ids (B, ids_stride), W (V,D) -> x (BT,D)
        BT, D = x.shape
        self._elementwise("embedding_forward", BT * D, (ids, i32(ids_stride), i32(T), W, x,
                                                        i32(BT), i32(D)))

    def embedding_backward(self, dx, ids, ids_stride, T, dW):
        # dx (BT,D), dW (V,D) holding the unembedding gradient: dW += gather gradient
        BT, D = dx.shape
        assert D <= 1024, D  # one thread per feature
        self._launch("embedding_backward", BT, _threads_over(D, 1024),
                     (dx, ids, i32(ids_stride), i32(T), i32(BT), dW, i32(D)))

    # -- layernorm
    def layernorm_forward(self, x_prev, add, x_out, h, mean, rstd, w, b, eps):
        # x_prev (+ add -> x_out) (rows,D) -> h (rows,D) operand, mean, rstd (rows)
        rows, D = x_prev.shape
        assert D <= MAX_D, D
        self._launch("layernorm_forward", _cdiv(rows, WARPS), 32 * WARPS,
                     (x_prev, _opt(add), _opt(x_out), h, mean, rstd, w, b, i32(rows), i32(D),
                      f32(eps)))

    def layernorm_backward(self, dout, dres, x, mean, rstd, w, dx, dx_op, partials):
        # dout (rows,D) -> dx (rows,D) (+ dres), dx_op, partials (chunks, 2D)
        rows, D = dout.shape
        chunks = _cdiv(rows, LAYERNORM_CHUNK)
        assert D <= MAX_D and partials.shape == (chunks, 2 * D), (partials.shape, chunks, D)
        self._launch("layernorm_backward", chunks, 32 * LAYERNORM_CHUNK,
                     (dout, _opt(dres), x, mean, rstd, w, dx, _opt(dx_op), partials, i32(rows),
                      i32(D)), 4 * LAYERNORM_CHUNK * 2 * D)

    def layernorm_param_grads(self, partials, offsets, G):
        # partials (norms, chunks, 2D), offsets (norms) int64 -> G[offset : offset + 2D]
        norms, chunks, twoD = partials.shape
        self._elementwise("layernorm_param_grads", norms * twoD,
                          (partials, offsets, G, i32(norms), i32(chunks), i32(twoD // 2)))

    # -- rope
    def rope_forward(self, qkv, out, cos, sin, T, H):
        # qkv (BT,3D) float32 -> out (BT,3D) operands
        BT, D3 = qkv.shape
        self._rowwise("rope_forward", BT, D3, (qkv, out, cos, sin, i32(BT), i32(T), i32(D3 // 3),
                                               i32(H)))

    def rope_backward(self, dqk, dqkv, cos, sin, T, H):
        # dqk (BT,2D) float32 -> dqkv[:, :2D] (BT,3D) operands
        BT, D2 = dqk.shape
        self._rowwise("rope_backward", BT, D2, (dqk, dqkv, cos, sin, i32(BT), i32(T),
                                                i32(D2 // 2), i32(H)))

    # -- attention
    def attention_softmax_forward(self, s, p_op, scale):
        # s (B,H,T,T) scores -> probabilities in place (+ p_op operands)
        T = s.shape[-1]
        rows = s.size // T
        self._launch("attention_softmax_forward", _cdiv(rows, WARPS), 32 * WARPS,
                     (s, _opt(p_op), i32(rows), i32(T), f32(scale)))

    def attention_softmax_backward(self, p, dp, ds, p_op, scale):
        # p, dp (B,H,T,T) -> ds (B,H,T,T) operands (+ p_op)
        T = p.shape[-1]
        rows = p.size // T
        self._launch("attention_softmax_backward", _cdiv(rows, WARPS), 32 * WARPS,
                     (p, dp, ds, _opt(p_op), i32(rows), i32(T), f32(scale)))

    # -- swiglu
    def swiglu_forward(self, gu, a):
        # gu (BT,2F) -> a (BT,F) operand
        BT, F = a.shape
        self._rowwise("swiglu_forward", BT, F, (gu, a, i32(BT), i32(F)))

    def swiglu_backward(self, da, gu, dgu):
        # da (BT,F), gu (BT,2F) -> dgu (BT,2F) operands
        BT, F = da.shape
        self._rowwise("swiglu_backward", BT, F, (da, gu, dgu, i32(BT), i32(F)))

    # -- loss
    def crossentropy_forward_backward(self, logits, ids, ids_stride, T, ce, dlogits, dce):
        # logits (BT,V) -> ce (BT), dlogits (BT,V) operands for the mean's gradient dce
        BT, V = logits.shape
        self._launch("crossentropy_forward_backward", BT, _threads_over(V, 512),
                     (logits, ids, i32(ids_stride), i32(T), ce, dlogits, i32(V), f32(dce)))

    def mean_loss(self, ce, loss):
        self._launch("mean_loss", 1, 1024, (ce, loss, i32(ce.size)))

    # -- AdamW
    def adamw_bias_corrections(self, t, c, beta1: float, beta2: float):
        # t (1) int32 += 1; c (2) float32 = c1, c2 of the new t
        self._launch("adamw_bias_corrections", 1, 1, (t, c, f64(beta1), f64(beta2)))

    def adamw_bias_corrections_table(self, ts, c1, c2, beta1: float, beta2: float):
        self._elementwise("adamw_bias_corrections_table", ts.size,
                          (ts, c1, c2, i32(ts.size), f64(beta1), f64(beta2)))

    def adamw_update(self, P, M, V, G, decay, Pb, c, k):
        # P, M, V, G (N) float32, decay (N) uint8, Pb (N) bfloat16 bits or None,
        # c (2) the bias corrections, k: reference.adamw.AdamWConstants
        n = P.size
        self._elementwise("adamw_update", n, (P, M, V, G, decay, _opt(Pb), c, i64(n),
                                              f32(k.b1), f32(k.omb1), f32(k.b2), f32(k.omb2),
                                              f32(k.lr), f32(k.lrwd), f32(k.eps)))


def attention_scale(E: int) -> np.float32:
    """float32(1/sqrt(E)), as the reference's q.dtype.type(1.0 / np.sqrt(E))."""
    return np.float32(1.0 / math.sqrt(E))
