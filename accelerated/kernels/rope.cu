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
