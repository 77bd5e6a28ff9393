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

// ---------------------------------------------------------------- fused attention (bf16)

// Causal attention without the (B,H,T,T) scores, flash-attention style, for
// the bf16 policy: q, k, v, dy are bfloat16 operands and every product is a
// tensor-core mma.sync m16n8k16 (bfloat16 operands, float32 accumulation),
// as SPEC 6 asks of q k^T, p v and the backward's products. One block of 4
// warps owns 64 rows (ATT_TILE); each warp 16 of them. Keys come in tiles
// of 64 through shared memory; tiles wholly above the diagonal are skipped.
//
// The probabilities are the reference's: s = (q k^T) * scale (float32), the
// row maximum m subtracted before exp, p = exp(s - m) / l with l the row sum.
// The forward makes two passes over the keys: the first finds m and l (an
// online maximum, the partial sums rescaled), the second forms the
// normalized p, rounds it to a bfloat16 operand and multiplies it with v, so
// the operand is round(p) exactly as in the reference (a one-pass online
// softmax would round the unnormalized exp instead). m and l are kept per
// row for the backward (as m * log2(e) and 1 / l), which recomputes p
// from them (nothing of size T^2 is stored). exp(s - m) is evaluated as
// exp2((q k^T) * scale * log2(e) - m * log2(e)): one fma and one ex2.
// The backward's row term dot = sum_j dp_j p_j is summed over the keys as
// the reference does (not as the shortcut dy . y, whose y was computed from
// rounded operands: it would make ds of a row with one key nonzero). No atomics: dq is summed per query tile by
// one block (attention_backward_dq), dk and dv per key tile by another
// (attention_backward_dkdv), each over the tiles in order.

#define ATT_TILE 64  // rows of a query tile and of a key tile
#define ATT_PAD 8    // bfloat16 padding per shared-memory row: fragment loads hit distinct banks

typedef unsigned short bf16;

// two float32 -> two bfloat16 (round to nearest even) in one instruction, lo in the low half
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// exp(s - m) is evaluated as exp2(q k^T * c - m2), c = scale * log2(e), m2 =
// the row maximum of q k^T times c: one fma and one ex2 per score
#define ATT_LOG2E 1.4426950408889634f
__device__ __forceinline__ float att_exp(float raw, float c, float m2) {
    return exp2f(fmaf(raw, c, -m2));
}

// c (16x8 float32) += a (16x16 bfloat16, row-major fragment) @ b (16x8 bfloat16)
__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Fragment layouts of m16n8k16 (g = lane / 4, u = lane % 4): a holds rows g
// and g+8, columns 2u, 2u+1 and 2u+8, 2u+9; b holds column g, rows 2u, 2u+1
// and 2u+8, 2u+9; c holds rows g and g+8, columns 2u, 2u+1.

// a: rows r0.. r0+16, columns k0.. k0+16 of shared X (row stride S)
__device__ __forceinline__ void frag_a(unsigned* a, const bf16* X, int S, int r0, int k0, int g,
                                       int u) {
    a[0] = *(const unsigned*)(X + (r0 + g) * S + k0 + 2 * u);
    a[1] = *(const unsigned*)(X + (r0 + g + 8) * S + k0 + 2 * u);
    a[2] = *(const unsigned*)(X + (r0 + g) * S + k0 + 8 + 2 * u);
    a[3] = *(const unsigned*)(X + (r0 + g + 8) * S + k0 + 8 + 2 * u);
}

// b[k][n] = X[n0 + n][k0 + k]: the product with X^T
__device__ __forceinline__ void frag_b(unsigned& b0, unsigned& b1, const bf16* X, int S, int n0,
                                       int k0, int g, int u) {
    b0 = *(const unsigned*)(X + (n0 + g) * S + k0 + 2 * u);
    b1 = *(const unsigned*)(X + (n0 + g) * S + k0 + 8 + 2 * u);
}

