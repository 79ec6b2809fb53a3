// The Hopper backward's compile-time configuration (HopperBwdTraits), the shared memory a block lays out (K and V,
// the rings of Q, dO and their row statistics, dS^T, the dQ staging tiles and the barriers), the kernel arguments its
// parts read, and the diagnostics hook of bench/dev/bwd_trace.py.
#pragma once
#include "common/types.cuh"
#include "common/clock.cuh"
#include "sm80/memory.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/tma.cuh"
#include "sm90/slabs.cuh"

namespace fa2 {

// Named barrier ids of the Hopper backward (0 is __syncthreads'): the consumer warpgroups meet at kBwdConsumers (with
// dQ_i split by keys each warpgroup alone, at kBwdConsumers + its index), and at kBwdDqHandoff once warpgroup 0's
// part of a staged dQ_i is in, for warpgroup 1 to add its own. At the wide head dims warpgroup 1 waits at
// kBwdPReady for warpgroup 0's P^T of the step.
enum HopperBwdBarrier : int { kBwdConsumers = 1, kBwdDqHandoff = 3, kBwdPReady = 4 };

template <int HeadDim, int BlockM, int Stages, bool DqByKeys, class Elem_, int Mask, bool Varlen = false,
          bool Mods = false, int ScoreDim = HeadDim, bool AlibiOnly = false, int VDim = HeadDim>
struct HopperBwdTraits {
    using Elem = Elem_;
    // The head dim the score products S^T = K Q^T and dP^T = V dO^T run over: a call whose arrays are narrower than
    // HeadDim (80 or 96 on the 128 row, 160 on the 192 row: configs.hopper_bwd_score_dim) has zeros in every tile
    // column past its own head dim, so their k16 steps add nothing and are left out (the other products keep the
    // row's width: their head dim is wgmma's N, which the layouts of dK, dV and dQ_i are built on).
    static constexpr int kScoreDim = ScoreDim, kScoreKSteps = ScoreDim / 16;
    static_assert(ScoreDim % 16 == 0 && ScoreDim <= HeadDim && ScoreDim > HeadDim - 64,
                  "the score products' head dim: k16 steps within the row's last 64-column slab");
    // v's head dim, where it is narrower than q's and k's (a wide row's calls without modifiers: configs.
    // HOPPER_BWD_V_DIMS): V and dO have zeros in every tile column past it, so dP^T = V dO^T leaves their k16 steps
    // out and dV += P^T dO runs at N = VDim; dV is written at VDim columns (the rest of dv's row is not written).
    static constexpr int kVDim = VDim, kVKSteps = (VDim < ScoreDim ? VDim : ScoreDim) / 16;
    static_assert(VDim == HeadDim || (HeadDim > 128 && VDim % 64 == 0 && VDim < HeadDim && !Mods),
                  "v's own head dim: whole 64-column slabs, on a wide row's kernel without modifiers");
    // Wide head dims (192, 256): 64 keys a block, both consumer warpgroups on the same keys (consume_dkdv_wide):
    // warpgroup 0 computes S^T, P^T and dV, warpgroup 1 dP^T, dS^T (P^T handed over in shared memory) and dK, so
    // that each holds one 64 x HeadDim accumulator (HeadDim / 2 registers a thread); dQ_i by columns, warpgroup 0
    // columns 0-127 and warpgroup 1 the rest.
    static constexpr bool kWide = HeadDim > 128;
    static constexpr int kHeadDim = HeadDim, kBlockM = BlockM, kBlockN = kWide ? 64 : 128, kStages = Stages,
                         kMask = Mask;
    // dQ_i split by keys (each warpgroup all columns over its 64 keys) or by columns (half of them over all keys).
    static constexpr bool kDqByKeys = DqByKeys;
    // Varlen: sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q/dO/lse/dQ and cu_seqlens_k[b] .. of
    // k/v/dK/dV; seqlen_q/seqlen_k are the maxima, and key blocks past a sequence's end return at once.
    static constexpr bool kVarlen = Varlen;
    // Score modifiers (softcap, ALiBi: ScoreMods in attention/masks.cuh) applied to S^T, the softcap's derivative to
    // dS^T (scores_to_ds_mods in hopper/bwd_consumer.cuh, wide_p_mods in hopper/bwd_consumer_wide.cuh): every head
    // dim but varlen 128, the window-mask variant (which expresses every mask), run-time values.
    static constexpr bool kMods = Mods;
    // AlibiOnly (with Mods, padded calls): the modifier kernel with only ALiBi's code in it, for calls whose one
    // modifier is ALiBi (forward.alibi_only_kernel, KernelOptions.hopper_alibi_only): one case of with_step_case, no
    // dropout (kDropout: no keep flags drawn or read), about half the modifier kernel's instructions. H200, bf16,
    // in turns against it: ALiBi d = 128 +6% causal and +5% non-causal at 8k, +2-3% at 64, 192 and 256
    // (docs/design.md).
    static constexpr bool kAlibiOnly = AlibiOnly;
    static_assert(!AlibiOnly || (Mods && !Varlen), "the ALiBi-only kernel: padded calls with modifiers");
    // Padded calls move K, V, Q and dO with the tensor memory accelerator (tensor maps, one producer thread issuing
    // the copies; rows past the sequence read as zeros). Varlen calls move whole tiles of a sequence so too, and a
    // sequence's last, ragged tile with every producer thread's cp.async, whose zeros past its rows keep another
    // sequence's rows (which may hold anything) out of the products.
    static constexpr bool kTma = !Varlen;
    // Deterministic calls add each step's dQ from producer threads of their own (produce_dkdv: warp 3's first, or
    // warps 2 and 3's at the wide head dims) where the kernel can spare them: padded kernels, varlen ones without
    // modifiers, and varlen modifier ones of 64 query rows a step but the d = 256 row (kOwnReducers: its 56-register
    // producer spilled 20 bytes with them), in calls that draw no dropout flags (warps 1-3 draw them). Other
    // deterministic calls add from the first producer thread, between its loads.
    static constexpr bool kOwnReducers = kTma || !Mods || (BlockM == 64 && HeadDim != 256);
    // At the wide head dims, with reducers of their own: a step's dQ reduction in two halves of its rows, each
    // issued by one of those threads and taking turns on flags of its own (a plane of the call's flags each), so
    // that the next key tile's block may add the first half while this block's second is still in flight. (The
    // first thread adds whole rows on plane 0's flags.)
    static constexpr int kTurnPlanes = kWide ? 2 : 1;
    // Calls without a mask may rotate their walks (BwdHopperParams::dq_rotate, HopperBwdSteps): the
    // kernels without a mask, and the padded modifier kernels, which run such calls on the window mask, unlimited
    // both ways (their walks then cover every query tile from the first). Not the varlen modifier kernels (their
    // producers spilled 16-20 bytes at head dim 64).
    static constexpr bool kRotates = Mask == kMaskNone || (Mask == kMaskWindow && Mods && !Varlen);
    // Two consumer warpgroups and a producer warpgroup, whose registers go to the consumers (setmaxnreg): a
    // consumer holds dK and dV (64 keys x the head dim each) and S^T, dP^T (64 x BlockM) at once.
    static constexpr int kConsumerWarps = 8, kConsumerThreads = 256, kProducerThreads = 128, kThreads = 384;
    // Arrivals a tile's copies make on its barrier: the first producer thread's (TMA), or every producer thread's
    // (varlen: their cp.async, or the first thread's for all with a whole tile's TMA copies).
    static constexpr int kCopyArrivals = kTma ? 1 : kProducerThreads;
    // (By keys, with 128 query rows a step, the consumers need 232: the producer then works in 40.)
    // Wide: padded 24 and 240 (at 40 and 232 the head dim 256 consumers spilled 24 bytes); varlen, whose producer
    // copies ragged tiles by cp.async (at 24 it spilled 88-104 bytes), 72 and 216 (at 56 and 224 the deterministic
    // mode's two reducing threads and split copies spilled 16-68 bytes; at 40 and 232 head dim 256 with dQ_i 64
    // columns a wgmma spilled 12 bytes), with modifiers 56 and 224 (at 72 and 216 its consumers spilled 8 bytes).
    static constexpr int kWideProducerRegisters = !Varlen ? 24 : Mods ? 56 : 72;
    // With score modifiers at head dim 128 (padded: TMA copies) 24 and 240: at 56 / 224 the consumers spilled 4 bytes,
    // at 40 / 232 ptxas serialised the bf16 row's wgmmas (C7512); the varlen producer spills at 24 (72 bytes), so that
    // row is not built (configs.HOPPER_BWD_MODS_PADDED_ONLY).
    static constexpr int kProducerRegisters = kWide ? kWideProducerRegisters : DqByKeys ? 40 : Mods ? 24 : 56,
                         kConsumerRegisters = kWide      ? (504 - kWideProducerRegisters) / 2
                                              : DqByKeys ? 232
                                              : Mods     ? 240
                                                         : 224;
    static_assert(kProducerRegisters + 2 * kConsumerRegisters <= 3 * 168, "the register file of one block");
    using KVTile = SwizzledSlabs<kBlockN, HeadDim>;
    using QTile = SwizzledSlabs<kBlockM, HeadDim>;   // Q and dO
    using DsTile = SwizzledSlabs<kBlockN, kBlockM>;  // dS^T, keys x queries: dQ's A operand read MN-major
    // Each warpgroup's share of dQ_i: its columns and keys. By columns, with HeadDim 128, one 64-column slab of K.
    // Wide: warpgroup 0's columns (128; warpgroup 1's are kDqCols1, the rest) over all 64 keys.
    static constexpr int kDqCols = kWide ? 128 : DqByKeys ? HeadDim : HeadDim / 2,
                         kDqKeys = DqByKeys ? kBlockN / 2 : kBlockN, kDqCols1 = kWide ? HeadDim - 128 : kDqCols;
    // The fp32 dQ tile staged for the bulk reduction, one row per query, padded (8 floats: rows on 32-byte
    // sectors, and the staging stores 2 wavefronts a warp as with 4) against bank conflicts; the accumulator's rows
    // have the same pitch (kDqPitch floats, the pad never read), so that one operation adds the whole step. By keys
    // a pair, by the step's parity, so that warpgroup 0 stores the next step's part while this one's is reduced (by
    // columns one tile, which both warpgroups wait for: a second does not fit beside the rest at head dim 128).
    static constexpr int kDqPitch = HeadDim + 8, kDqBytes = kBlockM * kDqPitch * 4, kDqTiles = DqByKeys ? 2 : 1;
    // A call narrower than the row (args.dq_by_map) sends a whole query tile's staged dQ_i out by one tensor
    // reduction through a map of the accumulator that spans the arrays' head dim (args.tmap_dq): the columns past
    // it, zeros, are clipped and never reach L2 (at d = 80 on this row 80 of 136 floats a row). A call at the row's
    // width adds whole rows by one bulk reduction: through the map it ran 0-2% slower. A box has at most 256
    // columns, so not at head dim 256 (pitch 264); a sequence's last, ragged tile goes out by the bulk reduction
    // too; and so does every tile of the varlen modifier row at 64, which spilled 16 bytes with the map's.
    static constexpr bool kDqReduceByMap = kDqPitch <= 256 && !(Varlen && Mods && DqByKeys);
    // dS^T: by columns double-buffered, so a warpgroup writes the next one while the other may still read this
    // one; by keys each warpgroup reads only its own rows, after its own wait.
    // Wide: one, which only warpgroup 1 writes, after the kBwdPReady barrier that warpgroup 0 reaches once its
    // reads of the last one are over.
    static constexpr int kDsTiles = DqByKeys || kWide ? 1 : 2;
    // Wide: warpgroup 0's fp32 P^T of the step for warpgroup 1 (each thread's 32 scores, the C-fragment layout of
    // both warpgroups alike), kM x kBlockN floats; none otherwise.
    static constexpr int kPxBytes = kWide ? BlockM * kBlockN * 4 : 0;
    // Mods: dropout's keep flags of each step, drawn by the producer warpgroup (its threads are otherwise idle, and
    // the consumers have no registers for Philox: drawn there, every modifier row spilled 16-44 bytes), one bit per
    // score of the threads that form P^T (kDropThreads: all 256, or warpgroup 0's 128 at the wide head dims), a
    // 16-bit entry per pair of them (lane l of warps 2 k and 2 k + 1) for each 32-query block and query parity:
    // kDropPairBytes a pair (draw_drop_flags in hopper/bwd_producer.cuh, DropBits in hopper/bwd_consumer.cuh).
    // Not by keys (head dim 64, 128 query rows a step): there the consumers spilled 4-64 bytes however they took the
    // flags, so dropout at 64 runs on the mma.sync backward (configs.hopper_bwd_takes_mods).
    static constexpr bool kDropout = Mods && !DqByKeys && !AlibiOnly;
    // Whether a call's dQ reductions run on the reducers of their own (kOwnReducers above).
    FA2_DEVICE static bool own_reducers(bool deterministic, u32 dropout_threshold) {
        return kOwnReducers && deterministic && (!kDropout || dropout_threshold == 0);
    }
    static constexpr int kDropThreads = kWide ? 128 : 256, kDropPairBytes = BlockM / 8;
    static constexpr int kDropKeys = kDropThreads / 8;  // (the keys of those threads: 32, or 16 at the wide head dims)
    static constexpr int kDropSlotBytes = kDropout ? kDropThreads / 2 * kDropPairBytes : 0;
    // (and 32 bytes of each producer thread's own, draw_drop_flags')
    static constexpr int kDropScratchBytes = kDropout ? 32 * kProducerThreads : 0;
    // kv_full, then full[] and empty[] per ring slot, then dq_staged[] and dq_free[] per staging tile (the
    // consumers hand the staged dQ_i to the producer, which issues its reduction and hands the tile back once
    // it has read it; a pair by keys, as a tile's barriers may then not run a phase ahead of the other's).
    static constexpr int kBarriers = 1 + 2 * Stages + 2 * kDqTiles;
    // 1 KB of slack: the swizzled slabs start on 1024-byte boundaries.
    static constexpr int kSmemBytes = 1024 + 2 * KVTile::kBytes + 2 * Stages * QTile::kBytes +
                                      kDsTiles * DsTile::kBytes + kDqTiles * kDqBytes + kPxBytes +
                                      2 * Stages * kBlockM * 4 + Stages * kDropSlotBytes + kDropScratchBytes +
                                      8 * kBarriers + 8;
    static_assert(kDqCols % 64 == 0 && kDqCols1 % 64 == 0, "each warpgroup's dQ columns are whole 64-column slabs");
    static_assert(!kWide || (BlockM == 64 && !DqByKeys && (HeadDim == 192 || HeadDim == 256)),
                  "the wide head dims: 64 query rows a step, dQ_i by columns");
    static_assert(kSmemBytes <= 227 * 1024, "the shared memory of one block");
    static_assert(!Mods || (Mask == kMaskWindow && !(Varlen && HeadDim == 128)),
                  "score modifiers: the window variant, not varlen at head dim 128");
    // 128 query rows per step (dQ_i in two wgmma row halves) only by keys: by columns the accumulators do not fit.
    static_assert(BlockM == 64 || (BlockM == 128 && DqByKeys), "64 query rows per step, or 128 with dQ by keys");
    // (At head dim 256 a second slot does not fit beside K, V and the dQ staging tile.)
    static_assert(Stages >= 2 || kWide, "a ring of at least two query tiles");
};

// Diagnostics for bench/dev/bwd_trace.py: built with FA2_BWD_TRACE, thread 0 of the block, of the consumers and of the
// producer record clock64 (and the SM) at numbered points of each of the first kBwdTraceBlocks blocks; otherwise
// the marks compile away.
#ifdef FA2_BWD_TRACE
constexpr int kBwdTracePoints = 8, kBwdTraceBlocks = 16384;
extern "C" {
__device__ long long fa2_bwd_trace[kBwdTraceBlocks * kBwdTracePoints];
}
FA2_DEVICE void bwd_mark(int point) {
    const u32 block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (block >= kBwdTraceBlocks) return;
    fa2_bwd_trace[block * kBwdTracePoints + point] = clock64();
    if (point == 0) {  // and the SM, at point 7
        fa2_bwd_trace[block * kBwdTracePoints + 7] = sm_id();
    }
}
#else
FA2_DEVICE void bwd_mark(int) {}
#endif

// The block's shared memory: K and V (swizzled slabs, 1024-byte aligned), kS slots of Q and of dO, the dS^T tiles,
// the fp32 dQ staging tiles, at the wide head dims the P^T hand-over (kPxBytes), the row statistics (lse in the log2
// domain [kS][kM], then D [kS][kM]), with modifiers dropout's keep flags [kS][kDropThreads / 2][kDropPairBytes] and the
// producer threads' 32 bytes each (draw_drop_flags), the barriers, and the producer's first thread's 8 bytes
// (reduce_step's two steps not yet counted, kept here: in registers across the walk, the producers spilled).
// kv_full: K and V landed (128 cp.async arrivals, or with TMA the first thread's arrival, for all 128 in varlen, and
// the copies' bytes); full[s]: Q and dO landed in slot s (likewise) and its lse and D are stored (kM arrivals; with
// modifiers every producer thread's, its dropout flags stored too);
// empty[s]: the 256 consumer threads are done with slot s (each arrives for its own reads of lse and D: one arrival
// per warp after __syncwarp left racecheck a hazard between the other lanes' reads and the producer's next stores);
// dq_staged[t]: the warps that store the last of dQ_i (by keys warpgroup 1's, adding to warpgroup 0's part) are done
// with staging tile t; dq_free[t]: the producer's reduction has read it.
template <class Tr>
struct HopperBwdSmem {
    using KVTile = typename Tr::KVTile;
    using QTile = typename Tr::QTile;
    using DsTile = typename Tr::DsTile;
    static constexpr int kM = Tr::kBlockM, kS = Tr::kStages;
    u32 k, v, q, dout, ds, dq, bars, kv_full, drop;
    float* stats;

