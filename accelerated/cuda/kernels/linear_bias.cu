// ---------------------------------------------------------------- linear_bias

// The biases of the q, k and v products (SPEC 21, qkv_bias) on the fused
// q | k | v row (rows, W) of the step's layout: columns [0, K) are q's,
// [K, Vc) k's, [Vc, W) v's. The biases bq (K), bk (Vc - K), bv (W - Vc)
// are three vectors of P, each right after its weight (so neither adjacent
// to each other nor to the next weight). vec (W, K and Vc multiples of 4,
// every pointer 16-byte aligned): an item is a chunk of 4 columns, inside
// one of the three blocks; else one column.
#define LB_GROUPS 8  // row groups (warps) per block of the bias gradient kernels

// the bias vector (or its gradient) of column `col`, and the column's index into it
template <class P>
__device__ __forceinline__ P linear_bias_of(P bq, P bk, P bv, int col, int K, int Vc, int& j) {
    if (col < K) {
        j = col;
        return bq;
    }
    if (col < Vc) {
        j = col - K;
        return bk;
    }
    j = col - Vc;
    return bv;
}

// y (rows,W) float32, the products x W^T -> y + b in place: one float32 add
// after the product (SPEC 6: only the product's operands are rounded).
// Row-wise 2-D grid as swiglu's: x over a row's items, y over the rows
// (striding by gridDim.y); a thread loads its bias chunk once.
extern "C" __global__ void linear_bias_forward(float* __restrict__ y, const float* __restrict__ bq,
                                               const float* __restrict__ bk,
                                               const float* __restrict__ bv, int rows, int W,
                                               int K, int Vc, int vec) {
    AFTER_PRIOR_GRIDS();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= (vec ? W / 4 : W)) return;
    int col = vec ? 4 * c : c, j;
    const float* b = linear_bias_of(bq, bk, bv, col, K, Vc, j);
    if (vec) {
        float bb[4];
        load_chunk(bb, b + j, 0, 4, true, 0.0f);
        for (int r = blockIdx.y; r < rows; r += gridDim.y) {
            float* row = y + (long long)r * W;
            float v[4];
            load_chunk(v, row, c, W, true, 0.0f);
#pragma unroll
            for (int i = 0; i < 4; i++) v[i] = __fadd_rn(v[i], bb[i]);
            store_chunk(row, c, W, true, v);
        }
    } else {
        float bb = b[j];
        for (int r = blockIdx.y; r < rows; r += gridDim.y) {
            float* at = y + (long long)r * W + col;
            *at = __fadd_rn(*at, bb);
        }
    }
}

// item c of a row of operands as float32 (bfloat16 bits widened exactly):
// vec, the chunk of columns 4c .. 4c+3 (16 bytes, or 8 of bfloat16); else
// column c alone, in a[0] (the others zero)
__device__ __forceinline__ void linear_bias_load(float (&a)[4], const floatX* row, int c,
                                                 bool vec) {
#ifdef OPERAND_BF16
    if (vec) {
        uint2 u = *reinterpret_cast<const uint2*>(row + 4 * c);
        a[0] = __uint_as_float(u.x << 16);
        a[1] = __uint_as_float(u.x & 0xffff0000u);
        a[2] = __uint_as_float(u.y << 16);
        a[3] = __uint_as_float(u.y & 0xffff0000u);
    } else {
        a[0] = __uint_as_float((unsigned)row[c] << 16);
        a[1] = a[2] = a[3] = 0.0f;
    }
#else
    if (vec) {
        load_chunk(a, row, c, 4 * c + 4, true, 0.0f);
    } else {
        a[0] = row[c];
        a[1] = a[2] = a[3] = 0.0f;
    }
#endif
}

