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
// row for the backward, which recomputes p from them (nothing of size T^2
// is stored). The backward's row term dot = sum_j dp_j p_j is summed over
// the keys as the reference does (not as the shortcut dy . y, whose y was
// computed from the rounded p). No atomics: dq is summed per query tile by
// one block (attention_backward_dq), dk and dv per key tile by another
// (attention_backward_dkdv), each over the tiles in order.

#define ATT_TILE 64  // rows of a query tile and of a key tile
#define ATT_PAD 8    // bfloat16 padding per shared-memory row: fragment loads hit distinct banks

typedef unsigned short bf16;

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    return (unsigned)bf16_bits(lo) | ((unsigned)bf16_bits(hi) << 16);
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

// Rows r0 .. r0+64 of a (n, E) bfloat16 matrix with row stride ld -> shared
// dst (64, E + ATT_PAD), rows at or past n zero. 16-byte loads; all threads.
template <int E>
__device__ void att_load(const bf16* src, int ld, int r0, int n, bf16* dst) {
    constexpr int VEC = E / 8;
    for (int i = threadIdx.x; i < ATT_TILE * VEC; i += blockDim.x) {
        int r = i / VEC, c = (i % VEC) * 8;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (r0 + r < n) x = *(const uint4*)(src + (long long)(r0 + r) * ld + c);
        *(uint4*)(dst + r * (E + ATT_PAD) + c) = x;
    }
}

// The same rows transposed: dst (E, 64 + ATT_PAD), dst[e][r] = row r0 + r, column e
template <int E>
__device__ void att_load_t(const bf16* src, int ld, int r0, int n, bf16* dst) {
    constexpr int VEC = E / 8;
    for (int i = threadIdx.x; i < ATT_TILE * VEC; i += blockDim.x) {
        int r = i % ATT_TILE, c = (i / ATT_TILE) * 8;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (r0 + r < n) x = *(const uint4*)(src + (long long)(r0 + r) * ld + c);
        const bf16* e = (const bf16*)&x;
#pragma unroll
        for (int k = 0; k < 8; k++) dst[(c + k) * (ATT_TILE + ATT_PAD) + r] = e[k];
    }
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
// bfloat16 here) @ Z, Z (64, E) given transposed: Xt (E, 64 + ATT_PAD) shared.
// The c layout of two adjacent 16x8 tiles is the a layout of one 16x16.
template <int E>
__device__ __forceinline__ void att_product(float (&o)[E / 8][4], const float (&p)[8][4],
                                            const bf16* Xt, int g, int u) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        unsigned a[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]),
                         pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                         pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                         pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < E / 8; n++) {
            unsigned b0, b1;
            frag_b(b0, b1, Xt, ATT_TILE + ATT_PAD, 8 * n, 16 * kk, g, u);
            mma_bf16(o[n], a, b0, b1);
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

// s = (q k^T) * scale on this warp's rows of query tile, -inf where the key
// j > query i or j >= T (c layout: element [n][c] is row i0 + g + 8 (c / 2),
// key j0 + 8 n + 2 u + c % 2)
__device__ __forceinline__ void att_scale_mask(float (&s)[8][4], int i0, int j0, int T,
                                               float scale, int g, int u) {
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int i = i0 + g + 8 * (c >> 1), j = j0 + 8 * n + 2 * u + (c & 1);
            s[n][c] = (j <= i && j < T) ? __fmul_rn(s[n][c], scale) : NEG_INF;
        }
}

