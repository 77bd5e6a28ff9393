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
//
// The heads are the layout's (reference/layout.py), passed as strides: a
// row of qkv (BT,W) holds q's H heads from column 0, k's and v's Hkv heads
// from columns K and V; query head h attends with key/value head h / g, g =
// H / Hkv (grouped heads, SPEC 21). The dk, dv of a key/value head are sums
// over its g query heads: the block of a key tile of a key/value head walks
// the query tiles of each of its query heads in turn, summing in float32
// registers, so the sum has a fixed order and dv is rounded once.

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

// qkv (BT,W) operands -> y (BT,D) operand, D = H E; m, l (B,H,T): the row
// maximum of s times log2(e), and 1 / the row sum of exp(s - m). grid
// (query tiles, B*H), 128 threads.
template <int E>
__device__ void attention_forward_tile(const bf16* qkv, bf16* y, float* stat_m, float* stat_l,
                                       int T, int H, int Hkv, int W, int K, int V, float scale) {
    constexpr int TILE = ATT_TILE * (E + ATT_PAD);
    __shared__ __align__(16) bf16 ks[2][TILE];  // double buffers: tile kt + 1 lands
    __shared__ __align__(16) bf16 vs[2][TILE];  // while tile kt is used
    int D = H * E, tiles = (T + ATT_TILE - 1) / ATT_TILE;
    int qt = tiles - 1 - blockIdx.x;  // the longest rows start first
    int bh = blockIdx.y, b = bh / H, h = bh % H, kvh = h / (H / Hkv);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, u = lane & 3;
    const bf16* q = qkv + (long long)b * T * W + h * E;
    const bf16* k = qkv + (long long)b * T * W + K + kvh * E;  // key/value head h / g
    const bf16* v = qkv + (long long)b * T * W + V + kvh * E;
    int i0 = qt * ATT_TILE + warp * 16;  // this warp's rows: i0 + g and i0 + g + 8
    unsigned qa[E / 16][4];
    att_fetch<E>(q, W, qt * ATT_TILE, T, vs[1]);
    att_fetch<E>(k, W, 0, T, ks[0]);
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
        if (kt < qt) att_fetch<E>(k, W, (kt + 1) * ATT_TILE, T, ks[(kt + 1) & 1]);
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
    att_fetch<E>(k, W, 0, T, ks[0]);
    att_fetch<E>(v, W, 0, T, vs[0]);
    cp_async_commit();
    for (int kt = 0; kt <= qt; kt++) {
        if (kt < qt) {
            att_fetch<E>(k, W, (kt + 1) * ATT_TILE, T, ks[(kt + 1) & 1]);
            att_fetch<E>(v, W, (kt + 1) * ATT_TILE, T, vs[(kt + 1) & 1]);
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

// dy (BT,D) operand -> dq (into dqk (BT,QK) at column h E, float32) and
// dot (B,H,T) = sum_j dp_j p_j per row. grid (query tiles, B*H), 128 threads.
template <int E>
__device__ void attention_backward_dq_tile(const bf16* qkv, const bf16* dy, const float* stat_m,
                                           const float* stat_l, float* stat_dot, float* dqk, int T,
                                           int H, int Hkv, int W, int K, int V, int QK,
                                           float scale) {
    constexpr int TILE = ATT_TILE * (E + ATT_PAD);
    __shared__ __align__(16) bf16 ks[2][TILE];
    __shared__ __align__(16) bf16 vs[2][TILE];
    int D = H * E, tiles = (T + ATT_TILE - 1) / ATT_TILE;
    int qt = tiles - 1 - blockIdx.x;
    int bh = blockIdx.y, b = bh / H, h = bh % H, kvh = h / (H / Hkv);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, u = lane & 3;
    const bf16* q = qkv + (long long)b * T * W + h * E;
    const bf16* k = qkv + (long long)b * T * W + K + kvh * E;  // key/value head h / g
    const bf16* v = qkv + (long long)b * T * W + V + kvh * E;
    const bf16* dyb = dy + (long long)b * T * D + h * E;
    int i0 = qt * ATT_TILE + warp * 16;
    unsigned qa[E / 16][4], da[E / 16][4];
    att_fetch<E>(q, W, qt * ATT_TILE, T, ks[1]);
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
        att_fetch<E>(k, W, 0, T, ks[0]);
        att_fetch<E>(v, W, 0, T, vs[0]);
        cp_async_commit();
        for (int kt = 0; kt <= qt; kt++) {
            if (kt < qt) {
                att_fetch<E>(k, W, (kt + 1) * ATT_TILE, T, ks[(kt + 1) & 1]);
                att_fetch<E>(v, W, (kt + 1) * ATT_TILE, T, vs[(kt + 1) & 1]);
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
        float* dq = dqk + (long long)(b * T + i) * QK + h * E;
#pragma unroll
        for (int n = 0; n < E / 8; n++)
            *(float2*)(dq + 8 * n + 2 * u) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
        if (u == 0) stat_dot[(long long)bh * T + i] = dot[r];
    }
}

// -> dk (into dqk (BT,QK) at column K + kvh E, float32) and dv (into dqkv
// (BT,W) at column V + kvh E, operand) of key/value head kvh: the sums over
// its g query heads. One block per key tile of a key/value head; its warps
// hold 16 keys each and walk, query head by query head, the query tiles on
// and below the diagonal, computing the transposed tiles s^T = k q^T and
// dp^T = v dy^T. grid (key tiles, B*Hkv).
template <int E>
__device__ void attention_backward_dkdv_tile(const bf16* qkv, const bf16* dy, const float* stat_m,
                                             const float* stat_l, const float* stat_dot,
                                             float* dqk, bf16* dqkv, int T, int H, int Hkv, int W,
                                             int K, int V, int QK, float scale) {
    constexpr int TILE = ATT_TILE * (E + ATT_PAD);
    __shared__ __align__(16) bf16 qs[2][TILE];
    __shared__ __align__(16) bf16 dys[2][TILE];
    __shared__ float sm[2][ATT_TILE], sl[2][ATT_TILE], sd[2][ATT_TILE];
    int D = H * E, tiles = (T + ATT_TILE - 1) / ATT_TILE;
    int kt = blockIdx.x;  // the key tiles with the most query tiles start first
    int bk = blockIdx.y, b = bk / Hkv, kvh = bk % Hkv;
    int group = H / Hkv, h0 = kvh * group;  // the query heads h0 .. h0 + group - 1
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, u = lane & 3;
    const bf16* rows = qkv + (long long)b * T * W;  // this batch element's rows
    const bf16* k = rows + K + kvh * E;
    const bf16* v = rows + V + kvh * E;
    int j0 = kt * ATT_TILE + warp * 16;  // this warp's keys: j0 + g and j0 + g + 8
    unsigned ka[E / 16][4], va[E / 16][4];
    att_fetch<E>(k, W, kt * ATT_TILE, T, qs[1]);
    att_fetch<E>(v, W, kt * ATT_TILE, T, dys[1]);
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
    // step st: query head h0 + st / per_head, query tile kt + st % per_head
    int per_head = tiles - kt, steps = group * per_head;
    // step st's query rows and their m, 1/l and dot, into buffer f
    auto fetch = [&](int st, int f) {
        int h = h0 + st / per_head, qt = kt + st % per_head;
        long long bh = (long long)b * H + h;
        att_fetch<E>(rows + h * E, W, qt * ATT_TILE, T, qs[f]);
        att_fetch<E>(dy + (long long)b * T * D + h * E, D, qt * ATT_TILE, T, dys[f]);
        for (int r = threadIdx.x; r < ATT_TILE; r += blockDim.x) {
            int i = qt * ATT_TILE + r;
            sm[f][r] = i < T ? stat_m[bh * T + i] : 0.0f;
            sl[f][r] = i < T ? stat_l[bh * T + i] : 1.0f;
            sd[f][r] = i < T ? stat_dot[bh * T + i] : 0.0f;
        }
    };
    fetch(0, 0);
    cp_async_commit();
    for (int st = 0; st < steps; st++) {
        int f = st & 1, qt = kt + st % per_head, i_base = qt * ATT_TILE;
        if (st + 1 < steps) fetch(st + 1, (st + 1) & 1);
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
        float* dkr = dqk + (long long)(b * T + j) * QK + K + kvh * E;
        bf16* dvr = dqkv + (long long)(b * T + j) * W + V + kvh * E;
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
                               int Hkv, int W, int K, int V, float scale) {                       \
        AFTER_PRIOR_GRIDS();                                                                      \
        attention_forward_tile<E>(qkv, y, m, l, T, H, Hkv, W, K, V, scale);                       \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(128)                                            \
        attention_backward_dq_e##E(const bf16* qkv, const bf16* y, const bf16* dy,               \
                                   const float* m, const float* l, float* dot, float* dqk, int T, \
                                   int H, int Hkv, int W, int K, int V, int QK, float scale) {    \
        AFTER_PRIOR_GRIDS();                                                                      \
        attention_backward_dq_tile<E>(qkv, dy, m, l, dot, dqk, T, H, Hkv, W, K, V, QK, scale);    \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(128)                                            \
        attention_backward_dkdv_e##E(const bf16* qkv, const bf16* dy, const float* m,            \
                                     const float* l, const float* dot, float* dqk, bf16* dqkv,   \
                                     int T, int H, int Hkv, int W, int K, int V, int QK,         \
                                     float scale) {                                               \
        AFTER_PRIOR_GRIDS();                                                                      \
        attention_backward_dkdv_tile<E>(qkv, dy, m, l, dot, dqk, dqkv, T, H, Hkv, W, K, V, QK,    \
                                        scale);                                                   \
    }
ATTENTION_KERNELS(16)
ATTENTION_KERNELS(32)
ATTENTION_KERNELS(64)
