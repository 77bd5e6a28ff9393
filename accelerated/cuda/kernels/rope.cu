// ---------------------------------------------------------------- rope

// The row-wise kernels run on a 2-D grid: x over a row's items, y over the
// rows (striding by gridDim.y). Half-split pairs: element j of a head pairs
// with element j + E/2; cos, sin (T,E/2).
//
// vec (E a multiple of 8, every pointer 16-byte aligned): an item is 4
// adjacent pairs (j .. j+3 with j+E/2 .. j+E/2+3: 4 16-byte loads of x, and
// 4 of cos and sin each -- 2 -- then 2 chunk stores), or a chunk of v.
// Otherwise an item is one element. Both round each product and sum as the
// reference's float32 operations.

__device__ __forceinline__ float rope_first(float x1, float x2, float c, float s) {
    return __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));  // x1 cos - x2 sin
}
__device__ __forceinline__ float rope_second(float x1, float x2, float c, float s) {
    return __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));  // x2 cos + x1 sin
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

// 4 pairs of a row of x at column `col` and `col + half` -> the rotation by
// theta (or, inverse, by -theta), as operands into out at the same columns.
// cs, sn: the cos, sin row of the position; j: the pairs' first index.
template <class X>
__device__ __forceinline__ void rope_pairs(const X* x, floatX* out, int col, int half,
                                           const float* cs, const float* sn, int j, bool inverse) {
    float x1[4], x2[4], c[4], s[4], y1[4], y2[4];
    load_values(x1, x + col);
    load_values(x2, x + col + half);
    load_values(c, cs + j);
    load_values(s, sn + j);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (inverse) {  // d1 cos + d2 sin ; d2 cos - d1 sin
            y1[i] = __fadd_rn(__fmul_rn(x1[i], c[i]), __fmul_rn(x2[i], s[i]));
            y2[i] = __fsub_rn(__fmul_rn(x2[i], c[i]), __fmul_rn(x1[i], s[i]));
        } else {
            y1[i] = rope_first(x1[i], x2[i], c[i], s[i]);
            y2[i] = rope_second(x1[i], x2[i], c[i], s[i]);
        }
    }
    store_operand_chunk(out + col, 0, 4, true, y1);
    store_operand_chunk(out + col + half, 0, 4, true, y2);
}

// qkv (BT,3D) float32, the q, k, v projections side by side -> out (BT,3D)
// operands: q and k rotated, v as is. vec: D/4 items of pairs (q then k),
// then D/4 chunks of v per row; else 3D elements per row.
extern "C" __global__ void rope_forward(const float* __restrict__ qkv, floatX* __restrict__ out,
                                        const float* __restrict__ cos_t,
                                        const float* __restrict__ sin_t, int BT, int T, int D,
                                        int H, int vec) {
    int item = blockIdx.x * blockDim.x + threadIdx.x;
    int E = D / H, half = E / 2;
    if (vec) {
        if (item >= D / 2) return;
        int groups = half / 4;  // items per head
        int head = item / groups, j = 4 * (item - head * groups);  // head of q (then k)
        for (int row = blockIdx.y; row < BT; row += gridDim.y) {
            const float* x = qkv + (long long)row * 3 * D;
            floatX* o = out + (long long)row * 3 * D;
            if (item < D / 4) {
                int t = row % T;
                rope_pairs(x, o, head * E + j, half, cos_t + t * half, sin_t + t * half, j, false);
            } else {
                int col = 2 * D + 4 * (item - D / 4);
                float v[4];
                load_chunk(v, x + col, 0, 4, true, 0.0f);
                store_operand_chunk(o + col, 0, 4, true, v);
            }
        }
        return;
    }
    int col = item;
    if (col >= 3 * D) return;
    int e = col % E;
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
            v = e < half ? rope_first(x1, x2, c, s) : rope_second(x1, x2, c, s);
        }
        out[(long long)row * 3 * D + col] = to_operand(v);
    }
}

// One value of x: float32, or a bfloat16 operand widened exactly
__device__ __forceinline__ float value_of(float x) { return x; }
__device__ __forceinline__ float value_of(unsigned short x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

// dqk (BT,2D) gradients of the rotated q, k -> dqkv[:, :2D] (row stride 3D)
// operands: the rotation by -theta (the rotation is orthogonal). X: float32
// gradients (the project's attention backward), or the bfloat16 operands
// cuDNN's attention backward writes. vec: D/4 items of pairs per row; else
// 2D elements.
template <class X>
__device__ __forceinline__ void rope_backward_rows(const X* __restrict__ dqk,
                                                   floatX* __restrict__ dqkv,
                                                   const float* __restrict__ cos_t,
                                                   const float* __restrict__ sin_t, int BT, int T,
                                                   int D, int H, int vec) {
    int item = blockIdx.x * blockDim.x + threadIdx.x;
    int E = D / H, half = E / 2;
    if (vec) {
        if (item >= D / 4) return;
        int groups = half / 4;
        int head = item / groups, j = 4 * (item - head * groups);
        for (int row = blockIdx.y; row < BT; row += gridDim.y) {
            int t = row % T;
            rope_pairs(dqk + (long long)row * 2 * D, dqkv + (long long)row * 3 * D, head * E + j,
                       half, cos_t + t * half, sin_t + t * half, j, true);
        }
        return;
    }
    int col = item;
    if (col >= 2 * D) return;
    int e = col % E;
    int head = col - e;
    int j = e < half ? e : e - half;
    for (int row = blockIdx.y; row < BT; row += gridDim.y) {
        const X* g = dqk + (long long)row * 2 * D;
        int t = row % T;
        float d1 = value_of(g[head + j]), d2 = value_of(g[head + j + half]);
        float c = cos_t[t * half + j], s = sin_t[t * half + j];
        float v = e < half ? __fadd_rn(__fmul_rn(d1, c), __fmul_rn(d2, s))
                           : __fsub_rn(__fmul_rn(d2, c), __fmul_rn(d1, s));
        dqkv[(long long)row * 3 * D + col] = to_operand(v);
    }
}

extern "C" __global__ void rope_backward(const float* __restrict__ dqk, floatX* __restrict__ dqkv,
                                         const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, int BT, int T, int D,
                                         int H, int vec) {
    rope_backward_rows(dqk, dqkv, cos_t, sin_t, BT, T, D, H, vec);
}

// after cuDNN's attention: dq, dk as the bfloat16 operands it writes
extern "C" __global__ void rope_backward_operand(const floatX* __restrict__ dqk,
                                                 floatX* __restrict__ dqkv,
                                                 const float* __restrict__ cos_t,
                                                 const float* __restrict__ sin_t, int BT, int T,
                                                 int D, int H, int vec) {
    rope_backward_rows(dqk, dqkv, cos_t, sin_t, BT, T, D, H, vec);
}
