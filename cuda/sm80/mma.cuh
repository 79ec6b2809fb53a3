// Tensor-core operands and products of sm_80 and later: ldmatrix fragment loads, mma.sync m16n8k16 with fp32
// accumulators, and the 16-bit packing that turns accumulators into operands.
#pragma once
#include "common/types.cuh"

namespace fa2 {

// ---- ldmatrix: four 8x8 b16 matrices per warp, addresses supplied by lanes 8i..8i+7 for matrix i --------
FA2_DEVICE void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
FA2_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// ---- mma.sync m16n8k16, fp32 accumulate ------------------------------------------------------------------
// Fragment layouts (PTX ISA, "mma.m16n8k16"), with g = lane / 4 and t = lane % 4:
//   A (16x16, row-major): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..), a[3] = (g+8, 2t+8..)
//   B (16x8, "col"):      b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8.., n g)
//   C (16x8):             c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
template <class E>
struct Mma;
template <>
struct Mma<bf16> {
    static FA2_DEVICE void run(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // Two floats -> one register of two bf16, `lo` in the low half (the lower column index).
    static FA2_DEVICE u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};
template <>
struct Mma<f16> {
    static FA2_DEVICE void run(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static FA2_DEVICE u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};

// The C fragments of two adjacent n8 tiles (columns k0..k0+7 and k0+8..k0+15 of one m16 row tile) are, packed to
// 16 bits, exactly the A fragment of one k16 step: how P (forward) and dS (backward dQ) go from accumulators to
// operands without touching memory.
template <class E>
FA2_DEVICE void c_to_a(u32 (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = Mma<E>::pack(c0[0], c0[1]);
    a[1] = Mma<E>::pack(c0[2], c0[3]);
    a[2] = Mma<E>::pack(c1[0], c1[1]);
    a[3] = Mma<E>::pack(c1[2], c1[3]);
}

}  // namespace fa2
