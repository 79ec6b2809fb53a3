// decode_attention's first item (DecodeStart): its Q rows and each warp's ring prologue, worked out before the wait
// for the kernel before where the launch allows, and its first key tiles loaded before its index values arrive where
// the cache layout allows.
#pragma once
#include "common/types.cuh"
#include "common/params.cuh"
#include "common/hints.cuh"
#include "sm80/memory.cuh"
#include "sm90/grid_dependencies.cuh"
#include "decode/traits.cuh"
#include "decode/call.cuh"

namespace fa2 {

template <class Tr>
struct DecodeStart {
    using Call = DecodeCall<Tr>;
    static constexpr int kTilePages = Call::kTilePages, kQPerThread = Call::kQPerThread;
    static constexpr bool kWalk = Call::kWalk, kPlanQ = Call::kPlanQ;
    // The ring: each warp keeps kS - 1 tiles in flight while it waits for the next one, refilling a slot before
    // the math on the next tile; deep (Tr::kDeepRing), kS tiles, refilling each slot right after its tile's math.
    // Each position issued is one commit group, empty past the item's tiles.
    static constexpr int kAhead = Tr::kStages - 1 + Tr::kDeepRing;  // positions issued before the first tile's math
    // Launched programmatically (`programmatic`, sm_90), a block waits at wait_for_prior_grids for the kernel
    // before to finish, often for microseconds: the first item's copies are worked out before the wait (Q's and the
    // guessed tiles' addresses; paged, the guessed tiles' block_table entries are read for them), so that after it
    // the copies are all that is left to issue (ptxas had put nearly all the index arithmetic after the wait, and a
    // call's first copies went out ~500 instructions after it). Launched plainly, working out first only delayed
    // the index loads (8 x 1k +8% on the H100): there the loads go first.
    static constexpr bool kPlanEarly = FA2_GRID_DEPENDENCIES != 0;  // (older GPUs: never launched programmatically)

    // Without cache_batch_idx or Extras, row b's keys start at slot 0 of cache row b (paged: of the pages its
    // block_table row lists) whatever its length, so the warp's first tiles are loaded before cache_seqlens arrives
    // (a round trip at every block's start), as if the row covered them whole: kept if it does, else landed and
    // loaded again. A guessed page entry out of range is not read and not reported (the row may not use it), and
    // its tiles are loaded again the checked way. (Speculative reads stay inside the cache; a key past the row's
    // length never reaches the math.)
    DecodeItem guess;
    bool speculate;
    bool plan_early;
    // Paged, early: the kernel before may still be writing block_table, so the entries read before the wait are
    // guesses, read again after it; if any differs, the copies land and the tiles load again.
    DecodeTileStart guess_starts[kAhead];  // (worked out once, for the reads before and after the wait and the plans)
    int early_entries[kAhead][kTilePages], entries_after_wait[kAhead][kTilePages];
    typename Call::QPlan first_q;
    typename Call::KVPlan guess_plans[kAhead];

    FA2_DEVICE DecodeStart(const Call& call, const DecodeItem& cur) {
        const DecodeParams& params = call.params;
        guess.b = guess.cache_row = cur.b;
        guess.kv_head = cur.kv_head;
        guess.pad = guess.key_begin = 0;
        guess.key_end = params.capacity;
        guess.first_tile = cur.split * Call::kTileStride + call.tile_warp;
        speculate = !Tr::kExtras && call.cache_seqlens != nullptr && call.cache_batch_idx == nullptr &&
                    (Tr::kPaged || cur.b < params.cache_rows) &&
                    call.tile_first(guess, kAhead - 1) + Tr::kBlockN <= params.capacity;
        plan_early = kPlanEarly && params.programmatic != 0;
#pragma unroll
        for (int t = 0; t < kAhead; ++t) guess_starts[t] = call.tile_start(call.tile_first(guess, t));
        if (plan_early && Tr::kPaged && speculate) {
#pragma unroll
            for (int t = 0; t < kAhead; ++t) call.tile_entries(guess.b, guess_starts[t], early_entries[t], true);
        }
    }

