// The CUDA built-ins the backend's kernels use, for running their source on
// a CPU (dev/cuda/simulate.py). Blocks run one after another; the threads of
// a block are coroutines (their own stacks, switched by a few instructions of
// x86-64 assembly) that switch only at __syncthreads and at the warp-
// synchronous calls (shuffles, ballots), so a kernel's indexing,
// bounds, vector paths and barriers run as written. Not simulated: timing,
// memory ordering between blocks, anything in inline PTX. Float arithmetic
// is the host's (compile with -ffp-contract=off so a*b+c stays two
// roundings, as the _rn intrinsics); expf and logf are glibc's, a few units
// in the last place from CUDA's.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

// Coroutine switch (x86-64 System V): push the callee-saved registers, save
// the stack pointer in *from, load `to`, pop, return into the other stack.
extern "C" void __sim_switch(void** from, void* to);
asm(R"(
    .text
    .globl __sim_switch
    .type __sim_switch, @function
__sim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size __sim_switch, .-__sim_switch
)");

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

struct SimThread {
    void* sp;  // its saved stack pointer while switched out
    dim3 tid;
    int lane, warp;
    int state;  // 0 runnable, 1 at the block barrier, 2 at a warp barrier, 3 done
    int pred;   // __syncthreads_or's argument
};

struct SimBlock {
    std::vector<SimThread> threads;
    std::vector<char*> stacks;
    int nthreads = 0;
    int at_block = 0;                  // threads waiting at the block barrier
    int block_or = 0;                  // __syncthreads_or over the waiting threads
    int block_result = 0;
    std::vector<int> warp_waiting;     // per warp: lanes at its barrier
    std::vector<unsigned> warp_mask;   // per warp: the mask of the current barrier
    std::vector<unsigned long long> exchange;  // per thread: the value a shuffle offers
    std::vector<unsigned> done_lanes;  // per warp: lanes that returned
    void* scheduler = nullptr;  // the scheduler's saved stack pointer
    bool progress = false;
};

static const size_t SIM_STACK = 256 * 1024;
inline SimBlock* __sim_block = nullptr;
inline SimThread* __sim_cur = nullptr;
inline dim3 __sim_blockIdx, __sim_blockDim, __sim_gridDim;
inline char* __sim_dynamic_shared = nullptr;
inline std::function<void()>* __sim_kernel = nullptr;
inline char __sim_error[512] = {0};

#define threadIdx (__sim_cur->tid)
#define blockIdx __sim_blockIdx
#define blockDim __sim_blockDim
#define gridDim __sim_gridDim
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

[[noreturn]] inline void __sim_fail(const char* what) {
    snprintf(__sim_error, sizeof __sim_error, "%s (block %u,%u thread %u)", what,
             __sim_blockIdx.x, __sim_blockIdx.y, __sim_cur ? __sim_cur->tid.x : 0u);
    fprintf(stderr, "simulate: %s\n", __sim_error);
    abort();
}

inline void __sim_yield() { __sim_switch(&__sim_cur->sp, __sim_block->scheduler); }

inline void __syncthreads_impl() {
    SimBlock* b = __sim_block;
    __sim_cur->state = 1;
    b->at_block++;
    b->block_or |= __sim_cur->pred;
    // released by the scheduler once every thread still running has arrived
    while (__sim_cur->state == 1) __sim_yield();
}

inline void __syncthreads() {
    __sim_cur->pred = 0;
    __syncthreads_impl();
}

inline int __syncthreads_or(int p) {
    __sim_cur->pred = p != 0;
    __syncthreads_impl();
    return __sim_block->block_result;
}

inline void __sim_warp_barrier(unsigned mask) {
    SimBlock* b = __sim_block;
    int w = __sim_cur->warp, lane = __sim_cur->lane;
    if (!(mask >> lane & 1u)) __sim_fail("a warp call from a lane outside its mask");
    if (b->warp_waiting[w] == 0) b->warp_mask[w] = mask;
    else if (b->warp_mask[w] != mask) __sim_fail("warp calls with different masks");
    if (mask & b->done_lanes[w]) __sim_fail("a warp call waits for a lane that returned");
    __sim_cur->state = 2;
    b->warp_waiting[w]++;
    if (b->warp_waiting[w] == __builtin_popcount(mask)) {  // the last lane: release all
        b->warp_waiting[w] = 0;
        for (int i = 0; i < 32; i++) {
            int t = w * 32 + i;
            if ((mask >> i & 1u) && t < b->nthreads) b->threads[t].state = 0;
        }
        b->progress = true;
        return;
    }
    while (__sim_cur->state == 2) __sim_yield();
}