    FA2_DEVICE explicit HopperBwdSmem(unsigned char* raw) {
        k = (smem_u32(raw) + 1023) & ~1023u;
        v = k + KVTile::kBytes;
        q = v + KVTile::kBytes;                              // kS tiles
        dout = q + kS * QTile::kBytes;                       // kS tiles
        ds = dout + kS * QTile::kBytes;                      // kDsTiles tiles
        dq = ds + Tr::kDsTiles * DsTile::kBytes;             // fp32 staging, kDqTiles tiles
        // (wide: P^T's kPxBytes, then) lse [kS][kM], then D [kS][kM]
        const u32 stats_at = dq + Tr::kDqTiles * Tr::kDqBytes + Tr::kPxBytes;
        drop = stats_at + 2 * kS * kM * 4;
        bars = drop + kS * Tr::kDropSlotBytes + Tr::kDropScratchBytes;
        stats = reinterpret_cast<float*>(raw + (stats_at - smem_u32(raw)));
        kv_full = bars;
    }
    FA2_DEVICE u32 full(int s) const { return bars + 8 * (1 + s); }
    FA2_DEVICE u32 empty(int s) const { return bars + 8 * (1 + kS + s); }
    FA2_DEVICE u32 dq_staged(int t) const { return bars + 8 * (1 + 2 * kS + t); }
    FA2_DEVICE u32 dq_free(int t) const { return bars + 8 * (1 + 2 * kS + Tr::kDqTiles + t); }
    FA2_DEVICE u32 uncounted() const { return bars + 8 * Tr::kBarriers; }

