// Memory instructions of sm_80 and later (every GPU fa2cupy runs on): shared-memory addresses, cp.async copies
// from global to shared memory, L2 eviction policies, vector loads and stores, relaxed loads, reductions and fences.
#pragma once
#include "common/types.cuh"

namespace fa2 {

FA2_DEVICE u32 smem_u32(const void* ptr) {
    u32 addr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(ptr));
    return addr;
}

// ---- asynchronous global -> shared copies (Ampere cp.async) ---------------------------------------------
// 16 bytes per thread; `valid == false` writes zeros instead of reading, which is how ragged tiles
// (seqlen or head dim not a tile multiple) stay finite without branching around the copy.
FA2_DEVICE void cp_async_16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// L2 eviction policies (createpolicy, for cache_hint accesses). Evict-last: for a result another block reads back
// within microseconds (decode's split partials) while a stream goes through L2. Evict-first: for a stream read once
// that is larger than L2 anyway (it cannot stay there; under evict-first a cache that fits L2 lost its residency to
// the SDPA calls the bench interleaves: 8 x 1k 0.66x). Evict-unchanged: as if with no policy (an explicit
// evict_normal one cost an L2-resident 8 x 1k cache 8%; evict-unchanged is level with no hint).
FA2_DEVICE u64 l2_evict_first() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
FA2_DEVICE u64 l2_evict_unchanged() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_unchanged.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
FA2_DEVICE u64 l2_evict_last() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
// cp_async_16 with an L2 prefetch hint of 256 bytes, under an L2 policy: for streams read once in whole 256-byte
// rows (decode's K/V).
FA2_DEVICE void cp_async_16_prefetch256(u32 dst, const void* src, bool valid, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0), "l"(policy));
}
// Stores under an L2 policy.
FA2_DEVICE void st_global_f32x2(float* ptr, float a, float b, u64 policy) {
    asm volatile("st.global.L2::cache_hint.v2.f32 [%0], {%1, %2}, %3;\n" ::"l"(ptr), "f"(a), "f"(b), "l"(policy)
                 : "memory");
}
FA2_DEVICE void st_global_f32(float* ptr, float a, u64 policy) {
    asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;\n" ::"l"(ptr), "f"(a), "l"(policy) : "memory");
}
FA2_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
FA2_DEVICE void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Waits for every cp.async this thread issued, committed or not.
FA2_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

FA2_DEVICE void st_shared_u32(u32 addr, u32 v) { asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v)); }
FA2_DEVICE int ld_shared_s32(u32 addr) {
    int v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
FA2_DEVICE void st_shared_u16(u32 addr, u32 v) {
    asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(addr), "h"((unsigned short)v) : "memory");
}
FA2_DEVICE void st_shared_v2_f32(u32 addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
FA2_DEVICE void ld_shared_v2_f32(u32 addr, float& a, float& b) {
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(a), "=f"(b) : "r"(addr) : "memory");
}
FA2_DEVICE void ld_shared_v4(u32 addr, u32 (&r)[4]) {
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
FA2_DEVICE void ld_global_v4(const void* ptr, u32 (&r)[4]) {
    asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(ptr));
}

// Loads of data other blocks wrote (relaxed, GPU scope: from L2), issued in program order: ptxas keeps volatile asm
// in order, where it moved plain loads behind the math on loads issued before them (a second L2 round trip).
FA2_DEVICE float ld_relaxed_gpu(const float* ptr) {
    float x;
    asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];\n" : "=f"(x) : "l"(ptr));
    return x;
}
// (also a guess read before wait_for_prior_grids: coherent at GPU scope, it leaves no L1 copy that the same read
// after the wait could hit; volatile, it stays before the wait)
FA2_DEVICE int ld_relaxed_gpu(const int* ptr) {
    int x;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];\n" : "=r"(x) : "l"(ptr));
    return x;
}
FA2_DEVICE float4 ld_relaxed_gpu_v4(const float* ptr) {
    float4 x;
    asm volatile("ld.relaxed.gpu.global.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
                 : "l"(ptr));
    return x;
}

// Adds two consecutive floats to global memory without reading back (fp32 dQ accumulation in the backward).
FA2_DEVICE void red_add_f32x2(float* ptr, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(ptr), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(ptr, a);
    atomicAdd(ptr + 1, b);
#endif
}
// Adds four consecutive floats (16-byte aligned): one L2 request per 128-byte line when a warp covers whole lines.
FA2_DEVICE void red_add_f32x4(float* ptr, const u32 (&v)[4]) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "f"(__uint_as_float(v[0])),
                 "f"(__uint_as_float(v[1])), "f"(__uint_as_float(v[2])), "f"(__uint_as_float(v[3]))
                 : "memory");
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) atomicAdd(ptr + i, __uint_as_float(v[i]));
#endif
}

FA2_DEVICE void st_global_v4(void* ptr, const u32 (&r)[4]) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "r"(r[0]), "r"(r[1]), "r"(r[2]),
                 "r"(r[3]));
}

// Release and acquire at GPU scope in one fence: with a block barrier before it (release) or after it (acquire),
// one thread's fence orders the whole block's memory accesses around an atomic flag (fences are cumulative).
FA2_DEVICE void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// Waits until a global int that other blocks count up reads `value` or more (acquire, GPU scope: what they wrote
// before their release of it comes before this thread's accesses after the wait).
FA2_DEVICE void wait_for_count(const int* flag, int value) {
    int now;
    for (;;) {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(now) : "l"(flag) : "memory");
        if (now >= value) break;
        __nanosleep(64);
    }
}

}  // namespace fa2
