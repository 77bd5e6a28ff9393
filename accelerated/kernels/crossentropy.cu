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
