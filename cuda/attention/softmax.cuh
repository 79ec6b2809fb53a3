// Online softmax over score tiles held in mma C-fragment layout (FA2 Algorithm 1, lines 8-10 and 12).
//
// Each thread owns two rows per m16 tile (g and g+8) and, of each row, two columns per n8 tile; the four lanes
// of a quad share a row. Row maxima are reduced across the quad every tile (all lanes need the same shift),
// but row sums stay per-thread partials until the end: every lane of a quad scales its partial by the same
// factor, so one quad reduction at the end gives the exact sum (saves two shuffles per row per tile).
#pragma once
#include "common/types.cuh"
#include "common/math.cuh"
#include "common/warp.cuh"

namespace fa2 {

// A per-row offset of a tile's scores (RowBias): score s of row r stands for s + bias[r]. The Hopper forward's ALiBi
// leaves the part of its bias that is constant along a thread's row to the softmax: one add per row to the tile's
// max and one FMA per row to the exponent's shift, instead of an add per score (UnitScoreMods::apply).
// headroom (probabilities_lazy): where a row's reference max moves, it moves that far past the row's new max, so
// that scores still climbing (ALiBi's bias, tile by tile towards the diagonal) stay under it for more tiles. P then
// starts at 2^-(headroom scale_log2): only for a 16-bit P with fp32's exponent range (bf16), where that costs no
// relative precision.
// On = false: no bias (the softmax's code is then that of plain scores, whatever the fields hold).
template <int Rows, bool On = true>
struct RowBias {
    static constexpr bool kOn = On;
    float v[Rows];
    float headroom;
    FA2_DEVICE float operator[](int r) const { return v[r]; }
};
using NoRowBias = RowBias<1, false>;

// The scores themselves as the logits (OnlineSoftmax::probabilities_fixed's default).
struct Scores {
    FA2_DEVICE float operator()(float x) const { return x; }
};

template <int MTiles, int NTiles>
struct OnlineSoftmax {
    static constexpr int kRows = MTiles * 2;
    float row_max[kRows];  // running max of raw scores (unscaled), -inf until a key is seen
    float row_sum[kRows];  // this thread's partial sum of exp2(scale_log2 * (s - row_max))

    FA2_DEVICE void init() {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            row_max[r] = -pos_inf();
            row_sum[r] = 0.f;
        }
    }

    // Turns the scores s (raw Q K^T, masked entries -inf) into unnormalised probabilities in place, and
    // rescales the output accumulator by exp(m_old - m_new) so that it stays relative to the new max.
    // Works on raw scores with the scale folded into one FFMA per element, exp2(s * c - m * c) with
    // c = scale * log2(e) > 0 (the host turns a negative scale into a positive one on negated q, since
    // the max of raw scores is only the max of scaled scores for c > 0). The division by the row sum is
    // deferred to finalize(): one divide per row instead of one per tile.
    template <int DTiles>
    FA2_DEVICE void update(float (&s)[MTiles][NTiles][4], float (&acc_o)[MTiles][DTiles][4], float scale_log2) {
        float correction[kRows];
        probabilities(s, scale_log2, correction);
        rescale(acc_o, correction);
    }

