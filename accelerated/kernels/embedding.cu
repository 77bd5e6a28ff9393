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