// 16 bytes global -> shared without passing through registers (cp.async),
// zero-filled when !valid; completes at cp_async_wait
__device__ __forceinline__ void cp_async16(bf16* dst, const bf16* src, bool valid) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
                 "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// all but the newest n groups of this thread's copies have landed
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Start copying rows r0 .. r0+64 of a (n, E) bfloat16 matrix with row stride
// ld into shared dst (64, E + ATT_PAD); rows at or past n become zero. All
// threads; the copy is one of the caller's cp.async groups.
template <int E>
__device__ __forceinline__ void att_fetch(const bf16* src, int ld, int r0, int n, bf16* dst) {
    constexpr int VEC = E / 8;
    for (int i = threadIdx.x; i < ATT_TILE * VEC; i += blockDim.x) {
        int r = i / VEC, c = (i % VEC) * 8;
        bool ok = r0 + r < n;
        cp_async16(dst + r * (E + ATT_PAD) + c, src + (long long)(ok ? r0 + r : 0) * ld + c, ok);
    }
}

// b fragments of two adjacent 16x8 tiles of Z (row-major, row stride S):
// b[k][n] = Z[k0 + k][n0 + n] for n0 and n0 + 8, by ldmatrix.trans (lanes
// 0-15 address rows k0.. k0+16 at column n0, lanes 16-31 the same rows at n0 + 8)
__device__ __forceinline__ void frag_b_trans(unsigned (&b)[4], const bf16* Z, int S, int k0,
                                             int n0, int lane) {
    unsigned a = (unsigned)__cvta_generic_to_shared(Z + (k0 + (lane & 15)) * S + n0 +
                                                    8 * (lane >> 4));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(a));
}

// s (16 rows x 64 columns) = a (16 x E fragments) @ X^T, X (64, E + ATT_PAD) shared
template <int E>
__device__ __forceinline__ void att_product_t(float (&s)[8][4], const unsigned (&a)[E / 16][4],
                                              const bf16* X, int g, int u) {
#pragma unroll
    for (int n = 0; n < 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < E / 16; kk++) {
#pragma unroll
        for (int n = 0; n < 8; n++) {
            unsigned b0, b1;
            frag_b(b0, b1, X, E + ATT_PAD, 8 * n, 16 * kk, g, u);
            mma_bf16(s[n], a[kk], b0, b1);
        }
    }
}

// o (16 rows x E) += p (16 x 64, float32 in the c layout, rounded to
// bfloat16 here) @ Z, Z (64, E + ATT_PAD) shared, row-major. The c layout
// of two adjacent 16x8 tiles is the a layout of one 16x16.
template <int E>
__device__ __forceinline__ void att_product(float (&o)[E / 8][4], const float (&p)[8][4],
                                            const bf16* Z, int lane) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        unsigned a[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]),
                         pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                         pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                         pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < E / 16; n++) {
            unsigned b[4];
            frag_b_trans(b, Z, E + ATT_PAD, 16 * kk, 16 * n, lane);
            mma_bf16(o[2 * n], a, b[0], b[1]);
            mma_bf16(o[2 * n + 1], a, b[2], b[3]);
        }
    }
}

// the maximum and the sum over the 4 lanes holding one row (the same value in each)
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// q k^T on this warp's rows of the diagonal tile: -inf where the key j >
// query i or j >= T (c layout: element [n][c] is row i0 + g + 8 (c / 2), key
// j0 + 8 n + 2 u + c % 2). Tiles below the diagonal need no mask.
__device__ __forceinline__ void att_mask(float (&s)[8][4], int i0, int j0, int T, int g, int u) {
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int i = i0 + g + 8 * (c >> 1), j = j0 + 8 * n + 2 * u + (c & 1);
            if (!(j <= i && j < T)) s[n][c] = NEG_INF;
        }
}

