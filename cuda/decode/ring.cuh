// decode_attention's ring across items: each warp's cp.async ring of key tiles runs on from one work item into the
// next (the next item's Q and first tiles load while the warp finishes the current one).
#pragma once
#include "common/types.cuh"
#include "sm80/memory.cuh"
#include "decode/traits.cuh"
#include "decode/call.cuh"

namespace fa2 {

// Where a warp's ring stands on its current item (cur).
struct DecodeRing {
    int buffer;     // cur's Q buffer
    int slot_base;  // ring slot of cur's first tile (of this warp), modulo kS
    int issued;     // cur's tiles (deep: ring positions) issued ahead
};

// The item the warp (or block) takes after cur, loaded during cur.
struct DecodeNext {
    DecodeItem it;
    int issued;  // its tiles (deep: ring positions) issued during cur
};

// The next item after `item`: its index values loaded only (checked after cur's first tile's math).
template <class Tr>
FA2_DEVICE void begin_next(const DecodeCall<Tr>& call, DecodeNext& next, int next_item, bool has_next) {
    next.it.my_tiles = 0;
    if (has_next) call.item_values(next_item, next.it);
    next.issued = 0;
}

// Checks the next item (once: `checked`).
template <class Tr>
FA2_DEVICE void check_next(const DecodeCall<Tr>& call, DecodeNext& next, bool& checked) {
    if (!checked) {
        call.item_check(next.it);
        checked = true;
    }
}

// Checks the next item (once) and loads its Q into the other buffer.
template <class Tr>
FA2_DEVICE void start_next(const DecodeCall<Tr>& call, DecodeNext& next, bool has_next, bool& checked, int buffer) {
    if (!has_next) return;
    check_next(call, next, checked);
    call.load_q(next.it, buffer ^ 1);
    if constexpr (!Tr::kDeepRing) cp_async_commit();  // deep: it joins the iteration's group
}

// A later item's first tiles and Q landed (for this thread): they were issued during the previous item (the deep
// ring: its first position, the rest here).
template <class Tr>
FA2_DEVICE void ring_next_item(const DecodeCall<Tr>& call, const DecodeItem& cur, DecodeRing& ring, bool& bad_page) {
    constexpr int kS = Tr::kStages;
    if constexpr (Tr::kDeepRing) {
        for (; ring.issued < kS; ++ring.issued) {
            if (ring.issued < cur.my_tiles)
                bad_page |= call.load_kv(cur, ring.issued, (ring.slot_base + ring.issued) % kS);
            cp_async_commit();
        }
        cp_async_wait<kS - 1>();  // Q (committed before these) and tile 0
    } else {
        // The first kS - 1 tiles of cur in flight (issued during the previous item, unless it had fewer
        // tiles), then Q and those tiles landed.
        for (; ring.issued < min(kS - 1, cur.my_tiles); ++ring.issued) {
            bad_page |= call.load_kv(cur, ring.issued, (ring.slot_base + ring.issued) % kS);
            cp_async_commit();
        }
        cp_async_wait<0>();
    }
}

// One commit group for this warp's ring position `ahead` of cur: its tile, or past cur's tiles the next
// item's next position (the ring runs on into it; the slot's tile of cur has been consumed). The table's
// ring issues the next item's first kS - 1 tiles here; the deep ring one position (a group, empty past the
// next item's tiles) per call, the rest at the next item's start.
// `bad_page`, `next_bad_page`: a bad block_table entry in cur's, the next item's tiles; `checked`: the next item's.
template <class Tr>
FA2_DEVICE void issue_ahead(const DecodeCall<Tr>& call, const DecodeItem& cur, DecodeRing& ring, bool& bad_page,
                            DecodeNext& next, bool has_next, bool& next_bad_page, bool& checked, int ahead) {
    constexpr int kS = Tr::kStages;
    constexpr bool deep = Tr::kDeepRing;
    if (ahead < cur.my_tiles) {
        bad_page |= call.load_kv(cur, ahead, (ring.slot_base + ahead) % kS);
    } else if (has_next) {
        check_next(call, next, checked);
        if (next.issued < (deep ? next.it.my_tiles : min(kS - 1, next.it.my_tiles))) {
            next_bad_page |= call.load_kv(next.it, next.issued, (ring.slot_base + cur.my_tiles + next.issued) % kS);
            if constexpr (!deep) ++next.issued;
        }
        if constexpr (deep) ++next.issued;
    }
    cp_async_commit();
}

}  // namespace fa2
