// ---------------------------------------------------------------- precision

// x (n) float32 -> out (n) bfloat16 bits. Item i < n4: chunk i (one 16-byte
// load, one 8-byte store); then one item per element from 4 * n4 on
// (n4 = 0: every element alone).
extern "C" __global__ void round_bf16(const float* __restrict__ x, unsigned short* __restrict__ out,
                                      long long n, long long n4) {
    AFTER_PRIOR_GRIDS();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n4) {
        float4 v = reinterpret_cast<const float4*>(x)[i];
        uint2 u;
        u.x = pack_bf16x2(v.x, v.y);
        u.y = pack_bf16x2(v.z, v.w);
        reinterpret_cast<uint2*>(out)[i] = u;
        return;
    }
    i += 3 * n4;  // element 4 * n4 + (i - n4)
    if (i < n) out[i] = bf16_bits(x[i]);
}
