// Decode-time attention (FA2 paper §4.2, "flash-decoding"): the pieces that exist so far.
//
//   merge_states   merges attention computed over disjoint key sets, (out_i, lse_i) -> (out, lse): the combine
//                  step of split-KV decoding, and fa2cupy.merge_attention_states for cascade / prefix-shared
//                  attention and context parallelism.
//
// A part whose lse is +inf or -inf saw no key (flash-attn writes +inf for such rows) and gets weight 0; a row that
// no part saw gets out = 0 and lse = +inf, the same convention as the forward.
#include "primitives.cuh"

namespace fa2 {

// Loads 8 consecutive elements as fp32 (16-bit types: one 16-byte load; fp32: two).
template <class E>
struct Load8 {
    static FA2_DEVICE void run(const void* ptr, float (&x)[8]) {
        u32 r[4];
        ld_global_v4(ptr, r);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = unpack2<E>(r[i]);
            x[2 * i] = f.x;
            x[2 * i + 1] = f.y;
        }
    }
};
template <>
struct Load8<f32> {
    static FA2_DEVICE void run(const void* ptr, float (&x)[8]) {
        u32 lo[4], hi[4];
        ld_global_v4(ptr, lo);
        ld_global_v4(static_cast<const float*>(ptr) + 4, hi);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            x[i] = __uint_as_float(lo[i]);
            x[4 + i] = __uint_as_float(hi[i]);
        }
    }
};

// parts: (n, rows, d) contiguous, element type In; lses: (n, rows) float32; out: (rows, d) contiguous in Out;
// lse_out: (rows,) float32. One warp per row; lanes cover the head dim 8 elements at a time. `rows` flattens
// whatever (batch, seqlen, heads) order the caller uses, identically for parts and lses.
template <class In, class Out>
__global__ void __launch_bounds__(256, 1)
    merge_states(const void* __restrict__ parts, const float* __restrict__ lses, u16* __restrict__ out,
                 float* __restrict__ lse_out, int n, i64 rows, int headdim) {
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= rows) return;
    float m = -pos_inf();
    for (int i = 0; i < n; ++i) {
        const float l = lses[i * rows + row];
        if (l != pos_inf() && l != -pos_inf()) m = fmaxf(m, l);  // +-inf: the part saw no key
    }
    float total = 0.f;
    for (int i = 0; i < n; ++i) {
        const float l = lses[i * rows + row];
        if (l != pos_inf() && l != -pos_inf()) total += __expf(l - m);
    }
    const bool empty = total == 0.f;  // NaN lse (a NaN input) propagates through total
    const float lse = empty ? pos_inf() : m + __logf(total);
    if (lane == 0) lse_out[row] = lse;
    for (int c = lane * 8; c < headdim; c += 32 * 8) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int i = 0; i < n; ++i) {
            const float l = lses[i * rows + row];
            if (empty || l == pos_inf() || l == -pos_inf()) continue;
            const float w = __expf(l - lse);
            float x[8];
            Load8<In>::run(static_cast<const char*>(parts) + ((i * rows + row) * headdim + c) * kElemBytes<In>,
                           x);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] += w * x[j];
        }
        u32 packed[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) packed[j] = Mma<Out>::pack(acc[2 * j], acc[2 * j + 1]);
        st_global_v4(out + row * headdim + c, packed);
    }
}

}  // namespace fa2
