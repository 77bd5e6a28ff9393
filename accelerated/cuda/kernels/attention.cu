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
    AFTER_PRIOR_GRIDS();
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
    AFTER_PRIOR_GRIDS();
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