// qkv (BT,3D) operands -> y (BT,D) operand; m, l (B,H,T): the row maximum
// of s times log2(e), and 1 / the row sum of exp(s - m). grid (query tiles,
// B*H), 128 threads.
template <int E>
__device__ void attention_forward_tile(const bf16* qkv, bf16* y, float* stat_m, float* stat_l,
                                       int T, int H, float scale) {
    constexpr int TILE = ATT_TILE * (E + ATT_PAD);
    __shared__ __align__(16) bf16 ks[2][TILE];  // double buffers: tile kt + 1 lands
    __shared__ __align__(16) bf16 vs[2][TILE];  // while tile kt is used
    int D = H * E, tiles = (T + ATT_TILE - 1) / ATT_TILE;
    int qt = tiles - 1 - blockIdx.x;  // the longest rows start first
    int bh = blockIdx.y, b = bh / H, h = bh % H;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, u = lane & 3;
    const bf16* q = qkv + (long long)b * T * 3 * D + h * E;
    const bf16* k = q + D;
    const bf16* v = q + 2 * D;
    int i0 = qt * ATT_TILE + warp * 16;  // this warp's rows: i0 + g and i0 + g + 8
    unsigned qa[E / 16][4];
    att_fetch<E>(q, 3 * D, qt * ATT_TILE, T, vs[1]);
    att_fetch<E>(k, 3 * D, 0, T, ks[0]);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < E / 16; kk++)
        frag_a(qa[kk], vs[1], E + ATT_PAD, warp * 16, 16 * kk, g, u);
    __syncthreads();
    // pass 1: the row maximum m (times c) and the row sum l
    float c2 = scale * ATT_LOG2E;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    for (int kt = 0; kt <= qt; kt++) {
        if (kt < qt) att_fetch<E>(k, 3 * D, (kt + 1) * ATT_TILE, T, ks[(kt + 1) & 1]);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        float s[8][4];
        att_product_t<E>(s, qa, ks[kt & 1], g, u);
        __syncthreads();  // the buffer is refilled next
        if (kt == qt) att_mask(s, i0, kt * ATT_TILE, T, g, u);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = NEG_INF;
#pragma unroll
            for (int n = 0; n < 8; n++) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
            // finite: every tile holds a key j <= i, j < T for each row
            float mn = fmaxf(m[r], quad_max(mx) * c2);
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < 8; n++)
                sum += att_exp(s[n][2 * r], c2, mn) + att_exp(s[n][2 * r + 1], c2, mn);
            l[r] = l[r] * exp2f(m[r] - mn) + sum;
            m[r] = mn;
        }
    }
    l[0] = 1.0f / quad_sum(l[0]);  // kept as its reciprocal
    l[1] = 1.0f / quad_sum(l[1]);
    // pass 2: y = round(p) v with p = exp(s - m) / l
    float o[E / 8][4];
#pragma unroll
    for (int n = 0; n < E / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    att_fetch<E>(k, 3 * D, 0, T, ks[0]);
    att_fetch<E>(v, 3 * D, 0, T, vs[0]);
    cp_async_commit();
    for (int kt = 0; kt <= qt; kt++) {
        if (kt < qt) {
            att_fetch<E>(k, 3 * D, (kt + 1) * ATT_TILE, T, ks[(kt + 1) & 1]);
            att_fetch<E>(v, 3 * D, (kt + 1) * ATT_TILE, T, vs[(kt + 1) & 1]);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        float s[8][4];
        att_product_t<E>(s, qa, ks[kt & 1], g, u);
        if (kt == qt) att_mask(s, i0, kt * ATT_TILE, T, g, u);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) s[n][c] = att_exp(s[n][c], c2, m[c >> 1]) * l[c >> 1];
        att_product<E>(o, s, vs[kt & 1], lane);
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int i = i0 + g + 8 * r;
        if (i >= T) continue;
        bf16* yr = y + (long long)(b * T + i) * D + h * E;
#pragma unroll
        for (int n = 0; n < E / 8; n++)
            *(unsigned*)(yr + 8 * n + 2 * u) = pack_bf16(o[n][2 * r], o[n][2 * r + 1]);
        if (u == 0) {
            stat_m[(long long)bh * T + i] = m[r];
            stat_l[(long long)bh * T + i] = l[r];
        }
    }
}

// p and dp of this warp's rows against one key tile (both in the c layout):
// p = exp(s - m) / l from the forward's m, 1 / l; dp = dy v^T
template <int E>
__device__ __forceinline__ void att_recompute(float (&s)[8][4], float (&dp)[8][4],
                                              const unsigned (&qa)[E / 16][4],
                                              const unsigned (&da)[E / 16][4], const bf16* ks,
                                              const bf16* vs, const float* m, const float* l,
                                              int i0, int j0, int T, float scale, bool diagonal,
                                              int g, int u) {
    att_product_t<E>(s, qa, ks, g, u);
    att_product_t<E>(dp, da, vs, g, u);
    if (diagonal) att_mask(s, i0, j0, T, g, u);
    float c2 = scale * ATT_LOG2E;
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) s[n][c] = att_exp(s[n][c], c2, m[c >> 1]) * l[c >> 1];
}

