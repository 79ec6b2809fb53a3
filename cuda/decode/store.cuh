// decode_attention's output stores: a warp item's rows, written by the warp itself.
#pragma once
#include "common/types.cuh"
#include "common/params.cuh"
#include "sm80/mma.cuh"
#include "decode/traits.cuh"

namespace fa2 {

// Warp items: the warp's rows are final (one split): each lane holds rows lane / 4 and lane / 4 + 8, two columns
// of every 8-column tile. `poisoned`: the rows are written as NaN; out_row / lse_index: a packed row's index in out
// and in lse_out.
template <class Tr, int kDT, class OutRow, class LseIndex>
FA2_DEVICE void store_warp_rows(const DecodeParams& params, const DecodeItem& cur, const float (&acc_o)[1][kDT][4],
                                const float (&row_lse)[2], const bool& poisoned, u16* __restrict__ const& out,
                                float* __restrict__ const& lse_out, const int& lane, const int& rows,
                                const OutRow& out_row, const LseIndex& lse_index) {
    using Mma = fa2::Mma<typename Tr::Elem>;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int packed = cur.row0 + (lane >> 2) + half * 8;
        if (packed >= rows) continue;
        u32* dst = reinterpret_cast<u32*>(out + out_row(packed) * params.headdim);
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
            const int c = dt * 8 + (lane & 3) * 2;
            if (c < params.headdim)
                dst[c / 2] = poisoned ? Mma::pack(quiet_nan(), quiet_nan())
                                      : Mma::pack(acc_o[0][dt][2 * half], acc_o[0][dt][2 * half + 1]);
        }
        if ((lane & 3) == 0 && lse_out != nullptr)
            lse_out[lse_index(packed)] = poisoned ? quiet_nan() : row_lse[half];
    }
}

}  // namespace fa2
