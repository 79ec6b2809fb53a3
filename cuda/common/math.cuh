// Scalar math: the fast exp2 of the softmax, byte permutes, and the 16-bit float unpacking of loaded data.
#pragma once
#include "common/types.cuh"

namespace fa2 {

FA2_DEVICE float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// The softcap's tanh, every kernel's (so that a backward recomputes the logits its forward formed, whichever kernels
// ran them): tanh.approx.f32, one MUFU operation, as flash-attn's kernels take it (cutlass::fast_tanh). The PTX ISA
// bounds its relative error by about 2^-11; on an H200 it is within 1.1e-5 relative and 7.9e-6 absolute of tanh over
// [-12, 12]. The exact 1 - 2 / (2^x + 1) is two MUFU operations, three a score with P's exp2: the softcap forward ran
// 12-18% slower with it at d = 64 and 128 (docs/design.md). Saturates to +-1; NaN stays NaN.
FA2_DEVICE float fast_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// a / b by __fdividef (MUFU.RCP and a multiply, two ulps: no slow path, for which ptxas keeps a register), with a
// and b first scaled down by 2^64 where |b| > 2^64 (__fdividef returns 0 for |b| > 2^126): the quotient then
// underflows only where the exact one does. (b normal: __fdividef flushes a denormal one.)
FA2_DEVICE float fast_quotient(float a, float b) {
    const float k = fabsf(b) > 0x1p64f ? 0x1p-64f : 1.f;
    return __fdividef(a * k, b * k);
}

// prmt.b32: result byte n is byte (selector >> 4 n) & 7 of the pair {a (bytes 0-3), b (4-7)}, or, where bit 3 of
// that nibble is set, that byte's top bit repeated eight times (__byte_perm drops the bit, and with it this mode).
FA2_DEVICE u32 prmt_b32(u32 a, u32 b, u32 selector) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
    return r;
}

// Unpacks two 16-bit floats (lo, hi) of one register to fp32.
template <class E>
FA2_DEVICE float2 unpack2(u32 v);
template <>
FA2_DEVICE float2 unpack2<bf16>(u32 v) {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
template <>
FA2_DEVICE float2 unpack2<f16>(u32 v) {
    float lo, hi;
    asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }" : "=f"(lo), "=f"(hi) : "r"(v));
    return make_float2(lo, hi);
}

}  // namespace fa2
