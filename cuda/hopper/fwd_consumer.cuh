// The Hopper forward's consumer warpgroups, their stages: warpgroup wg owns rows 64 wg .. 64 wg + 63 of each item's
// tile, warp w of it 16 of those. Per key tile j a warpgroup issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} together,
// then turns S_j into P_j, and the warpgroups take turns to issue (named barriers HopperFwdBarrier), so that one's
// softmax runs under the others' products. (ptxas puts the wait for P_{j-1} V_{j-1} ahead of the softmax; held below
// it, so that the softmax also ran under the warpgroup's own product, the kernel was 2.5-7.5% slower:
// docs/design.md.) The item loop that runs these stages is flash_fwd_hopper's own (hopper/fwd.cu).
#pragma once
#include "common/types.cuh"
#include "common/warp.cuh"
#include "sm80/mma.cuh"
#include "sm80/tile_mma.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/warpgroup.cuh"
#include "sm90/wgmma.cuh"
#include "sm90/slabs.cuh"
#include "attention/softmax.cuh"
#include "attention/masks.cuh"
#include "hopper/fwd_traits.cuh"

namespace fa2 {

// O += P V over k16 steps [Begin, End) of P (V: the tile at v_slot), 16 key rows apart, with a fence and a commit of
// their own (each branch of issue_pv its own: ptxas would inject them).
template <class Tr, int Begin, int End>
FA2_DEVICE void issue_pv_steps(float (&acc_o)[1][Tr::kHeadDimV / 8][4], const u32 (&p)[Tr::kBlockN / 16][4],
                               u32 v_slot) {
    using VTile = typename Tr::VTile;
    wgmma_fence();
#pragma unroll
    for (int kk = Begin; kk < End; ++kk)
        Wgmma<typename Tr::Elem, Tr::kHeadDimV>::rs_mn(
            acc_o, p[kk], smem_desc_sw128(VTile::at(v_slot, kk * 16, 0), VTile::kSlabBytes), 1);
    wgmma_commit();
}

// P V over 128-key tiles covers only the 64-key halves a warpgroup's rows can see. (S stays whole: with S's
// accumulators written by different wgmma in a branch, ptxas serialises every wgmma.)
enum KeyHalves : int { kLowKeys = 1, kHighKeys = 2, kBothHalves = kLowKeys | kHighKeys };

// P (the scores' C fragments, packed to 16 bits) as the A operand of O += P V.
template <class Tr>
FA2_DEVICE void scores_to_operand(u32 (&p)[Tr::kBlockN / 16][4], const float (&s)[1][Tr::kBlockN / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) c_to_a<typename Tr::Elem>(p[kk], s[0][2 * kk], s[0][2 * kk + 1]);
}

template <class Tr>
struct HopperFwdConsumer {
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    using VTile = typename Tr::VTile;
    static constexpr int kNT = Tr::kBlockN / 8, kDT = Tr::kHeadDimV / 8;
    static constexpr int kKS = Tr::kKStages, kVS = Tr::kVStages;
    using Softmax = OnlineSoftmax<1, kNT>;

    const HopperFwdSmem<Tr>& smem;
    const HopperFwdArgs& args;
    const int& warp;  // (the kernel's own, computed before it parts into warpgroups)
    const int& lane;
    // The warpgroup as warp_uniform(): from `warp >> 2` ptxas kept every branch on the warpgroup divergent (a
    // WARPSYNC or BSSY/BSYNC pair around each; 464 more instructions, 3-7% slower) and serialised any wgmma in such
    // a branch.
    const int wg;
    u32 tiles = 0;        // K/V tiles taken (K's next is tile `tiles`)
    u32 items_taken = 0;  // (Q buffer items_taken % kQBuffers next)

    FA2_DEVICE HopperFwdConsumer(const HopperFwdSmem<Tr>& smem_, const HopperFwdArgs& args_, const int& warp_,
                                 const int& lane_)
        : smem(smem_), args(args_), warp(warp_), lane(lane_), wg(warp_uniform(warp_ >> 2)) {}