// dy (BT,D) operand -> dq (into dqk (BT,2D), float32) and dot (B,H,T) =
// sum_j dp_j p_j per row. grid (query tiles, B*H), 128 threads.
template <int E>
__device__ void attention_backward_dq_tile(const bf16* qkv, const bf16* dy, const float* stat_m,
                                           const float* stat_l, float* stat_dot, float* dqk, int T,
                                           int H, float scale) {
    constexpr int TILE = ATT_TILE * (E + ATT_PAD);
    __shared__ __align__(16) bf16 ks[2][TILE];
    __shared__ __align__(16) bf16 vs[2][TILE];
    int D = H * E, tiles = (T + ATT_TILE - 1) / ATT_TILE;
    int qt = tiles - 1 - blockIdx.x;
    int bh = blockIdx.y, b = bh / H, h = bh % H;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, u = lane & 3;
    const bf16* q = qkv + (long long)b * T * 3 * D + h * E;
    const bf16* k = q + D;
    const bf16* v = q + 2 * D;
    const bf16* dyb = dy + (long long)b * T * D + h * E;
    int i0 = qt * ATT_TILE + warp * 16;
    unsigned qa[E / 16][4], da[E / 16][4];
    att_fetch<E>(q, 3 * D, qt * ATT_TILE, T, ks[1]);
    att_fetch<E>(dyb, D, qt * ATT_TILE, T, vs[1]);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < E / 16; kk++) {
        frag_a(qa[kk], ks[1], E + ATT_PAD, warp * 16, 16 * kk, g, u);
        frag_a(da[kk], vs[1], E + ATT_PAD, warp * 16, 16 * kk, g, u);
    }
    __syncthreads();
    float m[2], l[2], dot[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int i = i0 + g + 8 * r;
        m[r] = i < T ? stat_m[(long long)bh * T + i] : 0.0f;
        l[r] = i < T ? stat_l[(long long)bh * T + i] : 1.0f;
    }
    // pass 1: dot = sum_j dp_j p_j; pass 2: ds = p (dp - dot) * scale, rounded; dq = ds k
    float o[E / 8][4];
