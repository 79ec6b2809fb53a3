// The scalar types, element type tags and small constants every fa2cupy kernel uses.
//
// The kernels include no CUDA header, so that NVRTC compiles them with nothing but libnvrtc (CI compiles every
// shipped instantiation on a machine without a GPU). Every inline PTX statement lives in the headers of common/,
// sm80/ and sm90/; the kernels call the named helpers there. Include paths are relative to cuda/
// (fa2cupy/build.py inlines them, or compile with -I cuda).
#pragma once

namespace fa2 {

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

// Element type tags. Tensor-core operands are 16 bits; the tag picks the PTX type names. f32 tags fp32 data
// (decode partial results) for the kernels that read it.
struct f16 {};
struct bf16 {};
struct f32 {};
template <class E>
constexpr int kElemBytes = 2;
template <>
constexpr int kElemBytes<f32> = 4;
// Whether the 16-bit type has fp32's exponent range (bf16; fp16 reaches only 2^-24 .. 65504).
template <class E>
constexpr bool kWideExponent = false;
template <>
constexpr bool kWideExponent<bf16> = true;

#define FA2_DEVICE __device__ __forceinline__

// A CUtensorMap: 128 opaque bytes, 64-byte aligned, that the driver encodes on the host (sm90/tma.cuh copies
// through it; common/params.cuh carries it in the Hopper kernels' parameters).
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// How a kernel holds its parameter struct T: a local copy if Copy, else a reference to the parameter (in place).
template <class T, bool Copy>
struct ParamsView {
    using type = const T&;
};
template <class T>
struct ParamsView<T, true> {
    using type = const T;
};

// A compile-time flag as a value: generic lambdas take it to instantiate one body per case (if constexpr inside).
template <bool B>
struct Bool {
    static constexpr bool value = B;
};

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * kLog2e)

// A compile-time number passed as an argument (lambdas take no template arguments).
template <int N>
struct Const {
    static constexpr int value = N;
};

FA2_DEVICE float pos_inf() { return __int_as_float(0x7f800000); }
FA2_DEVICE float quiet_nan() { return __int_as_float(0x7fc00000); }

}  // namespace fa2