    // Warpgroup w waits at barrier kFwdTurn0 + w for the one before it and hands the turn on at the next one's.
    FA2_DEVICE void turn_wait() const {
        if (wg == 0)
            named_barrier_sync<kFwdTurn0, kFwdTurnThreads>();
        else if (Tr::kConsumerWGs == 2 || wg == 1)
            named_barrier_sync<kFwdTurn1, kFwdTurnThreads>();
        else
            named_barrier_sync<kFwdTurn2, kFwdTurnThreads>();
    }
    FA2_DEVICE void turn_pass() const {
        if (wg == 0)
            named_barrier_arrive<kFwdTurn1, kFwdTurnThreads>();
        else if (Tr::kConsumerWGs == 2 || wg == 2)
            named_barrier_arrive<kFwdTurn0, kFwdTurnThreads>();
        else
            named_barrier_arrive<kFwdTurn2, kFwdTurnThreads>();
    }
    FA2_DEVICE void mark(int point) const {
        if ((warp & 3) == 0 && lane == 0 && wg < 2) fwd_mark(10 * wg + point, items_taken);
    }
    // This warp's arrival on `bar` (and `also`) once every lane is done.
    FA2_DEVICE void release(u32 bar, u32 also = 0) const {
        __syncwarp();
        if (lane == 0) {
            mbar_arrive(bar);
            if (also) mbar_arrive(also);
        }
    }

    // S = Q K^T over the head dim (Q: the warpgroup's 64 rows at q_rows, K: the tile taken next): k16 steps 32 bytes
    // apart in a slab, then the next slab.
    FA2_DEVICE void issue_s(float (&s)[1][kNT][4], u32 q_rows) const {
        const u32 k_slot = smem.k + ring_slot<kKS>(tiles) * KVTile::kBytes;
#pragma unroll
        for (int kk = 0; kk < Tr::kHeadDim / 16; ++kk) {
            const u32 step = (kk & 3) * 32;
            Wgmma<typename Tr::Elem, Tr::kBlockN>::ss(
                s, smem_desc_sw128(q_rows + (kk >> 2) * QTile::kSlabBytes + step, 16),
                smem_desc_sw128(k_slot + (kk >> 2) * KVTile::kSlabBytes + step, 16), kk > 0);
        }
        wgmma_commit();
    }
    // O += P V with V in ring slot `slot`, over the keys of `halves` (KeyHalves).
    FA2_DEVICE void issue_pv(float (&acc_o)[1][kDT][4], const u32 (&p)[kNT / 2][4], int slot, int halves) const {
        const u32 v_slot = smem.v + slot * VTile::kBytes;
        constexpr bool kHalves = Tr::kBlockN == 128;
        if (!kHalves || halves == kBothHalves)
            issue_pv_steps<Tr, 0, kNT / 2>(acc_o, p, v_slot);
        else if (halves == kLowKeys)
            issue_pv_steps<Tr, 0, kNT / 4>(acc_o, p, v_slot);
        else
            issue_pv_steps<Tr, kNT / 4, kNT / 2>(acc_o, p, v_slot);
    }
    // A tile of the block that this warpgroup's rows cannot see: its turn passes (unless `take_turn` is false), its
    // slots go back (once landed, so that every arrival on a slot's barrier counts towards the same fill).
    FA2_DEVICE void pass_over(bool take_turn) {
        mbar_wait(smem.full(ring_slot<kKS>(tiles)), ring_phase<kKS>(tiles));
        if (take_turn) {
            turn_wait();
            turn_pass();
        }
        release(smem.k_empty(ring_slot<kKS>(tiles)), smem.v_empty(ring_slot<kVS>(tiles)));
        ++tiles;
    }

    // Whether the scores change (kMods: a softcap, or ALiBi with a slope): uniform over the item; a call with
    // dropout alone keeps the plain kernels' scale, folded into the exponent.
    FA2_DEVICE bool modify(const float& slope) const { return Tr::kMods && (args.softcap > 0.f || slope != 0.f); }

    // Whether the item's scores take P against the fixed reference max (kCapFixedMax): a softcap within
    // kCapFixedMaxLimit, without ALiBi.
    FA2_DEVICE bool cap_fixed(const float& slope) const {
        return args.softcap > 0.f && args.softcap <= Tr::kCapFixedMaxLimit && slope == 0.f;
    }

