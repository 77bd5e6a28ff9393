// ---------------------------------------------------------------- AdamW

// c = float32(1 - beta^t), computed in float64 (SPEC 7)
__device__ __forceinline__ float bias_correction(double beta, int t) {
    return (float)(1.0 - pow(beta, (double)t));
}

// One thread: advance the device update count t and compute c1, c2 for the
// new t. Inside the graph, so a replay needs nothing from the host.
extern "C" __global__ void adamw_bias_corrections(int* t, float* c, double beta1, double beta2) {
    int tn = t[0] + 1;
    t[0] = tn;
    c[0] = bias_correction(beta1, tn);
    c[1] = bias_correction(beta2, tn);
}

// c1, c2 for n given update counts (the check of bias_correction)
extern "C" __global__ void adamw_bias_corrections_table(const int* ts, float* c1, float* c2,
                                                        int n, double beta1, double beta2) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    c1[i] = bias_correction(beta1, ts[i]);
    c2[i] = bias_correction(beta2, ts[i]);
}

// SPEC 7, elementwise, each float32 operation rounded as the reference's:
//   m = b1 m + (1-b1) g ; v = b2 v + (1-b2) g g ; p -= lr wd p (decay only)
//   p -= lr (m / c1) / (sqrt(v / c2) + eps)
// Under bf16 the new parameters are also written as bfloat16 operands (Pb),
// so the next step's products need no rounding pass over P.
extern "C" __global__ void adamw_update(float* P, float* M, float* Vm, const float* G,
                                        const unsigned char* decay, unsigned short* Pb,
                                        const float* c, long long n, float b1, float omb1,
                                        float b2, float omb2, float lr, float lrwd, float eps) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float c1 = c[0], c2 = c[1];
    float g = G[i];
    float m = __fadd_rn(__fmul_rn(b1, M[i]), __fmul_rn(omb1, g));
    float v = __fadd_rn(__fmul_rn(b2, Vm[i]), __fmul_rn(__fmul_rn(omb2, g), g));
    float p = P[i];
    if (decay[i]) p = __fsub_rn(p, __fmul_rn(lrwd, p));
    float step = __fdiv_rn(__fmul_rn(lr, __fdiv_rn(m, c1)),
                           __fadd_rn(__fsqrt_rn(__fdiv_rn(v, c2)), eps));
    p = __fsub_rn(p, step);
    P[i] = p;
    M[i] = m;
    Vm[i] = v;
    if (Pb != 0) Pb[i] = bf16_bits(p);
}