    // The first item's copies worked out: Q's, and the guessed tiles' plans. `guess_bad_page`: a guessed tile's
    // block_table entry was out of range (or, paged and planned early, changed after the wait).
    FA2_DEVICE void plan(const Call& call, const DecodeItem& cur, bool& guess_bad_page) {
        if constexpr (kPlanQ) {
            first_q = call.plan_q(cur);
#pragma unroll
            for (int i = 0; i < kQPerThread; ++i) keep_here(first_q.src[i]);
        }
        if constexpr (kWalk) {
            if (speculate) {
#pragma unroll
                for (int t = 0; t < kAhead; ++t) {
                    const DecodeTileStart& start = guess_starts[t];
                    int pages[kTilePages];
                    bool bad = false;
                    if constexpr (Tr::kPaged) {
                        if (plan_early) {
#pragma unroll
                            for (int p = 0; p < kTilePages; ++p) pages[p] = early_entries[t][p];
                        } else {
                            call.tile_entries(guess.b, start, pages, false);
                        }
                        bad = call.check_pages(guess, start, pages, true);
                    }
                    guess_bad_page |= bad;
                    guess_plans[t] = call.plan_kv(guess, start, pages, bad);
                    Call::keep_plan_here(guess_plans[t]);
                }
            }
        }
    }

    // After the wait: the early guesses' block_table entries read again, or (launched plainly) the plans.
    FA2_DEVICE void after_wait(const Call& call, const DecodeItem& cur, bool& guess_bad_page) {
        if (plan_early) {
            if (Tr::kPaged && speculate) {
#pragma unroll
                for (int t = 0; t < kAhead; ++t)
                    call.tile_entries(guess.b, guess_starts[t], entries_after_wait[t], false);
            }
        } else {
            plan(call, cur, guess_bad_page);
        }
    }

    // The first item: Q (its addresses need no index value, so it loads while they arrive), then each warp's ring
    // prologue, one group per position (empty past the warp's tiles).
    FA2_DEVICE void issue(const Call& call, const DecodeItem& cur, bool& guess_bad_page) {
        if constexpr (kPlanQ)
            call.issue_q(first_q, 0);
        else
            call.load_q(cur, 0);
        cp_async_commit();
        if (speculate) {
#pragma unroll
            for (int t = 0; t < kAhead; ++t) {
                if constexpr (kWalk) {
                    if (min(guess_plans[t].rows_in, guess_plans[t].rows_in_v) >= Tr::kBlockN)
                        call.issue_kv(guess_plans[t], t, Const<1>{});
                    else
                        call.issue_kv(guess_plans[t], t, Const<0>{});
                } else {
                    guess_bad_page |= call.load_kv_given(guess, t, t, true, plan_early, early_entries[t]);
                }
                cp_async_commit();
            }
        }
    }

    // Once cur is checked: the guessed tiles kept, or landed and loaded again the checked way. Returns whether a
    // block_table entry of cur's tiles was bad (this thread's loads).
    FA2_DEVICE bool finish(const Call& call, const DecodeItem& cur, bool& guess_bad_page) {
        if (plan_early && Tr::kPaged && speculate) {
#pragma unroll
            for (int t = 0; t < kAhead; ++t)
#pragma unroll
                for (int p = 0; p < kTilePages; ++p) guess_bad_page |= early_entries[t][p] != entries_after_wait[t][p];
            // (lanes may have read different guesses while block_table was being written: they start again together)
            guess_bad_page = __any_sync(0xffffffffu, guess_bad_page);
        }
        bool bad_page = false;  // a bad block_table entry in cur's tiles (this thread's loads)
        if (!speculate || guess_bad_page || call.tile_first(cur, kAhead - 1) + Tr::kBlockN > cur.key_end) {
            if (speculate) cp_async_wait<0>();  // (a slot's copies land before it is filled again)
#pragma unroll
            for (int t = 0; t < kAhead; ++t) {
                if (t < cur.my_tiles) bad_page |= call.load_kv(cur, t, t);
                cp_async_commit();
            }
        }
        return bad_page;
    }
};

}  // namespace fa2