// qkv (BT,3D) operands -> y (BT,D) operand; m, l (B,H,T) the row maximum
// and sum of exp(s - m). grid (query tiles, B*H), 128 threads.
template <int E>
__device__ void attention_forward_tile(const bf16* qkv, bf16* y, float* stat_m, float* stat_l,
                                       int T, int H, float scale) {
    __shared__ __align__(16) bf16 ks[ATT_TILE * (E + ATT_PAD)];
    __shared__ __align__(16) bf16 vt[E * (ATT_TILE + ATT_PAD)];
    int D = H * E, tiles = (T + ATT_TILE - 1) / ATT_TILE;
    int qt = tiles - 1 - blockIdx.x;  // the longest rows start first
    int bh = blockIdx.y, b = bh / H, h = bh % H;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, u = lane & 3;
    const bf16* q = qkv + (long long)b * T * 3 * D + h * E;
    const bf16* k = q + D;
    const bf16* v = q + 2 * D;
    int i0 = qt * ATT_TILE + warp * 16;  // this warp's rows: i0 + g and i0 + g + 8
    unsigned qa[E / 16][4];
    att_load<E>(q, 3 * D, qt * ATT_TILE, T, ks);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < E / 16; kk++) frag_a(qa[kk], ks, E + ATT_PAD, warp * 16, 16 * kk, g, u);
    __syncthreads();
    // pass 1: the row maximum m and the row sum l
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    for (int kt = 0; kt <= qt; kt++) {
        att_load<E>(k, 3 * D, kt * ATT_TILE, T, ks);
        __syncthreads();
        float s[8][4];
        att_product_t<E>(s, qa, ks, g, u);
        __syncthreads();  // ks is rewritten next
        att_scale_mask(s, i0, kt * ATT_TILE, T, scale, g, u);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = NEG_INF;
#pragma unroll
            for (int n = 0; n < 8; n++) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
            float mn = fmaxf(m[r], quad_max(mx));  // finite: key 0 is in every row's first tile
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < 8; n++)
                sum += expf(__fsub_rn(s[n][2 * r], mn)) + expf(__fsub_rn(s[n][2 * r + 1], mn));
            l[r] = l[r] * expf(__fsub_rn(m[r], mn)) + sum;
            m[r] = mn;
        }
    }
    l[0] = quad_sum(l[0]);
    l[1] = quad_sum(l[1]);
    // pass 2: y = round(p) v with p = exp(s - m) / l
    float o[E / 8][4];
#pragma unroll
    for (int n = 0; n < E / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    for (int kt = 0; kt <= qt; kt++) {
        att_load<E>(k, 3 * D, kt * ATT_TILE, T, ks);
        att_load_t<E>(v, 3 * D, kt * ATT_TILE, T, vt);
        __syncthreads();
        float s[8][4];
        att_product_t<E>(s, qa, ks, g, u);
        att_scale_mask(s, i0, kt * ATT_TILE, T, scale, g, u);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) s[n][c] = expf(__fsub_rn(s[n][c], m[c >> 1])) / l[c >> 1];
        att_product<E>(o, s, vt, g, u);
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
// p = exp(s - m) / l from the forward's m, l; dp = dy v^T
template <int E>
__device__ __forceinline__ void att_recompute(float (&s)[8][4], float (&dp)[8][4],
                                              const unsigned (&qa)[E / 16][4],
                                              const unsigned (&da)[E / 16][4], const bf16* ks,
                                              const bf16* vs, const float* m, const float* l,
                                              int i0, int j0, int T, float scale, int g, int u) {
    att_product_t<E>(s, qa, ks, g, u);
    att_product_t<E>(dp, da, vs, g, u);
    att_scale_mask(s, i0, j0, T, scale, g, u);
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) s[n][c] = expf(__fsub_rn(s[n][c], m[c >> 1])) / l[c >> 1];
}

// dy (BT,D) operand -> dq (into dqk (BT,2D), float32) and dot (B,H,T) =
// sum_j dp_j p_j per row. grid (query tiles, B*H), 128 threads.
template <int E>
__device__ void attention_backward_dq_tile(const bf16* qkv, const bf16* dy, const float* stat_m,
                                           const float* stat_l, float* stat_dot, float* dqk, int T,
                                           int H, float scale) {
    __shared__ __align__(16) bf16 ks[ATT_TILE * (E + ATT_PAD)];
    __shared__ __align__(16) bf16 vs[ATT_TILE * (E + ATT_PAD)];
    __shared__ __align__(16) bf16 kt_[E * (ATT_TILE + ATT_PAD)];
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
    att_load<E>(q, 3 * D, qt * ATT_TILE, T, ks);
    att_load<E>(dyb, D, qt * ATT_TILE, T, vs);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < E / 16; kk++) {
        frag_a(qa[kk], ks, E + ATT_PAD, warp * 16, 16 * kk, g, u);
        frag_a(da[kk], vs, E + ATT_PAD, warp * 16, 16 * kk, g, u);
    }
    __syncthreads();
    float m[2], l[2], dot[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int i = i0 + g + 8 * r;
        m[r] = i < T ? stat_m[(long long)bh * T + i] : 0.0f;
        l[r] = i < T ? stat_l[(long long)bh * T + i] : 1.0f;
    }
    // pass 1: dot = sum_j dp_j p_j
    for (int kt = 0; kt <= qt; kt++) {
        att_load<E>(k, 3 * D, kt * ATT_TILE, T, ks);
        att_load<E>(v, 3 * D, kt * ATT_TILE, T, vs);
        __syncthreads();
        float s[8][4], dp[8][4];
        att_recompute<E>(s, dp, qa, da, ks, vs, m, l, i0, kt * ATT_TILE, T, scale, g, u);
        __syncthreads();
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) dot[c >> 1] += dp[n][c] * s[n][c];
    }
    dot[0] = quad_sum(dot[0]);
    dot[1] = quad_sum(dot[1]);
    // pass 2: ds = p (dp - dot) * scale, rounded; dq = ds k
    float o[E / 8][4];