// The bias gradient db = the column sum of dy (rows,W) (the gradients of
// the q, k, v products, as the backward keeps them: the operands of their
// weight and input gradient products), in two passes and a fixed order, no
// atomics. This pass: block (x, y) sums the rows [y chunk, (y + 1) chunk)
// of 32 items: thread (g, j) of its LB_GROUPS x 32 sums the rows g,
// g + LB_GROUPS, ... of item x * 32 + j in row order, then the LB_GROUPS
// sums are added in order of g into partials[y] (W values).
extern "C" __global__ void __launch_bounds__(32 * LB_GROUPS)
linear_bias_backward(const floatX* __restrict__ dy, float* __restrict__ partials, int rows, int W,
                     int chunk, int vec) {
    AFTER_PRIOR_GRIDS();
    __shared__ float4 stage[LB_GROUPS][32];
    int j = threadIdx.x & 31, g = threadIdx.x >> 5;
    int c = blockIdx.x * 32 + j;
    bool valid = c < (vec ? W / 4 : W);
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int first = blockIdx.y * chunk, last = min(rows, first + chunk);
    if (valid) {
#pragma unroll 4
        for (int r = first + g; r < last; r += LB_GROUPS) {
            float v[4];
            linear_bias_load(v, dy + (long long)r * W, c, vec != 0);
#pragma unroll
            for (int i = 0; i < 4; i++) s[i] = __fadd_rn(s[i], v[i]);
        }
    }
    stage[g][j] = make_float4(s[0], s[1], s[2], s[3]);
    __syncthreads();
    if (g == 0 && valid) {
        float4 t = stage[0][j];
        for (int k = 1; k < LB_GROUPS; k++) {
            float4 u = stage[k][j];
            t = make_float4(__fadd_rn(t.x, u.x), __fadd_rn(t.y, u.y), __fadd_rn(t.z, u.z),
                            __fadd_rn(t.w, u.w));
        }
        float* out = partials + (long long)blockIdx.y * W;
        if (vec) {
            reinterpret_cast<float4*>(out)[c] = t;
        } else {
            out[c] = t.x;
        }
    }
}

// The second pass: partials (chunks, W) summed in chunk order into the
// gradients of the three biases, gq (K), gk (Vc - K), gv (W - Vc) (each
// inside one segment of G). A block of LB_GROUPS x 32 threads takes 32
// adjacent columns: thread (g, j) sums the chunks g, g + LB_GROUPS, ... of
// column j in order, then the LB_GROUPS sums are added in order of g.
extern "C" __global__ void __launch_bounds__(32 * LB_GROUPS)
linear_bias_param_grads(const float* __restrict__ partials, int chunks, int W, int K, int Vc,
                        float* __restrict__ gq, float* __restrict__ gk, float* __restrict__ gv) {
    AFTER_PRIOR_GRIDS();
    __shared__ float group[LB_GROUPS][32];
    int j = threadIdx.x & 31, g = threadIdx.x >> 5;
    int col = blockIdx.x * 32 + j;
    float s = 0.0f;
    if (col < W) {
#pragma unroll 4
        for (int k = g; k < chunks; k += LB_GROUPS)
            s = __fadd_rn(s, partials[(long long)k * W + col]);
    }
    group[g][j] = s;
    __syncthreads();
    if (g == 0 && col < W) {
        float t = group[0][j];
        for (int i = 1; i < LB_GROUPS; i++) t = __fadd_rn(t, group[i][j]);
        int at;
        float* g = linear_bias_of(gq, gk, gv, col, K, Vc, at);
        g[at] = t;
    }
}

// The q, k and v weights of every layer, gathered from the parameters'
// operands P (three blocks there, each followed by its bias) into one
// adjacent (W, D) matrix per layer: out (L, n), n = nq + nk + nv, the
// operand of the layer's one q | k | v product and of its input gradient
// (two products where three would be, the second without adding into dh
// twice). offsets (L, 3): each layer's q, k, v weights' first elements in
// P. Grid (items, L). vec (the counts and offsets multiples of 4, P and out
// 16-byte aligned): an item is a chunk of 4 elements; else one element.
extern "C" __global__ void linear_bias_gather_weights(const floatX* __restrict__ P,
                                                      floatX* __restrict__ out,
                                                      const long long* __restrict__ offsets,
                                                      int nq, int nk, int nv, int vec) {
    AFTER_PRIOR_GRIDS();
    int n = nq + nk + nv;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (vec ? n / 4 : n)) return;
    int e = vec ? 4 * i : i;
    const long long* o = offsets + 3 * blockIdx.y;
    long long src = e < nq ? o[0] + e : e < nq + nk ? o[1] + (e - nq) : o[2] + (e - nq - nk);
    floatX* dst = out + (long long)blockIdx.y * n + e;
    if (vec) {
#ifdef OPERAND_BF16
        *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(P + src);
#else
        *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(P + src);
#endif
    } else {
        *dst = P[src];
    }
}
