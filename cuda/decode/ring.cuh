// decode_attention's ring across items: each warp's cp.async ring of key tiles runs on from one work item into the
// next (the next item's Q and first tiles load while the warp finishes the current one).
#pragma once
#include "common/types.cuh"
#include "sm80/memory.cuh"
#include "decode/traits.cuh"

namespace fa2 {

// A later item's first tiles and Q landed (for this thread): issued during the previous item (the deep ring: its
// first position, the rest here). load_kv(item, j, slot): tile j of an item into ring slot `slot`, true if a
// block_table entry was bad; issued: cur's tiles (deep: ring positions) issued ahead; slot_base: the ring slot of
// cur's first tile.
template <class Tr, class LoadKV>
FA2_DEVICE void ring_next_item(const LoadKV& load_kv, const DecodeItem& cur, int& issued, const int& slot_base,
                               bool& bad_page) {
    constexpr int kS = Tr::kStages;
    if constexpr (Tr::kDeepRing) {
        for (; issued < kS; ++issued) {
            if (issued < cur.my_tiles) bad_page |= load_kv(cur, issued, (slot_base + issued) % kS);
            cp_async_commit();
        }
        cp_async_wait<kS - 1>();  // Q (committed before these) and tile 0
    } else {
        // The first kS - 1 tiles of cur in flight (issued during the previous item, unless it had fewer
        // tiles), then Q and those tiles landed.
        for (; issued < min(kS - 1, cur.my_tiles); ++issued) {
            bad_page |= load_kv(cur, issued, (slot_base + issued) % kS);
            cp_async_commit();
        }
        cp_async_wait<0>();
    }
}

}  // namespace fa2
