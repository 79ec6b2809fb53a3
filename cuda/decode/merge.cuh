// Merging attention computed over disjoint key sets by their log-sum-exps: the merge_states kernel and decode's block
// and split merges.
#pragma once
#include "common/types.cuh"

namespace fa2 {

FA2_DEVICE bool is_inf(float x) { return x == pos_inf() || x == -pos_inf(); }

// lse of the union of n parts (lse_at(i) for part i): parts with lse +-inf saw no key and count for nothing; no
// part with a key gives +inf; a NaN lse (poisoned input) gives NaN.
template <class LseAt>
FA2_DEVICE float merged_lse(int n, LseAt lse_at) {
    float m = -pos_inf();
    for (int i = 0; i < n; ++i) {
        const float l = lse_at(i);
        if (!is_inf(l)) m = fmaxf(m, l);
    }
    float total = 0.f;
    for (int i = 0; i < n; ++i) {
        const float l = lse_at(i);
        if (!is_inf(l)) total += __expf(l - m);
    }
    return total == 0.f ? pos_inf() : m + __logf(total);
}

// Weight of a part with lse `part` in a union with lse `whole` (0 for parts without keys, NaN stays NaN).
FA2_DEVICE float part_weight(float part, float whole) {
    return is_inf(part) || whole == pos_inf() ? 0.f : __expf(part - whole);
}

}  // namespace fa2
