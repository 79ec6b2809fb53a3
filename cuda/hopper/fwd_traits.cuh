// The Hopper forward's compile-time configuration (HopperFwdTraits), the shared memory a block lays out (Q buffers,
// K and V rings, their mbarriers, the work items' words), the kernel arguments its parts read, and the diagnostics
// hook of bench/dev/hopper_trace.py.
#pragma once
#include "common/types.cuh"
#include "sm80/memory.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/tma.cuh"
#include "sm90/slabs.cuh"
#include "attention/masks.cuh"

namespace fa2 {

// Named barrier ids of the Hopper forward (0 is __syncthreads'): consumer warpgroup w waits for its turn to issue at
// kFwdTurn0 + w, where the warpgroup before it hands the turn on (kFwdTurnThreads: the two warpgroups' threads); the
// producer warpgroup's threads meet at the id after the last warpgroup's (HopperFwdTraits::kProducerBarrier).
enum HopperFwdBarrier : int { kFwdTurn0 = 1, kFwdTurn1 = 2, kFwdTurn2 = 3, kFwdTurnThreads = 256 };

template <int HeadDim, int BlockN, int KStages, int VStages, int QBuffers, int ConsumerWGs, class Elem_, int Mask,
          bool Varlen = false, bool Paged = false, bool Mods = false, bool AlibiOnly = false, int HeadDimV = HeadDim>
struct HopperFwdTraits {
    using Elem = Elem_;
    // Consumer warpgroups of 64 rows each, taking turns to issue: with three (d=64, where a tile's products are
    // half as long as at d=128 and its softmax as long, and 192 with v at 128, whose 64-key step is bound by each
    // warpgroup's own S, softmax and turn), each one's softmax runs under two others' products.
    static constexpr int kConsumerWGs = ConsumerWGs;
    static_assert(ConsumerWGs == 2 || ConsumerWGs == 3, "two or three consumer warpgroups");
    // K and V have rings of their own: a K slot goes back once S = Q K^T has landed, a V slot only after P V, a
    // step later, so V needs the deeper ring for the same lead.
    static constexpr int kHeadDim = HeadDim, kBlockM = 64 * ConsumerWGs, kBlockN = BlockN, kKStages = KStages,
                         kVStages = VStages, kMask = Mask;
    // HeadDimV: v's and the output's head dim where it is narrower than q's and k's (DeepSeek-V2/V3's prefill, q and
    // k at 192, v at 128): V's tiles, P V (a wgmma of N = HeadDimV) and O (HeadDimV / 2 registers a thread) at v's
    // width, S = Q K^T at the row's. Without modifiers, not paged (configs.FORWARD_HOPPER_V_TABLE). O's fewer
    // registers let three consumer warpgroups take turns, as at d = 64.
    static constexpr int kHeadDimV = HeadDimV;
    static_assert(HeadDimV == HeadDim || (HeadDimV % 64 == 0 && HeadDimV < HeadDim && !Mods && !Paged),
                  "v's own head dim: whole slabs, narrower than q's, without modifiers, not paged");
    // Varlen: sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q/o/lse and cu_seqlens_k[b] .. of k/v;
    // seqlen_q/seqlen_k are the maxima, and work items past a sequence's end are passed over.
    static constexpr bool kVarlen = Varlen;
    // Paged K/V (varlen only): k/v are (num_pages, page_size, nheads_kv, d), their batch strides the page strides,
    // and key j of sequence b is row j % page_size of page block_table[b][j / page_size]. Only the producer's
    // addresses differ: the tiles, and so the results, are those of packed K/V.
    static constexpr bool kPaged = Paged;
    static_assert(Varlen || !Paged, "paged K/V comes with varlen");
    // Mods: the scores go through the softcap and ALiBi (UnitScoreMods in masks.cuh; either may be off at run time)
    // before the mask, and dropout drops entries of P (either may be off at run time). (Shipped at
    // configs.HOPPER_MODS_HEADDIMS.)
    static constexpr bool kMods = Mods;
    // AlibiOnly (with Mods, padded calls without a mask or causal): the modifier kernel with only ALiBi's code in
    // it, for calls whose one modifier is ALiBi at a positive scale (forward.alibi_only_kernel): no softcap, no
    // dropout, one UnitScoreMods kind, 41-59% fewer instructions than the modifier kernel, whose softcap and
    // dropout paths sit beside ALiBi's. H200, bf16, 8k, in turns against it: ALiBi +4-7% at d = 64 and 256, +3%
    // at 128, level at 192 (docs/design.md).
    static constexpr bool kAlibiOnly = AlibiOnly;
    static_assert(!AlibiOnly || (Mods && !Varlen && Mask != kMaskWindow), "the ALiBi kernel: padded, no window");
    // Padded calls move their tiles with the tensor memory accelerator (tensor maps of q, k, v and o: one thread
    // issues a tile's copies, rows past the sequence read as zeros and are not written); varlen calls, whose
    // tiles end inside the packed arrays, so too for Q, whole output tiles and, with packed K/V, whole K/V tiles,
    // and the rest (a sequence's ragged tiles, paged K/V) with cp.async from all the producer's threads and their
    // stores.
    static constexpr bool kTma = !Varlen;
    // Arrivals a tile's copies make on its barrier: the first producer thread's (TMA), or every producer thread's
    // (varlen: their cp.async, or the first thread's for all with a whole tile's TMA copies).
    static constexpr int kProducerThreads = 128, kCopyArrivals = kTma ? 1 : kProducerThreads;
    // The consumer warpgroups and a producer warpgroup, whose registers go to the consumers (setmaxnreg).
    static constexpr int kConsumerWarps = 4 * ConsumerWGs, kThreads = 128 * (ConsumerWGs + 1);
    // (Three consumers at d = 64 need 160 each: at 152 ptxas serialised their wgmmas, S and P taking 96 of them.
    // 32 + 3 x 160 fills the register file.)
    // (The padded d = 256 modifier kernels' consumers spill at 224; their producer, one thread issuing TMA copies,
    // needs no more than 40. The varlen producer's copies spill at 40, so varlen d = 256 calls with modifiers run
    // on the mma.sync forward: configs.HOPPER_MODS_PADDED_ONLY.)
    static constexpr bool kWideMods = Mods && HeadDim == 256;
    static_assert(!kWideMods || !Varlen, "d = 256 with modifiers: padded calls only");
    // O rescaled only once a row's max has moved far (OnlineSoftmax::probabilities_lazy): H200, 8k, 16 heads of 128
    // (or 2048 / d), bf16, the plain kernels 2-3% faster at d = 128, 12-13% at 192, 17% at 256 (docs/design.md).
    // Not with modifiers at d = 64 and 128 (ALiBi 3-8% and dropout up to 6% slower with it, softcap no faster). (The
    // d = 256 window kernel with modifiers, which windowed modifier calls and non-causal ones with dropout run: 0.835
    // -> 0.99 of the plain call with none switched on, softcap 0.63 -> 0.67.)
    static constexpr bool kLazyRescale = !(Mods && HeadDim <= 128);
    // ALiBi on warp tiles that lie on one side of the diagonal as one FMA a score and a per-row bias to the softmax
    // (UnitScoreMods::apply, RowBias). Not in the d = 256 window kernel: it spilled 84 bytes at 232 registers; it
    // keeps two operations a score and the softmax without a bias (calls without a mask or dropout take the unmasked
    // kernel, which has both: forward.kernel_variant).
    static constexpr bool kAlibiRowBias = Mods && !(kWideMods && Mask == kMaskWindow);
    // With ALiBi, whose bias climbs tile by tile towards the diagonal and so moves the rows' maxima past the lazy
    // rescale's threshold at most steps, a row's reference max moves 2^kAlibiHeadroomLog2 past its new max (RowBias'
    // headroom): bf16 only, where P's exponent reaches as far as fp32's.
    static constexpr float kAlibiHeadroomLog2 = kAlibiRowBias && kLazyRescale && kWideExponent<Elem> ? 32.f : 0.f;
    // Softcap without ALiBi against a fixed reference max (OnlineSoftmax::probabilities_fixed): the logits lie in
    // (-softcap, softcap), so P = exp(logit) needs no row max for softcap <= kCapFixedMaxLimit: P within e^+-50,
    // where a bf16 P (fp32's exponent range) keeps its relative precision and its sums cannot overflow before
    // |v| times the row's keys reaches 6e16. bf16 only (an fp16 P would underflow). H200, 8k, in turns: softcap
    // 6% faster at d = 128, 10-12% at 192 and 256, 3% slower at 64 (whose modifier row keeps the running max).
    static constexpr bool kCapFixedMax = Mods && !AlibiOnly && kWideExponent<Elem> && HeadDim != 64;
    static constexpr float kCapFixedMaxLimit = 50.f;
    // Three consumer warpgroups at a narrower v (192 / 128: O 64 registers, S 32, P 16) give 152 each and the
    // producer 56: at 32 the varlen producer's three-pass copies spilled 20 bytes (the varlen window kernel's
    // consumers spill 12 at 152, so that kernel keeps two: configs.hopper_fwd_v_config).
    static constexpr bool kNarrowV = HeadDimV < HeadDim;
    static constexpr int kProducerRegisters = ConsumerWGs == 2 ? (kWideMods ? 40 : 56) : (kNarrowV ? 56 : 32),
                         kConsumerRegisters = ConsumerWGs == 2 ? (kWideMods ? 232 : 224) : (kNarrowV ? 152 : 160);
    // setmaxnreg.inc waits until the registers the producer gave back cover the increase, so the warpgroups'
    // counts may add up to no more than the launch gave them (65536 / kThreads a thread, in eights: 168 with two
    // consumers, 128 with three), or the consumers wait for ever.
    static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
    static_assert(kProducerRegisters + ConsumerWGs * kConsumerRegisters <= (ConsumerWGs + 1) * kLaunchRegisters,
                  "the registers of the launch");
    // Named barriers: the consumers' turns (HopperFwdBarrier), then the producer's own.
    static constexpr int kProducerBarrier = kFwdTurn0 + ConsumerWGs;
    using QTile = SwizzledSlabs<kBlockM, HeadDim>;
    // The output rows, staged in the item's Q buffer (its first HeadDimV / 64 slabs) and written out from there.
    using OTile = SwizzledSlabs<kBlockM, HeadDimV>;
    using KVTile = SwizzledSlabs<BlockN, HeadDim>;  // K's tiles (and V's at the row's head dim)
    using VTile = SwizzledSlabs<BlockN, HeadDimV>;
    // With two, the next item's Q loads while the consumers work on this one; with one, only once they have
    // issued this one's last S.
    static constexpr int kQBuffers = QBuffers;
    // full[] per K slot (a tile's K and V land together), k_empty[], v_empty[], q_full[], q_empty[].
    static constexpr int kBarriers = 2 * KStages + VStages + 2 * kQBuffers;
    // After the barriers: the work item of each Q buffer with its sequence's bounds and coordinates (producer ->
    // consumers: item, seqlen_q, seqlen_k, first query row, query tile, head, batch row, so that the consumers
    // work out none of them between items; the producer reads them again to write the item's output rows out)
    // and two words in which the producer's first thread hands the next item to the others.
    static constexpr int kSlotWords = 7, kItemSlots = kSlotWords * kQBuffers + 2;
    // 1 KB of slack: the swizzled slabs must start on 1024-byte boundaries.
    static constexpr int kSmemBytes =
        1024 + kQBuffers * QTile::kBytes + KStages * KVTile::kBytes + VStages * VTile::kBytes + 8 * kBarriers +
        4 * kItemSlots;
    // (192 and 256: P V on wgmma of N = HeadDimV, S = Q K^T in k16 steps over 3 or 4 slabs; O takes HeadDimV / 2
    // registers a thread, so a 192- or 256-wide O needs the two consumer warpgroups' 224)
    static_assert(HeadDim == 64 || HeadDim == 128 || HeadDim == 192 || HeadDim == 256,
                  "whole 64-column slabs, P V on wgmma of N = HeadDim");
    static_assert(HeadDimV <= 128 || ConsumerWGs == 2, "wide outputs on two consumer warpgroups");
    static_assert(kSmemBytes <= 227 * 1024, "the shared memory of one block");
    static_assert(BlockN == 64 || BlockN == 128, "S on wgmma of N = 64 or 128");
    static_assert(KStages >= 2 && VStages >= KStages, "V's ring at least as deep as K's, K's at least two");
};

// The t-th K/V tile a block handles (counted over all its items) sits in slot t % Slots of a ring, in the slot's
// (t / Slots)-th fill, whose parity is the mbarrier phase to wait for. (One count of tiles serves both rings, one
// of items the Q buffers.)
template <int Slots>
FA2_DEVICE int ring_slot(u32 t) {
    return t % Slots;
}
template <int Slots>
FA2_DEVICE u32 ring_phase(u32 t) {
    return (t / Slots) & 1;
}

// Diagnostics for bench/dev/hopper_trace.py: built with FA2_FWD_TRACE, lane 0 of warpgroup 0's and warpgroup 1's first
// warps and the producer's first thread record clock64 at numbered points of each of their block's first
// kTraceItems work items (the consumers count items they see, the producer items it loads; points 10 wg + 0..9 the
// consumers', 20..23 the producer's); otherwise the marks compile away.
#ifdef FA2_FWD_TRACE
constexpr int kTracePoints = 24, kTraceItems = 64, kTraceBlocks = 160;
extern "C" {
__device__ long long fa2_fwd_trace[kTraceBlocks * kTraceItems * kTracePoints];
}
FA2_DEVICE void fwd_mark(int point, int seq) {
    if (seq < kTraceItems && blockIdx.x < kTraceBlocks)
        fa2_fwd_trace[(blockIdx.x * kTraceItems + seq) * kTracePoints + point] = clock64();
}
#else
FA2_DEVICE void fwd_mark(int, int) {}
#endif

// The block's shared memory: the Q buffers, then K's and V's rings of tiles (swizzled slabs, 1024-byte aligned), then
// the barriers: full[s] (the K and V of the tile in K slot s landed: the producer's 128 threads' cp.async arrivals,
// or the first thread's arrival for all with the TMA copies' bytes expected; one wait per tile), k_empty[s] and
// v_empty[s] (the consumer warps are done with K slot s, V slot s), q_full[b] and q_empty[b] likewise for the Q
// buffers; then the words of the items (HopperFwdTraits::kItemSlots).
template <class Tr>
struct HopperFwdSmem {
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    using VTile = typename Tr::VTile;
    static constexpr int kKS = Tr::kKStages, kVS = Tr::kVStages;
    u32 q, k, v, bars;
    int* item_slots;

