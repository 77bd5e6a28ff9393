// ---------------------------------------------------------------- rope

// A row holds heads of E elements side by side from column 0: q's H heads,
// then k's Hkv heads (the layout's q | k columns, reference/layout.py),
// `heads` = H + Hkv of them rotated; the row's columns after them (v's) are
// copied as they are. Of each rotated head the first R elements are
// rotated, half-split within R: element j < R/2 pairs with j + R/2; the
// elements R .. E pass through. cos, sin (T, R/2).
//
// The row-wise kernels run on a 2-D grid: x over a row's items, y over the
// rows (striding by gridDim.y). vec (R a multiple of 8, E a multiple of 4,
// every pointer 16-byte aligned): an item is 4 adjacent pairs (j .. j+3
// with j+R/2 .. j+R/2+3: 2 loads of x, 1 of cos and sin each, 2 chunk
// stores), or a chunk of 4 elements copied (of a head's R .. E, or of the
// columns after the heads). Otherwise an item is one element. Both round
// each product and sum as the reference's float32 operations.

__device__ __forceinline__ float rope_first(float x1, float x2, float c, float s) {
    return __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));  // x1 cos - x2 sin
}
__device__ __forceinline__ float rope_second(float x1, float x2, float c, float s) {
    return __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));  // x2 cos + x1 sin
}

// the rotation by theta of the pair (x1, x2), or (inverse) by -theta: the
// first (or, !first, the second) element of the result
template <bool INVERSE>
__device__ __forceinline__ float rope_value(float x1, float x2, float c, float s, bool first) {
    if (INVERSE)  // d1 cos + d2 sin ; d2 cos - d1 sin
        return first ? __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x2, s))
                     : __fsub_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
    return first ? rope_first(x1, x2, c, s) : rope_second(x1, x2, c, s);
}

// One value of x: float32, or a bfloat16 operand widened exactly
__device__ __forceinline__ float value_of(float x) { return x; }
__device__ __forceinline__ float value_of(unsigned short x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

// 4 values from x: float32 (16 bytes), or bfloat16 operands (8 bytes), widened exactly
__device__ __forceinline__ void load_values(float (&a)[4], const float* x) {
    load_chunk(a, x, 0, 4, true, 0.0f);
}
__device__ __forceinline__ void load_values(float (&a)[4], const unsigned short* x) {
    uint2 u = *reinterpret_cast<const uint2*>(x);
    a[0] = __uint_as_float(u.x << 16);
    a[1] = __uint_as_float(u.x & 0xffff0000u);
    a[2] = __uint_as_float(u.y << 16);
    a[3] = __uint_as_float(u.y & 0xffff0000u);
}

// 4 pairs of a row of x at column `col` and `col + half` -> their rotation,
// as operands into out at the same columns. cs, sn: the cos, sin row of the
// position; j: the pairs' first index.
template <bool INVERSE, class X>
__device__ __forceinline__ void rope_pairs(const X* x, floatX* out, int col, int half,
                                           const float* cs, const float* sn, int j) {
    float x1[4], x2[4], c[4], s[4], y1[4], y2[4];
    load_values(x1, x + col);
    load_values(x2, x + col + half);
    load_values(c, cs + j);
    load_values(s, sn + j);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        y1[i] = rope_value<INVERSE>(x1[i], x2[i], c[i], s[i], true);
        y2[i] = rope_value<INVERSE>(x1[i], x2[i], c[i], s[i], false);
    }
    store_operand_chunk(out + col, 0, 4, true, y1);
    store_operand_chunk(out + col + half, 0, 4, true, y2);
}

// the column of copied chunk c of a row (vec): the heads' elements R .. E,
// head by head, then the columns after the heads
__device__ __forceinline__ int rope_copy_column(int c, int heads, int E, int R) {
    int per_head = (E - R) / 4;
    if (c < heads * per_head) {
        int head = c / per_head;
        return head * E + R + 4 * (c - head * per_head);
    }
    return heads * E + 4 * (c - heads * per_head);
}

