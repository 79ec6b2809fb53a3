// Warpgroup matrix multiply-accumulate (wgmma, sm_90a): shared-memory matrix descriptors, the m64nNk16 products
// and the fences and waits around them.
#pragma once
#include "common/types.cuh"

namespace fa2 {

// wgmma: issued by the 4 warps of a warpgroup together, asynchronous until wait_group. fence before the first
// wgmma that reads registers written by ordinary instructions (accumulators rescaled by the softmax, A fragments).
FA2_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
FA2_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
FA2_DEVICE void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// The compiler sees a wgmma as finished when its asm statement ends; this pins registers an in-flight wgmma
// reads or writes until after wgmma_wait (no move, no reuse across it).
template <int A, int B, int C>
FA2_DEVICE void pin_registers(float (&x)[A][B][C]) {
#pragma unroll
    for (int i = 0; i < A; ++i)
#pragma unroll
        for (int j = 0; j < B; ++j)
#pragma unroll
            for (int k = 0; k < C; ++k) asm volatile("" : "+f"(x[i][j][k])::"memory");
}
template <int A, int B>
FA2_DEVICE void pin_registers(u32 (&x)[A][B]) {
#pragma unroll
    for (int i = 0; i < A; ++i)
#pragma unroll
        for (int j = 0; j < B; ++j) asm volatile("" : "+r"(x[i][j])::"memory");
}

// Shared-memory matrix descriptor for the 128-byte swizzle (PTX ISA, "Matrix Descriptor Format"): operands are
// stored as slabs of 64 16-bit columns, each row of a slab 128 bytes with its 16-byte chunk c at c ^ (row % 8)
// (SwizzledSlabs below), slabs 1024-byte aligned. K-major operands (Q, K): rows 8 apart at 1024 bytes (stride
// byte offset), the leading offset unused; a k16 step inside a slab moves the start by 32 bytes. MN-major (V as
// the B of P V, N = head dim): the next 64 columns at `leading` bytes (the next slab), 8 keys at 1024 bytes.
FA2_DEVICE u64 smem_desc_sw128(u32 addr, u32 leading) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((leading & 0x3FFFF) >> 4) << 16) | ((u64)(1024 >> 4) << 32) |
           (1ull << 62);
}

// d (+)= A B on tensor cores, m64nNk16, fp32 accumulators in the mma C-fragment layout of each warp's 16 rows
// (d[0][n8 tile][4], as OnlineSoftmax holds scores). ss: A and B from shared memory, both K-major; accumulate 0
// overwrites d. ss_mn: both MN-major in shared memory (the backward's dQ = dS K from dS^T and K as stored).
// rs_mn: A from registers (each warp's m16k16 A fragment, c_to_a), B MN-major in shared memory.
template <class E, int N>
struct Wgmma;
#define FA2_WGMMA_ACC4(i) "+f"(d[0][i][0]), "+f"(d[0][i][1]), "+f"(d[0][i][2]), "+f"(d[0][i][3])
#define FA2_WGMMA_ACC_N64 FA2_WGMMA_ACC4(0), FA2_WGMMA_ACC4(1), FA2_WGMMA_ACC4(2), FA2_WGMMA_ACC4(3), FA2_WGMMA_ACC4(4), FA2_WGMMA_ACC4(5), FA2_WGMMA_ACC4(6), FA2_WGMMA_ACC4(7)
#define FA2_WGMMA_ACC_N128 FA2_WGMMA_ACC_N64, FA2_WGMMA_ACC4(8), FA2_WGMMA_ACC4(9), FA2_WGMMA_ACC4(10), FA2_WGMMA_ACC4(11), FA2_WGMMA_ACC4(12), FA2_WGMMA_ACC4(13), FA2_WGMMA_ACC4(14), FA2_WGMMA_ACC4(15)
#define FA2_WGMMA_ACC_N192 FA2_WGMMA_ACC_N128, FA2_WGMMA_ACC4(16), FA2_WGMMA_ACC4(17), FA2_WGMMA_ACC4(18), FA2_WGMMA_ACC4(19), FA2_WGMMA_ACC4(20), FA2_WGMMA_ACC4(21), FA2_WGMMA_ACC4(22), FA2_WGMMA_ACC4(23)
#define FA2_WGMMA_ACC_N256 FA2_WGMMA_ACC_N192, FA2_WGMMA_ACC4(24), FA2_WGMMA_ACC4(25), FA2_WGMMA_ACC4(26), FA2_WGMMA_ACC4(27), FA2_WGMMA_ACC4(28), FA2_WGMMA_ACC4(29), FA2_WGMMA_ACC4(30), FA2_WGMMA_ACC4(31)
// One specialisation per (type, N), N = 64 and 128 (S's key tiles, P V's head dims) and 192 and 256 (P V's wide head
// dims), both types of an N from one FA2_WGMMA_BOTH: the accumulator operands are N / 2 registers, listed by the
// trailing FA2_WGMMA_ACC_N argument; DREGS names them in the instruction; SS_OPS / RS_OPS are the operands after
// them, SS_PRED / RS_PRED the accumulate flag's.
// FA2_WGMMA_SS writes one shared-memory form, its operands' majors given by TRANS (imm-trans-a, imm-trans-b); the
// accumulator operands come last, as they expand to a list.
#define FA2_WGMMA_SS(NAME, TRANS, TY, N, DREGS, SS_OPS, SS_PRED, ...)                                              \
    static FA2_DEVICE void NAME(float (&d)[1][N / 8][4], u64 desc_a, u64 desc_b, int accumulate) {                 \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SS_PRED ", 0;\n"                                          \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " " DREGS ", " SS_OPS           \
                     ", p, 1, 1, " TRANS ";\n}\n"                                                                  \
                     : __VA_ARGS__                                                                                 \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                 \
    }
