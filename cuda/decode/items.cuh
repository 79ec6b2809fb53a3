// decode_attention's work items: the index values the host could not check, and each warp's share of an item's key
// tiles.
#pragma once
#include "common/types.cuh"
#include "common/fast_div.cuh"
#include "common/errors.cuh"
#include "attention/masks.cuh"
#include "decode/traits.cuh"

namespace fa2 {

// Values the host could not check. A bad one poisons the item: it writes NaN. Then the row's keys that some row
// of the block sees (under the causal mask, none past the last row's limit), in BlockN tiles, and this warp's
// share of them (warp items: the warp takes them all).
template <class Tr>
FA2_DEVICE void check_item(DecodeItem& it, const CacheIndex& index, const int& lane, int* const& error_claim,
                           long long* const& error_host, const int& seqlen_new, const int& seqlen_q, const int& rows,
                           const FastDiv& by_heads_per_kv, const FastDiv& by_splits, const int& window_left,
                           const int& window_right, const int& tile_warp, const int& tile_stride) {
    constexpr bool solo = Tr::kWarpItems;
    constexpr int kTileStride = solo ? 1 : Tr::kWarps;

    const bool reporter = (solo ? lane : threadIdx.x) == 0 && it.split == 0 && it.group == 0;  // one per row
    it.poisoned = false;  // a bad value of this item's (a report pending from elsewhere: pending_report)
    if (!index.seqlen_ok(it.cached)) {
        it.poisoned = true;
        if (reporter) report_bad_value(error_claim, error_host, kBadCacheSeqlen, it.b, 0, it.cached);
    }
    if (!Tr::kPaged && !index.row_ok(it.cache_row)) {
        it.poisoned = true;
        if (reporter) report_bad_value(error_claim, error_host, kBadCacheBatchIdx, it.b, 0, it.cache_row);
    }
    // left pad: key j of the row is cache slot pad + j (Extras only; 0 folds away otherwise)
    if (Tr::kExtras && !it.poisoned && (it.pad < 0 || it.pad > it.cached)) {
        it.poisoned = true;
        if (reporter) report_bad_value(error_claim, error_host, kBadCacheLeftpad, it.b, 0, it.pad);
    }
    it.seqlen_k = it.poisoned ? 0 : it.cached + seqlen_new - it.pad;
    const int last_query = min(seqlen_q - 1, by_heads_per_kv.div(min(rows, it.row0 + 16) - 1));
    if constexpr (Tr::kExtras) {
        // Only the keys some row of the block sees, from a tile boundary (paged tiles must start on a multiple
        // of 16 keys), are streamed: a small window over a long cache costs a few tiles, not the cache.
        const WindowMask<kMaskWindow> window{seqlen_q, it.seqlen_k, window_left, window_right};
        const int first_query = by_heads_per_kv.div(it.row0);
        it.key_begin = window.key_begin(first_query) / Tr::kBlockN * Tr::kBlockN;
        it.key_end = window.key_end(first_query, last_query - first_query + 1);
    } else {
        it.key_begin = 0;
        it.key_end = it.seqlen_k;
        if (Tr::kCausal) it.key_end = min(it.key_end, it.seqlen_k - seqlen_q + last_query + 1);
    }
    // The splits' warps take the key tiles in turn (split s, warp w: tiles s * W + w, + num_splits * W, ...):
    // one tile order for every item, with no per-split key ranges to work out (as fast as contiguous ranges
    // per split, docs/design.md).
    const int n_tiles =
        it.key_end > it.key_begin ? (it.key_end - it.key_begin + Tr::kBlockN - 1) / Tr::kBlockN : 0;
    it.first_tile = it.split * kTileStride + tile_warp;
    it.my_tiles = n_tiles > it.first_tile  // (x / kTileStride) / num_splits = x / tile_stride
                      ? by_splits.div((n_tiles - it.first_tile + tile_stride - 1) / kTileStride)
                      : 0;
}

}  // namespace fa2
