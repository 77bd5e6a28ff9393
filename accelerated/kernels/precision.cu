// ---------------------------------------------------------------- precision

// x (n) float32 -> out (n) bfloat16 bits
extern "C" __global__ void round_bf16(const float* x, unsigned short* out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = bf16_bits(x[i]);
}