// x (BT, ldx) -> out (BT, ldo) operands, columns 0 .. ldx: the first
// `heads` heads of E rotated (by theta, or INVERSE by -theta) in their
// first R elements, everything else copied. vec: heads R/8 items of pairs,
// then (heads (E - R) + ldx - heads E) / 4 chunks copied per row; else ldx
// elements per row.
template <bool INVERSE, class X>
__device__ __forceinline__ void rope_rows(const X* __restrict__ x, floatX* __restrict__ out,
                                          const float* __restrict__ cos_t,
                                          const float* __restrict__ sin_t, int BT, int T,
                                          int heads, int E, int R, int ldx, int ldo, int vec) {
    int item = blockIdx.x * blockDim.x + threadIdx.x;
    int half = R / 2, rotated = heads * E;
    if (vec) {
        int groups = half / 4;  // items of pairs per head
        int pairs = heads * groups;
        if (item >= pairs + (heads * (E - R) + ldx - rotated) / 4) return;
        int head = item / groups, j = 4 * (item - head * groups);  // (items of pairs)
        int col = item < pairs ? head * E + j : rope_copy_column(item - pairs, heads, E, R);
        for (int row = blockIdx.y; row < BT; row += gridDim.y) {
            const X* xr = x + (long long)row * ldx;
            floatX* o = out + (long long)row * ldo;
            if (item < pairs) {
                int t = row % T;
                rope_pairs<INVERSE>(xr, o, col, half, cos_t + t * half, sin_t + t * half, j);
            } else {
                float v[4];
                load_values(v, xr + col);
                store_operand_chunk(o + col, 0, 4, true, v);
            }
        }
        return;
    }
    int col = item;
    if (col >= ldx) return;
    int e = col % E;
    int head = col - e;  // element 0 of this head in the row
    bool turned = col < rotated && e < R;
    int j = e < half ? e : e - half;
    for (int row = blockIdx.y; row < BT; row += gridDim.y) {
        const X* xr = x + (long long)row * ldx;
        float v;
        if (!turned) {
            v = value_of(xr[col]);
        } else {
            int t = row % T;
            float x1 = value_of(xr[head + j]), x2 = value_of(xr[head + j + half]);
            float c = cos_t[t * half + j], s = sin_t[t * half + j];
            v = rope_value<INVERSE>(x1, x2, c, s, e < half);
        }
        out[(long long)row * ldo + col] = to_operand(v);
    }
}

// qkv (BT,W) float32, the q, k, v projections side by side -> out (BT,W)
// operands: q's and k's heads rotated, v as is
extern "C" __global__ void rope_forward(const float* __restrict__ qkv, floatX* __restrict__ out,
                                        const float* __restrict__ cos_t,
                                        const float* __restrict__ sin_t, int BT, int T, int heads,
                                        int E, int R, int W, int vec) {
    AFTER_PRIOR_GRIDS();
    rope_rows<false>(qkv, out, cos_t, sin_t, BT, T, heads, E, R, W, W, vec);
}

// dqk (BT,ldx) gradients of the rotated q, k (ldx = qk), or of q, k and v
// side by side (ldx = W: dv copied) -> dqkv[:, :ldx] (row stride W)
// operands: the rotation by -theta (the rotation is orthogonal), the
// elements R .. E of each head and dv as they are. X: float32 gradients
// (the project's attention backward), or the bfloat16 operands cuDNN's
// attention backward writes.
extern "C" __global__ void rope_backward(const float* __restrict__ dqk, floatX* __restrict__ dqkv,
                                         const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, int BT, int T,
                                         int heads, int E, int R, int ldx, int W, int vec) {
    AFTER_PRIOR_GRIDS();
    rope_rows<true>(dqk, dqkv, cos_t, sin_t, BT, T, heads, E, R, ldx, W, vec);
}

// after cuDNN's attention: dq, dk as the bfloat16 operands it writes
extern "C" __global__ void rope_backward_operand(const floatX* __restrict__ dqk,
                                                 floatX* __restrict__ dqkv,
                                                 const float* __restrict__ cos_t,
                                                 const float* __restrict__ sin_t, int BT, int T,
                                                 int heads, int E, int R, int ldx, int W,
                                                 int vec) {
    AFTER_PRIOR_GRIDS();
    rope_rows<true>(dqk, dqkv, cos_t, sin_t, BT, T, heads, E, R, ldx, W, vec);
}