#pragma unroll
    for (int n = 0; n < E / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    for (int pass = 0; pass < 2; pass++) {
        att_fetch<E>(k, 3 * D, 0, T, ks[0]);
        att_fetch<E>(v, 3 * D, 0, T, vs[0]);
        cp_async_commit();
        for (int kt = 0; kt <= qt; kt++) {
            if (kt < qt) {
                att_fetch<E>(k, 3 * D, (kt + 1) * ATT_TILE, T, ks[(kt + 1) & 1]);
                att_fetch<E>(v, 3 * D, (kt + 1) * ATT_TILE, T, vs[(kt + 1) & 1]);
            }
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
            float s[8][4], dp[8][4];
            att_recompute<E>(s, dp, qa, da, ks[kt & 1], vs[kt & 1], m, l, i0, kt * ATT_TILE, T,
                             scale, kt == qt, g, u);
            if (pass == 0) {
#pragma unroll
                for (int n = 0; n < 8; n++)
#pragma unroll
                    for (int c = 0; c < 4; c++) dot[c >> 1] += dp[n][c] * s[n][c];
            } else {
#pragma unroll
                for (int n = 0; n < 8; n++)
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        s[n][c] = __fmul_rn(__fmul_rn(s[n][c], __fsub_rn(dp[n][c], dot[c >> 1])),
                                            scale);
                att_product<E>(o, s, ks[kt & 1], lane);
            }
            __syncthreads();
        }
        if (pass == 0) {
            dot[0] = quad_sum(dot[0]);
            dot[1] = quad_sum(dot[1]);
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int i = i0 + g + 8 * r;
        if (i >= T) continue;
        float* dq = dqk + (long long)(b * T + i) * 2 * D + h * E;
#pragma unroll
        for (int n = 0; n < E / 8; n++)
            *(float2*)(dq + 8 * n + 2 * u) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
        if (u == 0) stat_dot[(long long)bh * T + i] = dot[r];
    }
}

// -> dk (into dqk (BT,2D) at column D, float32) and dv (into dqkv (BT,3D) at
// column 2D, operand). One block per key tile; its warps hold 16 keys each
// and walk the query tiles on and below the diagonal, computing the
// transposed tiles s^T = k q^T and dp^T = v dy^T. grid (key tiles, B*H).
template <int E>
__device__ void attention_backward_dkdv_tile(const bf16* qkv, const bf16* dy, const float* stat_m,
                                             const float* stat_l, const float* stat_dot,
                                             float* dqk, bf16* dqkv, int T, int H, float scale) {
    constexpr int TILE = ATT_TILE * (E + ATT_PAD);
    __shared__ __align__(16) bf16 qs[2][TILE];
    __shared__ __align__(16) bf16 dys[2][TILE];
    __shared__ float sm[2][ATT_TILE], sl[2][ATT_TILE], sd[2][ATT_TILE];
    int D = H * E, tiles = (T + ATT_TILE - 1) / ATT_TILE;
    int kt = blockIdx.x;  // the key tiles with the most query tiles start first
    int bh = blockIdx.y, b = bh / H, h = bh % H;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, u = lane & 3;
    const bf16* q = qkv + (long long)b * T * 3 * D + h * E;
    const bf16* k = q + D;
    const bf16* v = q + 2 * D;
    const bf16* dyb = dy + (long long)b * T * D + h * E;
    int j0 = kt * ATT_TILE + warp * 16;  // this warp's keys: j0 + g and j0 + g + 8
    unsigned ka[E / 16][4], va[E / 16][4];
    att_fetch<E>(k, 3 * D, kt * ATT_TILE, T, qs[1]);
    att_fetch<E>(v, 3 * D, kt * ATT_TILE, T, dys[1]);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < E / 16; kk++) {
        frag_a(ka[kk], qs[1], E + ATT_PAD, warp * 16, 16 * kk, g, u);
        frag_a(va[kk], dys[1], E + ATT_PAD, warp * 16, 16 * kk, g, u);
    }
    __syncthreads();
    float dk[E / 8][4], dv[E / 8][4];
#pragma unroll
    for (int n = 0; n < E / 8; n++) {
        dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.0f;
        dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;
    }
    float c2 = scale * ATT_LOG2E;
    // the query tile's rows and their m, 1/l and dot, into buffer f
    auto fetch = [&](int qt, int f) {
        att_fetch<E>(q, 3 * D, qt * ATT_TILE, T, qs[f]);
        att_fetch<E>(dyb, D, qt * ATT_TILE, T, dys[f]);
        for (int r = threadIdx.x; r < ATT_TILE; r += blockDim.x) {
            int i = qt * ATT_TILE + r;
            sm[f][r] = i < T ? stat_m[(long long)bh * T + i] : 0.0f;
            sl[f][r] = i < T ? stat_l[(long long)bh * T + i] : 1.0f;
            sd[f][r] = i < T ? stat_dot[(long long)bh * T + i] : 0.0f;
        }
    };
    fetch(kt, kt & 1);
    cp_async_commit();
    for (int qt = kt; qt < tiles; qt++) {
        int f = qt & 1, i_base = qt * ATT_TILE;
        if (qt + 1 < tiles) fetch(qt + 1, (qt + 1) & 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        float s[8][4], dp[8][4];  // [n][c]: key j0 + g + 8 (c / 2), query i_base + 8 n + 2 u + c % 2
        att_product_t<E>(s, ka, qs[f], g, u);
        att_product_t<E>(dp, va, dys[f], g, u);
        bool edge = qt == kt || i_base + ATT_TILE > T;  // the diagonal, or queries past T
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int ii = 8 * n + 2 * u + (c & 1), i = i_base + ii, j = j0 + g + 8 * (c >> 1);
                float p = att_exp(s[n][c], c2, sm[f][ii]) * sl[f][ii];
                if (edge && !(j <= i && i < T)) p = 0.0f;
                s[n][c] = p;
                dp[n][c] = __fmul_rn(__fmul_rn(p, __fsub_rn(dp[n][c], sd[f][ii])), scale);
            }
        att_product<E>(dv, s, dys[f], lane);  // dv += p^T dy
        att_product<E>(dk, dp, qs[f], lane);  // dk += ds^T q
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int j = j0 + g + 8 * r;
        if (j >= T) continue;
        float* dkr = dqk + (long long)(b * T + j) * 2 * D + D + h * E;
        bf16* dvr = dqkv + (long long)(b * T + j) * 3 * D + 2 * D + h * E;
#pragma unroll
        for (int n = 0; n < E / 8; n++) {
            *(float2*)(dkr + 8 * n + 2 * u) = make_float2(dk[n][2 * r], dk[n][2 * r + 1]);
            *(unsigned*)(dvr + 8 * n + 2 * u) = pack_bf16(dv[n][2 * r], dv[n][2 * r + 1]);
        }
    }
}