    // By one thread, before the block's first barrier (`own_reducers`: Tr::own_reducers, dq_free then takes an
    // arrival from each of the kTurnPlanes reducing threads, and a modifier kernel's full[] with 64 query rows a step
    // none from warps 2 and 3, which leave the walk to reduce).
    FA2_DEVICE void init_barriers(bool own_reducers) const {
        mbar_init(kv_full, Tr::kCopyArrivals);
        for (int s = 0; s < kS; ++s) {
            // (the statistics' arrivals: every producer thread's with modifiers, but for warps 2 and 3 when they
            // reduce at 64 query rows a step; else the kM threads' that store them)
            const int stats = Tr::kMods ? Tr::kProducerThreads - (own_reducers && kM == 64 ? 64 : 0) : kM;
            mbar_init(full(s), Tr::kCopyArrivals + stats);
            mbar_init(empty(s), Tr::kConsumerThreads);
        }
        for (int t = 0; t < Tr::kDqTiles; ++t) {
            mbar_init(dq_staged(t), Tr::kDqByKeys ? Tr::kConsumerWarps / 2 : Tr::kConsumerWarps);
            mbar_init(dq_free(t), own_reducers ? Tr::kTurnPlanes : 1);
        }
    }
};

// The kernel arguments the producer and consumers read (bwd_dkdv_hopper's, restrict-qualified alike; a varlen
// sequence's lengths in place of the maxima; the tensor maps by reference: the copies name a __grid_constant__
// parameter by its address).
struct HopperBwdArgs {
    const u16* __restrict__ q;
    const u16* __restrict__ k;
    const u16* __restrict__ v;
    const u16* __restrict__ dout;
    const float* __restrict__ lse;
    const float* __restrict__ dsum;
    float* __restrict__ dq_accum;
    u16* __restrict__ dk;
    u16* __restrict__ dv;
    i64 q_batch_stride;
    int q_row_stride;
    i64 q_head_stride, k_batch_stride;
    int k_row_stride;
    i64 k_head_stride, v_batch_stride;
    int v_row_stride;
    i64 v_head_stride, do_batch_stride;
    int do_row_stride;
    i64 do_head_stride, dk_batch_stride;
    int dk_row_stride;
    i64 dk_head_stride, dv_batch_stride;
    int dv_row_stride;
    i64 dv_head_stride, stat_batch_stride, stat_head_stride;
    const int& seqlen_q;  // (the kernel's, a varlen sequence's lengths once its bounds are read)
    const int& seqlen_k;
    int heads_per_kv;
    float scale, scale_log2;
    const TensorMap& tmap_q;
    const TensorMap& tmap_k;
    const TensorMap& tmap_v;
    const TensorMap& tmap_do;
    const TensorMap& tmap_dq;  // (kDqReduceByMap: dq_accum's first `headdim` columns)
    bool dq_by_map;            // (whole query tiles' dQ_i through tmap_dq: configs.HopperBwdConfig.dq_by_map)
    // This batch row's ints, one per (head, query tile of BlockM rows), of sem_tiles per head, which count the
    // tile's completed additions (else null): turn flags when deterministic (with kTurnPlanes planes of the call's
    // flags, plane p gridDim.z * nheads * sem_tiles ints on), else read by bwd_convert_dq, which converts each tile
    // once its count is complete (BwdParams::dq_arrivals).
    int* dq_semaphore;
    int sem_tiles;
    bool deterministic;
    // Score modifiers (kMods): the softcap (0: none) and the ALiBi slopes (null: none) of (batch, query head).
    float softcap;
    const float* alibi_slopes;
    int alibi_batch_stride;
    // The arrays' head dim: kHeadDim, or less where the kernel runs wider than the arrays (padded calls: TMA reads
    // zeros past it), and dK and dV have no columns past it to write.
    int headdim;
    int headdim_v;  // v's and dO's own (varlen: their ragged copies stop at it)
    // Mods: dropout's seed and offset (or rng_state, in device memory), its threshold (0: none) and scale, and the
    // query heads (a step's Philox counter holds batch * nheads + head).
    const u32* rng_state;
    u64 seed, offset;
    u32 dropout_threshold;
    float dropout_scale;
    int nheads;
};

// A block's steps: every query head of its group in turn, each over the query tiles with a row that sees one of the
// block's keys (m_count of them from tile m_begin), from tile m_begin + m_shift round to the one before it.
template <int BlockM>
struct HopperBwdSteps {
    int m_begin, m_count, count, m_shift;  // (m_shift: rotated_start's where the walks rotate, else 0)
    // Step j's first query row (the producer's loads walk them in order instead, a division per step fewer).
    FA2_DEVICE int m0(int j) const { return (m_begin + (j + m_shift) % m_count) * BlockM; }
    FA2_DEVICE int first_m0() const { return (m_begin + m_shift) * BlockM; }
};

// The backward's walks without a mask (BwdHopperParams::dq_rotate: deterministic ones where every block of a
// (kv head, batch) group is on the GPU at once), where the query tiles are at least as many as the key tiles: key
// tile n of key_tiles starts at query tile n m_count / key_tiles and wraps round, so that at every step the group's
// blocks add to different query tiles. (Deterministic, walking from the same tile, they all reach it together and
// take their turns there, each a reduction behind the one before, and the staircase costs the start of every
// block: 20% at 2k tokens. Not deterministic, they would all add to the same tile at once.)
FA2_DEVICE int rotated_start(int n, int key_tiles, int m_count) { return n * m_count / key_tiles; }
// Key tile n's turn at query tile m of such walks, its own walk starting at tile `start` (rotated_start): the key
// tiles whose walks reach m before its own, those whose starts lie in (start, m] round the cycle (starts rise with
// n, one tile apart at least).
FA2_DEVICE int rotated_turn(int n, int key_tiles, int m_count, int start, int m) {
    // key tiles starting at or before m: start(n') <= m  <=>  n' < (m + 1) key_tiles / m_count
    const int upto = min(key_tiles, ((m + 1) * key_tiles + m_count - 1) / m_count);
    return m >= start ? upto - n - 1 : key_tiles - 1 - n + upto;
}

}  // namespace fa2
