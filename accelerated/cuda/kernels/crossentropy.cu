// ---------------------------------------------------------------- loss

// One block per row of a chunk of logits (rows,V): block i is row
// r = row0 + i of the batch's BT, r = (b, t), whose target is
// ids[b * ids_stride + t + 1]; logits, ce and dlogits point at the chunk's
// first row (the training step runs the classifier by row chunks, so the
// float32 logits are never whole). ce = logsumexp(logits) - logits[target] and,
// for the mean over n rows (dce = 1/n), dlogits = (softmax - onehot) * dce
// as an operand. Loss and its gradient in one pass over the row: a thread
// reads the chunks c = thread + blockDim k (vec: 16-byte loads) and keeps
// the first CE_STASH of them in registers, first the logits, then their
// exp(l - max), so a row of up to 4 CE_STASH blockDim logits is read from
// memory once; chunks past those are read again. At most CE_THREADS
// threads, two blocks per SM (so one block's reductions overlap the other's
// loads).
#define CE_STASH 8
#define CE_THREADS 512
extern "C" __global__ void __launch_bounds__(CE_THREADS, 2) crossentropy_forward_backward(const float* __restrict__ logits,
                                                         const int* __restrict__ ids,
                                                         int ids_stride, int T, int row0,
                                                         float* __restrict__ ce,
                                                         floatX* __restrict__ dlogits, int V,
                                                         float dce, int vec) {
    AFTER_PRIOR_GRIDS();
    __shared__ float red[32];
    int r = blockIdx.x, row = row0 + r;
    const float* l = logits + (long long)r * V;
    floatX* dl = dlogits + (long long)r * V;
    int target = ids[(row / T) * ids_stride + row % T + 1];
    int chunks = (V + 3) / 4, nt = blockDim.x;
    float e[CE_STASH][4];
    float mx = NEG_INF;
#pragma unroll
    for (int k = 0; k < CE_STASH; k++) {
        int c = threadIdx.x + k * nt;
        if (c < chunks) {
            load_chunk(e[k], l, c, V, vec, NEG_INF);
#pragma unroll
            for (int i = 0; i < 4; i++) mx = fmaxf(mx, e[k][i]);
        }
    }
    for (int c = threadIdx.x + CE_STASH * nt; c < chunks; c += nt) {
        float a[4];
        load_chunk(a, l, c, V, vec, NEG_INF);
#pragma unroll
        for (int i = 0; i < 4; i++) mx = fmaxf(mx, a[i]);
    }
    mx = block_max(mx, red);
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < CE_STASH; k++) {
        int c = threadIdx.x + k * nt;
        if (c < chunks) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (4 * c + i < V) {
                    e[k][i] = expf(__fsub_rn(e[k][i], mx));
                    s += e[k][i];
                }
            }
        }
    }
    for (int c = threadIdx.x + CE_STASH * nt; c < chunks; c += nt) {
        float a[4];
        load_chunk(a, l, c, V, vec, NEG_INF);
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (4 * c + i < V) s += expf(__fsub_rn(a[i], mx));
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) ce[r] = __fsub_rn(__fadd_rn(logf(s), mx), l[target]);
#pragma unroll
    for (int k = 0; k < CE_STASH; k++) {
        int c = threadIdx.x + k * nt;
        if (c < chunks) {
            float p[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                p[i] = e[k][i] / s;
                if (4 * c + i == target) p[i] = __fsub_rn(p[i], 1.0f);
                p[i] = __fmul_rn(p[i], dce);
            }
            store_operand_chunk(dl, c, V, vec, p);
        }
    }
    for (int c = threadIdx.x + CE_STASH * nt; c < chunks; c += nt) {
        float a[4], p[4];
        load_chunk(a, l, c, V, vec, NEG_INF);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            p[i] = expf(__fsub_rn(a[i], mx)) / s;
            if (4 * c + i == target) p[i] = __fsub_rn(p[i], 1.0f);
            p[i] = __fmul_rn(p[i], dce);
        }
        store_operand_chunk(dl, c, V, vec, p);
    }
}

// One block: loss = sum(ce) / n in a fixed order
extern "C" __global__ void mean_loss(const float* ce, float* loss, int n) {
    AFTER_PRIOR_GRIDS();
    __shared__ float red[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += ce[i];
    s = block_sum(s, red);
    if (threadIdx.x == 0) loss[0] = s / (float)n;
}