#define FA2_WGMMA_M64(TY, N, DREGS, SS_OPS, SS_PRED, RS_OPS, RS_PRED, ...)                                         \
    template <>                                                                                                    \
    struct Wgmma<TY, N> {                                                                                          \
        FA2_WGMMA_SS(ss, "0, 0", TY, N, DREGS, SS_OPS, SS_PRED, __VA_ARGS__)                                       \
        FA2_WGMMA_SS(ss_mn, "1, 1", TY, N, DREGS, SS_OPS, SS_PRED, __VA_ARGS__)                                    \
        static FA2_DEVICE void rs_mn(float (&d)[1][N / 8][4], const u32 (&a)[4], u64 desc_b, int accumulate) {     \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " RS_PRED ", 0;\n"                                      \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " " DREGS ", " RS_OPS       \
                         ", p, 1, 1, 1;\n}\n"                                                                      \
                         : __VA_ARGS__                                                                             \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));              \
        }                                                                                                          \
    };
#define FA2_WGMMA_BOTH(N, DREGS, SS_OPS, SS_PRED, RS_OPS, RS_PRED, ...)                                        \
    FA2_WGMMA_M64(bf16, N, DREGS, SS_OPS, SS_PRED, RS_OPS, RS_PRED, __VA_ARGS__)                                    \
    FA2_WGMMA_M64(f16, N, DREGS, SS_OPS, SS_PRED, RS_OPS, RS_PRED, __VA_ARGS__)
FA2_WGMMA_BOTH(64, "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}", "%32, %33", "%34",
               "{%32, %33, %34, %35}, %36", "%37", FA2_WGMMA_ACC_N64)
FA2_WGMMA_BOTH(128, "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}", "%64, %65", "%66",
               "{%64, %65, %66, %67}, %68", "%69", FA2_WGMMA_ACC_N128)
FA2_WGMMA_BOTH(192, "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}", "%96, %97", "%98",
               "{%96, %97, %98, %99}, %100", "%101", FA2_WGMMA_ACC_N192)
FA2_WGMMA_BOTH(256, "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}", "%128, %129", "%130",
               "{%128, %129, %130, %131}, %132", "%133", FA2_WGMMA_ACC_N256)
#undef FA2_WGMMA_BOTH
#undef FA2_WGMMA_M64
#undef FA2_WGMMA_SS
#undef FA2_WGMMA_ACC_N256
#undef FA2_WGMMA_ACC_N192
#undef FA2_WGMMA_ACC_N128
#undef FA2_WGMMA_ACC_N64
#undef FA2_WGMMA_ACC4

}  // namespace fa2
