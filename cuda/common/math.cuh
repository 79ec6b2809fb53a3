// Scalar math: the fast exp2 of the softmax, byte permutes, and the 16-bit float unpacking of loaded data.
#pragma once
#include "common/types.cuh"

namespace fa2 {

FA2_DEVICE float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// tanh(x2 / (2 log2 e)), the argument's factor 2 log2(e) folded into the caller's multiply: 1 - 2 / (2^x2 + 1) from
// one exp2 and one reciprocal, absolute error about 1e-7 (tanhf's own is below 1e-7 too, but its branches and
// polynomial take registers the Hopper forward's rows do not have; tanh.approx.f32 is one MUFU operation but off by
// up to 5e-4 relative, 0.015 in a logit under softcap 30). 2^x2 overflowing to inf gives 1, underflowing to 0 -1.
FA2_DEVICE float tanh_of_exp2_arg(float x2) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(fast_exp2(x2) + 1.f));
    return fmaf(-2.f, r, 1.f);
}
// tanh_of_exp2_arg with the reciprocal on the FMA pipe (for kernels whose MUFU is the busier pipe): a first guess
// from the float's bits (5% off) and two Newton steps, 6.4e-6 relative, so tanh within 1.3e-5 (4e-4 in a logit under
// softcap 30, a tenth of a 16-bit P's rounding). 2^x2 is held below 2^64, where the guess from the bits still holds.
FA2_DEVICE float tanh_of_exp2_arg_fma(float x2) {
    const float d = fast_exp2(fminf(x2, 64.f)) + 1.f;
    float r = __int_as_float(0x7EF311C3 - __float_as_int(d));
    r *= fmaf(-d, r, 2.f);
    r *= fmaf(-d, r, 2.f);
    return fmaf(-2.f, r, 1.f);
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