    // update() in two halves, for kernels whose previous O += P V is still in flight while the next scores turn
    // into probabilities: the factor each row's running output must take, then its rescale once that has landed.
    // bias (RowBias): the scores' per-row offsets; the running max, the sums and the lse are those of s + bias.
    template <class Bias = NoRowBias>
    FA2_DEVICE void probabilities(float (&s)[MTiles][NTiles][4], float scale_log2, float (&correction)[kRows],
                                  const Bias& bias = Bias{}) {
#pragma unroll
        for (int mt = 0; mt < MTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = mt * 2 + half;
                const float new_max = tile_row_max(s, mt, half, row_max[r], bias, r);
                // A row that has seen only masked keys keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
                const float shift = new_max == -pos_inf() ? 0.f : new_max * scale_log2;
                correction[r] = fast_exp2(row_max[r] * scale_log2 - shift);
                row_max[r] = new_max;
                float sum = 0.f;
                exponentiate_row(s, mt, half, scale_log2, biased_shift(shift, scale_log2, bias, r), sum);
                row_sum[r] = row_sum[r] * correction[r] + sum;
            }
        }
    }
    // probabilities() that keeps every row's reference max (so its output needs no rescale) while no row of the
    // warp's grows past it by more than 2^kLazyLog2 in P: then P runs up to 2^kLazyLog2 instead of 1, exact in
    // fp32 and in the 16-bit P as a ratio to the row's max. Returns whether the warp's rows moved (every row to its
    // new max, as probabilities() does): only then must the output take `correction` (rescale). Warp-uniform.
    static constexpr float kLazyLog2 = 8.f;
    template <class Bias = NoRowBias>
    FA2_DEVICE bool probabilities_lazy(float (&s)[MTiles][NTiles][4], float scale_log2, float (&correction)[kRows],
                                       const Bias& bias = Bias{}) {
        float tile_max[kRows];
        bool grow = false;
#pragma unroll
        for (int mt = 0; mt < MTiles; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = mt * 2 + half;
                tile_max[r] = tile_row_max(s, mt, half, row_max[r], bias, r);
                // (-inf - -inf: NaN, no growth: a row that has seen only masked keys keeps shift 0)
                grow |= (tile_max[r] - row_max[r]) * scale_log2 > kLazyLog2;
            }
        grow = __any_sync(0xffffffffu, grow);
#pragma unroll
        for (int mt = 0; mt < MTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = mt * 2 + half;
                float shift;
                if (grow) {
                    // (a row whose max has not moved keeps its reference, so that its headroom does not pile up)
                    float ref = tile_max[r];
                    if constexpr (Bias::kOn) ref = tile_max[r] > row_max[r] ? tile_max[r] + bias.headroom : row_max[r];
                    shift = ref == -pos_inf() ? 0.f : ref * scale_log2;
                    correction[r] = fast_exp2(row_max[r] * scale_log2 - shift);
                    row_max[r] = ref;
                    row_sum[r] *= correction[r];
                } else {
                    shift = row_max[r] == -pos_inf() ? 0.f : row_max[r] * scale_log2;
                }
                exponentiate_row(s, mt, half, scale_log2, biased_shift(shift, scale_log2, bias, r), row_sum[r]);
            }
        }
        return grow;
    }
    // probabilities() against a reference max of 0 for every row, for scores whose exponent exp2(s scale_log2)
    // stays within range without a shift (the Hopper forward's softcapped values: |s| <= 1 and scale_log2 =
    // softcap log2(e), HopperFwdTraits::kCapFixedMax): no row max, no quad shuffle, and the output never takes a
    // correction. logit: a function applied to each score first, in the same pass as its exponential (the softcap's
    // tanh: HopperFwdConsumer::probabilities).
    template <class Logit = Scores>
    FA2_DEVICE void probabilities_fixed(float (&s)[MTiles][NTiles][4], float scale_log2, Logit logit = Logit{}) {
#pragma unroll
        for (int mt = 0; mt < MTiles; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                row_max[mt * 2 + half] = 0.f;
                exponentiate_row(s, mt, half, scale_log2, 0.f, row_sum[mt * 2 + half], logit);
            }
    }
    // The max of row `half` of m16 tile mt (row r) over this tile's scores (plus the row's bias) and `m`, across
    // the quad.
    template <class Bias = NoRowBias>
    static FA2_DEVICE float tile_row_max(const float (&s)[MTiles][NTiles][4], int mt, int half, float m,
                                         const Bias& bias = Bias{}, int r = 0) {
        float local = Bias::kOn ? -pos_inf() : m;  // (with a bias, m joins after it: -inf + bias is -inf)
#pragma unroll
        for (int nt = 0; nt < NTiles; ++nt) local = fmaxf(local, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
        if constexpr (Bias::kOn) local = fmaxf(m, local + bias[r]);
        return quad_max(local);
    }
    // The exponent's shift for a row's scores s whose values are s + bias: exp2((s + bias) c - shift).
    template <class Bias>
    static FA2_DEVICE float biased_shift(float shift, float scale_log2, const Bias& bias, int r) {
        if constexpr (Bias::kOn) return fmaf(-bias[r], scale_log2, shift);
        else return shift;
    }
    // That row's scores to exp2(logit(s) scale_log2 - shift) in place, each added to `sum` (this thread's partial).
    template <class Logit = Scores>
    static FA2_DEVICE void exponentiate_row(float (&s)[MTiles][NTiles][4], int mt, int half, float scale_log2,
                                            float shift, float& sum, Logit logit = Logit{}) {
#pragma unroll
        for (int nt = 0; nt < NTiles; ++nt) {
#pragma unroll
            for (int e = 2 * half; e < 2 * half + 2; ++e) {
                s[mt][nt][e] = fast_exp2(logit(s[mt][nt][e]) * scale_log2 - shift);
                sum += s[mt][nt][e];
            }
        }
    }
    template <int DTiles>
    FA2_DEVICE void rescale(float (&acc_o)[MTiles][DTiles][4], const float (&correction)[kRows]) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
#pragma unroll
            for (int dt = 0; dt < DTiles; ++dt) {
                acc_o[r / 2][dt][2 * (r % 2)] *= correction[r];
                acc_o[r / 2][dt][2 * (r % 2) + 1] *= correction[r];
            }
        }
    }

    // Normalises acc_o by the row sums and returns each row's natural-log sum-exp in lse (the only statistic
    // the backward needs). A row with no visible key gets output 0 and lse +inf (flash-attn's convention:
    // exp(s - lse) is then 0 in the backward).
    template <int DTiles>
    // out_scale: a factor of the output (dropout's 256 / threshold), not of the log-sum-exp.
    FA2_DEVICE void finalize(float (&acc_o)[MTiles][DTiles][4], float (&lse)[kRows], float scale,
                             float out_scale = 1.f) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const float sum = quad_sum(row_sum[r]);
            const bool empty = sum == 0.f;  // NaN inputs are left to propagate, never hidden as 0
            const float inv = empty ? 0.f : out_scale * (1.f / sum);
            lse[r] = empty ? pos_inf() : row_max[r] * scale + __logf(sum);
            const int mt = r / 2, half = r % 2;
#pragma unroll
            for (int dt = 0; dt < DTiles; ++dt) {
                acc_o[mt][dt][2 * half] *= inv;
                acc_o[mt][dt][2 * half + 1] *= inv;
            }
        }
    }
};

}  // namespace fa2