#pragma unroll
    for (int n = 0; n < E / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    for (int kt = 0; kt <= qt; kt++) {
        att_load<E>(k, 3 * D, kt * ATT_TILE, T, ks);
        att_load<E>(v, 3 * D, kt * ATT_TILE, T, vs);
        att_load_t<E>(k, 3 * D, kt * ATT_TILE, T, kt_);
        __syncthreads();
        float s[8][4], dp[8][4];
        att_recompute<E>(s, dp, qa, da, ks, vs, m, l, i0, kt * ATT_TILE, T, scale, g, u);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                s[n][c] = __fmul_rn(__fmul_rn(s[n][c], __fsub_rn(dp[n][c], dot[c >> 1])), scale);
        att_product<E>(o, s, kt_, g, u);
        __syncthreads();
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
    __shared__ __align__(16) bf16 qs[ATT_TILE * (E + ATT_PAD)];
    __shared__ __align__(16) bf16 ds_[ATT_TILE * (E + ATT_PAD)];  // dy rows
    __shared__ __align__(16) bf16 qt_[E * (ATT_TILE + ATT_PAD)];
    __shared__ __align__(16) bf16 dt_[E * (ATT_TILE + ATT_PAD)];
    __shared__ float sm[ATT_TILE], sl[ATT_TILE], sd[ATT_TILE];
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
    att_load<E>(k, 3 * D, kt * ATT_TILE, T, qs);
    att_load<E>(v, 3 * D, kt * ATT_TILE, T, ds_);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < E / 16; kk++) {
        frag_a(ka[kk], qs, E + ATT_PAD, warp * 16, 16 * kk, g, u);
        frag_a(va[kk], ds_, E + ATT_PAD, warp * 16, 16 * kk, g, u);
    }
    __syncthreads();
    float dk[E / 8][4], dv[E / 8][4];
#pragma unroll
    for (int n = 0; n < E / 8; n++) {
        dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.0f;
        dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;
    }
    for (int qt = kt; qt < tiles; qt++) {
        int i_base = qt * ATT_TILE;
        att_load<E>(q, 3 * D, i_base, T, qs);
        att_load<E>(dyb, D, i_base, T, ds_);
        att_load_t<E>(q, 3 * D, i_base, T, qt_);
        att_load_t<E>(dyb, D, i_base, T, dt_);
        for (int r = threadIdx.x; r < ATT_TILE; r += blockDim.x) {
            int i = i_base + r;
            sm[r] = i < T ? stat_m[(long long)bh * T + i] : 0.0f;
            sl[r] = i < T ? stat_l[(long long)bh * T + i] : 1.0f;
            sd[r] = i < T ? stat_dot[(long long)bh * T + i] : 0.0f;
        }
        __syncthreads();
        float s[8][4], dp[8][4];  // [n][c]: key j0 + g + 8 (c / 2), query i_base + 8 n + 2 u + c % 2
        att_product_t<E>(s, ka, qs, g, u);
        att_product_t<E>(dp, va, ds_, g, u);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int ii = 8 * n + 2 * u + (c & 1), i = i_base + ii, j = j0 + g + 8 * (c >> 1);
                float p = (j <= i && i < T)
                    ? expf(__fsub_rn(__fmul_rn(s[n][c], scale), sm[ii])) / sl[ii] : 0.0f;
                s[n][c] = p;
                dp[n][c] = __fmul_rn(__fmul_rn(p, __fsub_rn(dp[n][c], sd[ii])), scale);
            }
        att_product<E>(dv, s, dt_, g, u);   // dv += p^T dy
        att_product<E>(dk, dp, qt_, g, u);  // dk += ds^T q
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

