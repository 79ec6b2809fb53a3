// decode_attention's scores: each key tile's Q K^T on tensor cores, turned into the logits the softmax takes (masked,
// and with Extras modified by softcap and ALiBi).
#pragma once
#include "common/types.cuh"
#include "common/params.cuh"
#include "sm80/tile_mma.cuh"
#include "attention/masks.cuh"
#include "decode/traits.cuh"
#include "decode/call.cuh"

namespace fa2 {

// Extras: each thread's two rows (packed row g and g + 8) belong to their own query heads, so each has its own
// ALiBi slope and score modifiers.
template <class Tr>
FA2_DEVICE void item_score_mods(const DecodeCall<Tr>& call, const DecodeItem& cur, ScoreMods (&mods)[2]) {
    const DecodeParams& params = call.params;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int packed = cur.row0 + (call.lane >> 2) + half * 8;
        int query, head;
        call.query_head(cur.kv_head, packed, query, head);
        const float slope = call.alibi_slopes != nullptr && packed < call.rows
                                ? call.alibi_slopes[cur.b * params.alibi_batch_stride + head]
                                : 0.f;
        mods[half] = make_score_mods(params.scale, params.softcap, slope, params.seqlen_q, cur.seqlen_k);
    }
}

// The scores of the warp's j-th tile of cur (keys in ring slot k_slot) against cur's Q rows (q_tile).
template <class Tr, int kNT>
FA2_DEVICE void score_tile(float (&s)[1][kNT][4], const DecodeCall<Tr>& call, const DecodeItem& cur, u32 q_tile,
                           u32 k_slot, int j, const WindowMask<kMaskWindow>& window, const ScoreMods (&mods)[2]) {
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    constexpr int kKSteps = Tr::kHeadDim / 16;
    const DecodeParams& params = call.params;
    const int lane = call.lane;
    zero_fragments(s);
    mma_tiles<typename Tr::Elem, kKSteps>(
        s, [&](u32(&a)[4], int, int kk) { QTile::load_a(a, q_tile, 0, kk * 16, lane); },
        [&](u32(&b)[4], int np, int kk) { KVTile::load_b_nk(b, k_slot, np * 16, kk * 16, lane); });
    // Mask keys past this split's end and, under the causal mask, past each row's own query.
    const int first = call.tile_first(cur, j);
    if constexpr (Tr::kExtras) {
        // Final logits (softcap, ALiBi), then the window: a key's distance from the row's diagonal decides. (The
        // softcap is the call's, the same in both rows' ScoreMods: switched once.)
        const auto final_logits = [&](auto capped) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int query = call.by_heads_per_kv.div(cur.row0 + (lane >> 2) + half * 8);
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = first + nt * 8 + (lane & 3) * 2 + e;
                        const int dist = key - query - window.diag();
                        float unused;
                        const float x = mods[half].template logit_of<decltype(capped)::value>(
                            s[0][nt][2 * half + e], query, key, unused);
                        s[0][nt][2 * half + e] =
                            key >= cur.key_end || dist > params.window_right || dist < -params.window_left
                                ? -pos_inf()
                                : x;
                    }
                }
            }
        };
        if (mods[0].cap > 0.f)
            final_logits(Bool<true>{});
        else
            final_logits(Bool<false>{});
    } else {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int query = call.by_heads_per_kv.div(cur.row0 + (lane >> 2) + half * 8);
            const int limit =
                Tr::kCausal ? min(cur.key_end, cur.seqlen_k - params.seqlen_q + query + 1) : cur.key_end;
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                const int key = first + nt * 8 + (lane & 3) * 2;
                if (key >= limit) s[0][nt][2 * half] = -pos_inf();
                if (key + 1 >= limit) s[0][nt][2 * half + 1] = -pos_inf();
            }
        }
    }
}

}  // namespace fa2