    FA2_DEVICE explicit HopperFwdSmem(unsigned char* raw) {
        q = (smem_u32(raw) + 1023) & ~1023u;
        k = q + Tr::kQBuffers * QTile::kBytes;
        v = k + kKS * KVTile::kBytes;
        bars = v + kVS * VTile::kBytes;
        item_slots = reinterpret_cast<int*>(raw + (bars + 8 * Tr::kBarriers - smem_u32(raw)));
    }
    FA2_DEVICE u32 full(int s) const { return bars + 8 * s; }
    FA2_DEVICE u32 k_empty(int s) const { return bars + 8 * (kKS + s); }
    FA2_DEVICE u32 v_empty(int s) const { return bars + 8 * (2 * kKS + s); }
    FA2_DEVICE u32 q_full(int b) const { return bars + 8 * (2 * kKS + kVS + b); }
    FA2_DEVICE u32 q_empty(int b) const { return bars + 8 * (2 * kKS + kVS + Tr::kQBuffers + b); }

    // By one thread, before the block's first barrier.
    FA2_DEVICE void init_barriers() const {
        for (int s = 0; s < kKS; ++s) {
            mbar_init(full(s), Tr::kCopyArrivals);
            mbar_init(k_empty(s), Tr::kConsumerWarps);
        }
        for (int s = 0; s < kVS; ++s) mbar_init(v_empty(s), Tr::kConsumerWarps);
        for (int b = 0; b < Tr::kQBuffers; ++b) {
            // the first producer thread's one arrival for its Q copies (their bytes expected) and the item it wrote
            // in item_slots[kSlotWords b ..]
            mbar_init(q_full(b), 1);
            mbar_init(q_empty(b), Tr::kConsumerWarps);
        }
    }
};

// The kernel arguments the producer and consumers read (flash_fwd_hopper's, restrict-qualified alike; the tensor maps
// by reference: the copies name a __grid_constant__ parameter by its address).
struct HopperFwdArgs {
    const u16* __restrict__ k;
    const u16* __restrict__ v;
    u16* __restrict__ o;
    float* __restrict__ lse;
    const int* __restrict__ cu_seqlens_q;
    const int* __restrict__ cu_seqlens_k;
    const int* __restrict__ block_table;
    i64 k_batch_stride;
    int k_row_stride;
    i64 k_head_stride;
    i64 v_batch_stride;
    int v_row_stride;
    i64 v_head_stride;
    i64 o_batch_stride;
    int o_row_stride;
    i64 o_head_stride;
    i64 lse_batch_stride, lse_head_stride;
    int seqlen_q, seqlen_k, nheads, heads_per_kv, window_left, window_right;
    float scale, scale_log2;
    int total_q, total_k, page_size;
    u32 page_magic;
    int page_shift, max_pages, num_pages;
    int* error_claim;
    long long* error_host;
    int* __restrict__ tile_counter;
    const TensorMap& tmap_q;
    const TensorMap& tmap_k;
    const TensorMap& tmap_v;
    const TensorMap& tmap_o;
    float softcap;                           // Mods: 0 for none
    UnitModsConstants mods;                  // Mods: softcap and ALiBi's call constants
    const float* __restrict__ alibi_slopes;  // Mods: null for none
    int alibi_batch_stride;
    int headdim;  // the arrays' own, which the columns copied and written stop at (the kernel's may be wider)
    int headdim_v;  // v's and o's own (varlen: the ragged V copies and output rows stop at it)
    // Mods: dropout's seed and offset (or rng_state, in device memory), its threshold (0: none) and scale
    const u32* rng_state;
    u64 seed, offset;
    u32 dropout_threshold;
    float dropout_scale;
};

}  // namespace fa2