    // The landed scores of the block's tile j: modified (kMods: softcap, and ALiBi of `slope` in their unit, into
    // UnitScoreMods' values), masked where some row of the warpgroup cannot see some key, then P against each
    // row's reference max (OnlineSoftmax::probabilities_lazy): whether O must take `correction`.
    // A softcap against the fixed max (kCapFixedMax) on a tile without a mask takes its tanh and P's exp2 in one pass
    // over the scores, so that ptxas interleaves the two MUFU operations of each score with each other and with the
    // FMA-pipe work around them. Taken in two passes (the tanh in UnitScoreMods::apply, then the mask and the
    // exponentials), the first pass issued its 64 tanh back to back behind its 64 multiplies and the second started
    // only after it: the MUFU pipe was 57% busy and the tensor cores 56% (ncu, d = 128, 8k), against 75% in the plain
    // kernel (docs/design.md, "The tanh and P in one pass").
    FA2_DEVICE bool probabilities(const WindowMask<Tr::kMask>& mask, const float& slope, const int& n_first,
                                  const int& wg_row0, const int& warp_row0, int j, float (&s)[1][kNT][4],
                                  Softmax& softmax, float (&correction)[2]) const {
        pin_registers(s);
        const int col0 = (n_first + j) * Tr::kBlockN;
        if constexpr (Tr::kCapFixedMax) {
            if (cap_fixed(slope) && !mask.tile_needs_mask(wg_row0, 64, col0, Tr::kBlockN)) {
                // (kCap: no ALiBi, so no diagonal)
                const UnitScoreMods mods = capped_unit_score_mods(args.mods, args.scale, args.softcap, 0.f, 0);
                softmax.probabilities_fixed(s, mods.scale_log2(), [mods](float x) { return mods.capped(x); });
                return false;
            }
        }
        float scale_log2 = args.scale_log2;
        // (kAlibiRowBias: ALiBi's part constant along a thread's row, and its headroom)
        RowBias<2, Tr::kAlibiRowBias> bias{{0.f, 0.f}, 0.f};
        if (modify(slope)) {
            const UnitScoreMods mods =
                make_unit_score_mods(args.mods, args.scale, args.softcap, slope, mask.seqlen_q, mask.seqlen_k);
            mods.template apply<Tr::kMask == kMaskCausal, Tr::kAlibiRowBias, Tr::kAlibiOnly>(
                s, warp_row0, col0, lane, bias.v);
            scale_log2 = mods.scale_log2();
            if constexpr (Tr::kAlibiHeadroomLog2 > 0.f)
                if (slope != 0.f) bias.headroom = (Tr::kAlibiHeadroomLog2 / kLog2e) * args.mods.unit_inv;
        }
        if (mask.tile_needs_mask(wg_row0, 64, col0, Tr::kBlockN)) mask.apply(s, warp_row0, col0, lane);
        if constexpr (Tr::kCapFixedMax) {
            if (cap_fixed(slope)) {
                softmax.probabilities_fixed(s, scale_log2);
                return false;
            }
        }
        if constexpr (Tr::kLazyRescale) return softmax.probabilities_lazy(s, scale_log2, correction, bias);
        softmax.probabilities(s, scale_log2, correction, bias);
        return true;
    }

    // Dropout (kMods) on P_j, packed: this warp's 16 rows from warp_row0 (rows g and g + 8 of each Philox call's
    // 32: half its numbers) against the tile's keys, 32 at a time, for the item's batch row b and head. After the
    // row sums: the softmax normaliser counts every key, the output only the kept ones (scaled by 256 / threshold
    // once, at the end). The Philox key and the rows' share of the calls are worked out per tile (a tenth of its
    // Philox work; rng_state's words from L1), not held across the loop: held, they spilled 20-28 bytes at d = 256.
    FA2_DEVICE void drop(u32 (&p)[kNT / 2][4], const int& b, const int& head, const int& n_first,
                         const int& warp_row0, int j) const {
        const Dropout dropout = make_dropout(args.dropout_threshold, args.seed, args.offset, args.rng_state, b,
                                             args.nheads, head, args.dropout_scale);
        const int col0 = (n_first + j) * Tr::kBlockN;
        const auto rows = dropout.template fix_rows<1>(warp_row0, lane);
#pragma unroll
        for (int kb = 0; kb < Tr::kBlockN / 32; ++kb) {
            u32 flags[1][2][2];
            dropout.row_flags<1>(flags, rows, warp_row0, col0 + kb * 32, lane);
            Dropout::apply_a<1>(reinterpret_cast<u32(&)[1][4]>(p[2 * kb]), flags, 0);
            Dropout::apply_a<1>(reinterpret_cast<u32(&)[1][4]>(p[2 * kb + 1]), flags, 1);
        }
    }
};

}  // namespace fa2
