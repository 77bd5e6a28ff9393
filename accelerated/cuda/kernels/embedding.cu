// ---------------------------------------------------------------- embedding

// ids: row b of the id buffer starts at b * ids_stride (T+1 for a training
// input, whose last id is only a target); position r = (b, t) holds
// ids[b * ids_stride + t].
__device__ __forceinline__ int id_at(const int* ids, int ids_stride, int T, int r) {
    return ids[(r / T) * ids_stride + r % T];
}

// x (BT,D) = W[ids]. One thread per chunk of 4 features (vec) or per feature.
extern "C" __global__ void embedding_forward(const int* __restrict__ ids, int ids_stride, int T,
                                             const float* __restrict__ W, float* __restrict__ x,
                                             int BT, int D, int vec) {
    AFTER_PRIOR_GRIDS();
    int per_row = vec ? D / 4 : D;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= BT * per_row) return;
    int r = i / per_row, c = i - r * per_row;
    long long id = id_at(ids, ids_stride, T, r);
    if (vec) {
        reinterpret_cast<float4*>(x)[i] = reinterpret_cast<const float4*>(W + id * D)[c];
    } else {
        x[i] = W[id * D + c];
    }
}

// The gather gradient: the sum of dx over the positions holding v, in
// position order (the order of the reference's np.add.at), added to the
// unembedding gradient already in dW[v] (accumulate: the tied embedding)
// or written as dW[v] (the untied one, SPEC 21); rows of ids that occur
// nowhere are not touched (embedding_backward_unseen writes their zeros
// where dW holds nothing else). No float atomics: one block sums id v's
// rows in order.
//
// First, the index (V,2) int32 per id: the first position holding it and
// how many do. embedding_index_reset clears it; embedding_index fills it
// with integer atomics (a minimum and a count: the same result in any order).
extern "C" __global__ void embedding_index_reset(int* __restrict__ index, int V) {
    AFTER_PRIOR_GRIDS();
    int v = blockIdx.x * blockDim.x + threadIdx.x;
    if (v < V) {
        index[2 * v] = 0x7fffffff;
        index[2 * v + 1] = 0;
    }
}

extern "C" __global__ void embedding_index(const int* __restrict__ ids, int ids_stride, int T,
                                           int BT, int* __restrict__ index) {
    AFTER_PRIOR_GRIDS();
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= BT) return;
    int v = id_at(ids, ids_stride, T, p);
    atomicMin(&index[2 * v], p);
    atomicAdd(&index[2 * v + 1], 1);
}

// One block per position p; only the block of v's first position works. It
// walks the positions from p on, blockDim at a time, listing those holding v
// in order (a ballot per warp, the warps' counts added in warp order), and
// adds their rows of dx; it stops at v's last occurrence (the count). A
// block takes 4 blockDim features of the row, those of slice blockIdx.y
// (rows wider than that: more slices, each block of a position alike).
// vec: a thread owns a chunk of 4 features (the launcher gives 128 threads
// where that holds a row, so most blocks, which leave at once, hold few
// registers); else the slice's features thread + blockDim k, k < 4.
#define EMB_THREADS 256  // at most
#define EMB_BATCH 8      // rows of dx loaded before they are added (vec)
extern "C" __global__ void __launch_bounds__(EMB_THREADS)
embedding_backward(const float* __restrict__ dx, const int* __restrict__ ids, int ids_stride,
                   int T, int BT, float* __restrict__ dW, int D, const int* __restrict__ index,
                   int accumulate, int vec) {
    AFTER_PRIOR_GRIDS();
    __shared__ int hits[EMB_THREADS];  // positions holding v among those of this pass, in order
    __shared__ int counts[EMB_THREADS / 32];
    int p = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int nt = blockDim.x, warps = nt >> 5;
    int v = id_at(ids, ids_stride, T, p);
    if (index[2 * v] != p) return;  // uniform: the whole block leaves
    int n = index[2 * v + 1];
    // this thread's chunk (vec), or its first feature (not vec), in the row
    int c = blockIdx.y * nt + threadIdx.x, d0 = blockIdx.y * 4 * nt + threadIdx.x;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int base = p, found = 0; found < n && base < BT; base += nt) {
        int q = base + threadIdx.x;
        bool hit = q < BT && id_at(ids, ids_stride, T, q) == v;
        unsigned mask = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) counts[warp] = __popc(mask);
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < warps; w++) {
            before += w < warp ? counts[w] : 0;
            total += counts[w];
        }
        if (hit) hits[before + __popc(mask & ((1u << lane) - 1u))] = q;
        __syncthreads();
        // the rows in order, EMB_BATCH loads issued before their adds: an id
        // frequent in the text has thousands of rows, a chain of dependent
        // adds that must not also wait for each load in turn
        if (vec) {
            if (c < D / 4) {
                for (int h0 = 0; h0 < total; h0 += EMB_BATCH) {
                    float4 g[EMB_BATCH];
#pragma unroll
                    for (int b = 0; b < EMB_BATCH; b++)
                        if (h0 + b < total)
                            g[b] = reinterpret_cast<const float4*>(
                                dx + (long long)hits[h0 + b] * D)[c];
#pragma unroll
                    for (int b = 0; b < EMB_BATCH; b++) {
                        if (h0 + b < total) {
                            acc[0] += g[b].x;
                            acc[1] += g[b].y;
                            acc[2] += g[b].z;
                            acc[3] += g[b].w;
                        }
                    }
                }
            }
        } else {
            for (int h = 0; h < total; h++) {
                const float* row = dx + (long long)hits[h] * D;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    int d = d0 + nt * k;
                    if (d < D) acc[k] += row[d];
                }
            }
        }
        found += total;
        __syncthreads();  // hits and counts are rewritten by the next pass
    }
    float* out = dW + (long long)v * D;
    if (vec) {
        if (c < D / 4) {
            float4* o = reinterpret_cast<float4*>(out) + c;
            float4 w = accumulate ? *o : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            *o = make_float4(w.x + acc[0], w.y + acc[1], w.z + acc[2], w.w + acc[3]);
        }
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int d = d0 + nt * k;
            if (d < D) out[d] = accumulate ? out[d] + acc[k] : acc[k];
        }
    }
}

// The untied embedding's gradient is its gather gradient alone: the rows of
// the ids that occur nowhere (count 0 in the index) are zero, the others
// embedding_backward's to write, so that each element of dW (V,D) is
// written once. One thread per chunk of 4 features (vec) or per feature.
extern "C" __global__ void embedding_backward_unseen(const int* __restrict__ index,
                                                     float* __restrict__ dW, int V, int D,
                                                     int vec) {
    AFTER_PRIOR_GRIDS();
    int per_row = vec ? D / 4 : D;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= V * per_row) return;
    int v = i / per_row;
    if (index[2 * v + 1] != 0) return;
    if (vec) {
        reinterpret_cast<float4*>(dW)[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    } else {
        dW[i] = 0.0f;
    }
}