// one set of entry points per head dimension (E a multiple of 16, at most 64)
#define ATTENTION_KERNELS(E)                                                                      \
    extern "C" __global__ void __launch_bounds__(128)                                            \
        attention_forward_e##E(const bf16* qkv, bf16* y, float* m, float* l, int T, int H,       \
                               float scale) {                                                     \
        attention_forward_tile<E>(qkv, y, m, l, T, H, scale);                                     \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(128)                                            \
        attention_backward_dq_e##E(const bf16* qkv, const bf16* y, const bf16* dy,               \
                                   const float* m, const float* l, float* dot, float* dqk, int T, \
                                   int H, float scale) {                                          \
        attention_backward_dq_tile<E>(qkv, dy, m, l, dot, dqk, T, H, scale);                      \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(128)                                            \
        attention_backward_dkdv_e##E(const bf16* qkv, const bf16* dy, const float* m,            \
                                     const float* l, const float* dot, float* dqk, bf16* dqkv,   \
                                     int T, int H, float scale) {                                 \
        attention_backward_dkdv_tile<E>(qkv, dy, m, l, dot, dqk, dqkv, T, H, scale);              \
    }
ATTENTION_KERNELS(16)
ATTENTION_KERNELS(32)
ATTENTION_KERNELS(64)

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
           "attention_softmax_forward", "attention_softmax_backward",
           *(f"attention_{part}_e{E}" for E in (16, 32, 64)
             for part in ("forward", "backward_dq", "backward_dkdv")),
           "swiglu_forward",
           "swiglu_backward", "crossentropy_forward_backward", "mean_loss",
           "adamw_bias_corrections", "adamw_bias_corrections_table", "adamw_update")

ATTENTION_HEAD_DIMS = (16, 32, 64)  # head dims with fused attention kernels (as in the source)
# From this batch on the step's attention is fused. The fused kernels' grid
# is B*H*T/64 blocks of 4 warps and the longest block walks every key tile,
# so with few blocks the chip idles. Per layer, coppelius on an H200, fused
# vs materialized ms (dev/cuda/NOTES.md): B=1 0.111 vs 0.102, B=2 0.149 vs
# 0.206, B=4 0.235 vs 0.397, B=8 0.394 vs 0.769.
ATTENTION_FUSED_MIN_BATCH = 4
ATTENTION_TILE = 64  # ATT_TILE: query rows per block of the fused kernels, keys per tile
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

    # fused attention (bf16 policy, E in ATTENTION_HEAD_DIMS): q, k, v are
    # read from qkv (BT,3D) operands, head h at column h*E of each third
    def _attention(self, part, E, B, T, H, args):
        assert E in ATTENTION_HEAD_DIMS, E
        self._launch(f"attention_{part}_e{E}", (_cdiv(T, ATTENTION_TILE), B * H), 128, args)

    def attention_forward(self, qkv, y, m, l, B, T, H, scale):
        # qkv (BT,3D) -> y (BT,D) operand; kept: m, l (B,H,T), the row maximum
        # of the scores times log2(e) and 1 / the row sum of exp(s - m)
        E = qkv.shape[1] // 3 // H
        self._attention("forward", E, B, T, H, (qkv, y, m, l, i32(T), i32(H), f32(scale)))

    def attention_backward(self, qkv, y, dy, m, l, dot, dqk, dqkv, B, T, H, scale):
        # y (BT,D) the forward's output, dy (BT,D) operands -> dq, dk into dqk
        # (BT,2D) float32, dv into dqkv[:, 2D:] operand; dot (B,H,T) scratch:
        # sum_j dp p per row, written by the first kernel
        E = qkv.shape[1] // 3 // H
        self._attention("backward_dq", E, B, T, H, (qkv, y, dy, m, l, dot, dqk, i32(T), i32(H),
                                                    f32(scale)))
        self._attention("backward_dkdv", E, B, T, H, (qkv, dy, m, l, dot, dqk, dqkv, i32(T),
                                                      i32(H), f32(scale)))

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