template <class T> inline unsigned long long __sim_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffle of a wide type");
    unsigned long long u = 0;
    memcpy(&u, &v, sizeof(T));
    return u;
}

template <class T> inline T __sim_from_bits(unsigned long long u) {
    T v;
    memcpy(&v, &u, sizeof(T));
    return v;
}

template <class T> inline T __sim_shfl(unsigned mask, T v, int src) {
    SimBlock* b = __sim_block;
    int w = __sim_cur->warp;
    b->exchange[__sim_cur->tid.x] = __sim_bits(v);
    __sim_warp_barrier(mask);
    int t = w * 32 + (src & 31);
    if (!(mask >> (src & 31) & 1u)) __sim_fail("a shuffle reads a lane outside its mask");
    T r = __sim_from_bits<T>(b->exchange[t]);
    __sim_warp_barrier(mask);  // every lane has read before the next exchange
    return r;
}

template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    if (width != 32) __sim_fail("shuffle width");
    return __sim_shfl(mask, v, src);
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
    if (width != 32) __sim_fail("shuffle width");
    return __sim_shfl(mask, v, __sim_cur->lane ^ m);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    if (width != 32) __sim_fail("shuffle width");
    int src = __sim_cur->lane + (int)d;
    return __sim_shfl(mask, v, src < 32 ? src : __sim_cur->lane);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    if (width != 32) __sim_fail("shuffle width");
    int src = __sim_cur->lane - (int)d;
    return __sim_shfl(mask, v, src >= 0 ? src : __sim_cur->lane);
}

inline unsigned __ballot_sync(unsigned mask, int p) {
    SimBlock* b = __sim_block;
    int w = __sim_cur->warp;
    b->exchange[__sim_cur->tid.x] = p != 0;
    __sim_warp_barrier(mask);
    unsigned r = 0;
    for (int i = 0; i < 32; i++)
        if ((mask >> i & 1u) && b->exchange[w * 32 + i]) r |= 1u << i;
    __sim_warp_barrier(mask);
    return r;
}

inline void __syncwarp(unsigned mask = 0xffffffffu) { __sim_warp_barrier(mask); }

// ------------------------------------------------------------------ types

struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(4) uchar4 { unsigned char x, y, z, w; };
struct alignas(4) ushort2 { unsigned short x, y; };
struct alignas(8) ushort4 { unsigned short x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

// ------------------------------------------------------------------ arithmetic

inline unsigned __float_as_uint(float x) { unsigned u; memcpy(&u, &x, 4); return u; }
inline float __uint_as_float(unsigned u) { float x; memcpy(&x, &u, 4); return x; }
inline int __float_as_int(float x) { int u; memcpy(&u, &x, 4); return u; }
inline float __int_as_float(int u) { float x; memcpy(&x, &u, 4); return x; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __frcp_rn(float a) { return 1.0f / a; }
// the fast forms, exactly here (CUDA's are a few units in the last place off)
inline float __expf(float a) { return expf(a); }
inline float __fdividef(float a, float b) { return a / b; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
using std::isfinite;
using std::isnan;
using std::isinf;
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
// CUDA's mixed overloads compare as unsigned
inline unsigned min(int a, unsigned b) { return min((unsigned)a, b); }
inline unsigned min(unsigned a, int b) { return min(a, (unsigned)b); }
inline unsigned max(int a, unsigned b) { return max((unsigned)a, b); }
inline unsigned max(unsigned a, int b) { return max(a, (unsigned)b); }

// the threads of a block never run at once: read-modify-write is atomic
template <class T> inline T atomicAdd(T* p, T v) { T o = *p; *p = o + v; return o; }
template <class T> inline T atomicMin(T* p, T v) { T o = *p; *p = v < o ? v : o; return o; }
template <class T> inline T atomicMax(T* p, T v) { T o = *p; *p = v > o ? v : o; return o; }
template <class T> inline T atomicExch(T* p, T v) { T o = *p; *p = v; return o; }
inline void __threadfence() {}

template <class T> inline T __ldg(const T* p) { return *p; }

// ------------------------------------------------------------------ launch

[[noreturn]] inline void __sim_entry() {
    (*__sim_kernel)();
    SimBlock* b = __sim_block;
    __sim_cur->state = 3;
    b->done_lanes[__sim_cur->warp] |= 1u << __sim_cur->lane;
    b->progress = true;
    __sim_yield();  // never resumed
    abort();
}

inline void __sim_run_block(SimBlock& b) {
    int n = b.nthreads;
    b.at_block = b.block_or = 0;
    int warps = (n + 31) / 32;
    b.warp_waiting.assign(warps, 0);
    b.warp_mask.assign(warps, 0);
    b.done_lanes.assign(warps, 0);
    // lanes past the block's last thread count as returned
    if (n % 32) b.done_lanes[warps - 1] = ~0u << (n % 32);
    for (int t = 0; t < n; t++) {
        SimThread& th = b.threads[t];
        th.tid.x = t % __sim_blockDim.x;
        th.tid.y = (t / __sim_blockDim.x) % __sim_blockDim.y;
        th.tid.z = t / (__sim_blockDim.x * __sim_blockDim.y);
        th.lane = t & 31;
        th.warp = t >> 5;
        th.state = 0;
        th.pred = 0;
        // a fresh stack that __sim_switch "returns" into __sim_entry from:
        // 6 registers, then the entry's address, then a slot where a return
        // address would be (the entry starts as if called: rsp % 16 == 8)
        uintptr_t top = ((uintptr_t)b.stacks[t] + SIM_STACK) & ~(uintptr_t)15;
        void** sp = (void**)top;
        *--sp = nullptr;
        *--sp = (void*)&__sim_entry;
        for (int r = 0; r < 6; r++) *--sp = nullptr;
        th.sp = sp;
    }
    for (;;) {
        b.progress = false;
        int running = 0;
        for (int t = 0; t < n; t++) {
            SimThread& th = b.threads[t];
            if (th.state == 3) continue;
            running++;
            if (th.state != 0) continue;
            __sim_cur = &th;
            __sim_switch(&b.scheduler, th.sp);
            __sim_cur = nullptr;
            b.progress = true;
        }
        if (running == 0) return;
        int done = 0;
        for (int t = 0; t < n; t++) done += b.threads[t].state == 3;
        if (b.at_block > 0 && b.at_block == n - done) {  // every thread still running is there
            b.block_result = b.block_or;
            b.at_block = b.block_or = 0;
            for (int t = 0; t < n; t++)
                if (b.threads[t].state == 1) b.threads[t].state = 0;
            continue;
        }
        if (!b.progress) {
            __sim_cur = &b.threads[0];
            __sim_fail("deadlock: threads wait at barriers that cannot complete");
        }
    }
}

inline SimBlock& __sim_block_storage(int n) {
    static SimBlock block;
    if ((int)block.threads.size() < n) {
        block.threads.resize(n);
        while ((int)block.stacks.size() < n) block.stacks.push_back((char*)malloc(SIM_STACK));
        block.exchange.resize(n);
    }
    return block;
}

inline int __sim_launch(dim3 grid, dim3 block, size_t shared, std::function<void()> kernel) {
    unsigned n = block.x * block.y * block.z;
    if (n == 0 || n > 1024) { fprintf(stderr, "simulate: block of %u threads\n", n); return 1; }
    if (shared > 227 * 1024) { fprintf(stderr, "simulate: %zu bytes of shared memory\n", shared); return 1; }
    std::vector<char> dynamic(shared + 16);
    memset(dynamic.data(), 0xA5, dynamic.size());  // not zero: a kernel must write what it reads
    __sim_dynamic_shared = dynamic.data();
    __sim_kernel = &kernel;
    SimBlock& b = __sim_block_storage(n);
    b.nthreads = n;
    __sim_blockDim = block;
    __sim_gridDim = grid;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                __sim_blockIdx.x = x;
                __sim_blockIdx.y = y;
                __sim_blockIdx.z = z;
                __sim_block = &b;
                __sim_run_block(b);
            }
    __sim_block = nullptr;
    return 0;
}
