// FlashAttention forward for Hopper (sm_90a): wgmma tensor cores, warp-specialised, persistent.
//
// A block is a producer warpgroup and two or three consumer warpgroups. The producer streams each work item's Q tile
// (64 rows per consumer warpgroup) and its K/V tiles into shared memory and announces each on an mbarrier: padded
// calls through tensor maps (TMA), one thread issuing every copy; varlen calls so too for Q and, with packed K/V, a
// sequence's whole K/V tiles, and with every producer thread's cp.async for the rest. Each consumer warpgroup owns
// 64 of the rows and runs FA2's loop on them (S = Q K^T and O += P V on wgmma, the online softmax in registers, only
// the log-sum-exp kept).
// The warpgroups never meet at a block barrier, only at the slots they hand back (an mbarrier per slot), so a
// warpgroup passes over the key tiles its own rows cannot see (the causal diagonal, the edges of a sliding window)
// while the others compute. Blocks are persistent: one per SM walks the work items (query tile, head, batch), longest
// first within groups of heads that share L2, and the producer loads the next item's Q (a second Q buffer) and first
// tiles while the consumers work on this one. K and V have rings of their own, V's deeper: a K slot goes back once S
// has landed, a V slot a step later. A warpgroup puts its output rows into its rows of the item's Q buffer
// (stmatrix) and goes on; the producer writes them out (a whole tile: a TMA store) before it loads another Q there,
// so the row write is off the warpgroups' turns. Items go in a grid stride or, where their lengths differ (masks), to
// whichever block asks next (an atomic tile counter, zeroed per launch): a fixed stride handed some SMs twice the
// keys of others under a causal mask.
//
// Same arguments as flash_fwd (cuda/fwd.cu) plus the batch size, the heads per L2 group, the tile counter (null
// for the grid stride) and the tensor maps of q, k, v and o (fa2cupy/tensor_maps.py; paged calls have no K or V
// map), so one launch plan serves both; padded and varlen calls without modifiers, varlen with paged
// K/V too (softcap, ALiBi and dropout stay on flash_fwd).
#include "common/types.cuh"
#include "common/hints.cuh"
#include "common/warp.cuh"
#include "sm80/memory.cuh"
#include "sm80/mma.cuh"
#include "sm80/tile_mma.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/warpgroup.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"
#include "sm90/slabs.cuh"
#include "attention/softmax.cuh"
#include "attention/masks.cuh"

namespace fa2 {

// Named barrier ids of the Hopper forward (0 is __syncthreads'): consumer warpgroup w waits for its turn to issue at
// kFwdTurn0 + w, where the warpgroup before it hands the turn on (kFwdTurnThreads: the two warpgroups' threads); the
// producer warpgroup's threads meet at the id after the last warpgroup's (HopperFwdTraits::kProducerBarrier).
enum HopperFwdBarrier : int { kFwdTurn0 = 1, kFwdTurn1 = 2, kFwdTurn2 = 3, kFwdTurnThreads = 256 };

template <int HeadDim, int BlockN, int KStages, int VStages, int QBuffers, int ConsumerWGs, class Elem_, int Mask,
          bool Varlen = false, bool Paged = false>
struct HopperFwdTraits {
    using Elem = Elem_;
    // Consumer warpgroups of 64 rows each, taking turns to issue: with three (d=64, where a tile's products are
    // half as long as at d=128 and its softmax as long), each one's softmax runs under two others' products.
    static constexpr int kConsumerWGs = ConsumerWGs;
    static_assert(ConsumerWGs == 2 || ConsumerWGs == 3, "two or three consumer warpgroups");
    // K and V have rings of their own: a K slot goes back once S = Q K^T has landed, a V slot only after P V, a
    // step later, so V needs the deeper ring for the same lead.
    static constexpr int kHeadDim = HeadDim, kBlockM = 64 * ConsumerWGs, kBlockN = BlockN, kKStages = KStages,
                         kVStages = VStages, kMask = Mask;
    // Varlen: sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q/o/lse and cu_seqlens_k[b] .. of k/v;
    // seqlen_q/seqlen_k are the maxima, and work items past a sequence's end are passed over.
    static constexpr bool kVarlen = Varlen;
    // Paged K/V (varlen only): k/v are (num_pages, page_size, nheads_kv, d), their batch strides the page strides,
    // and key j of sequence b is row j % page_size of page block_table[b][j / page_size]. Only the producer's
    // addresses differ: the tiles, and so the results, are those of packed K/V.
    static constexpr bool kPaged = Paged;
    static_assert(Varlen || !Paged, "paged K/V comes with varlen");
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
    // (Three consumers need 160 each: at 152 ptxas serialised their wgmmas. 32 + 3 x 160 fills the register file.)
    static constexpr int kProducerRegisters = ConsumerWGs == 2 ? 56 : 32,
                         kConsumerRegisters = ConsumerWGs == 2 ? 224 : 160;
    static_assert(kProducerRegisters + ConsumerWGs * kConsumerRegisters <= 65536 / 128,
                  "the register file of one block");
    // Named barriers: the consumers' turns (HopperFwdBarrier), then the producer's own.
    static constexpr int kProducerBarrier = kFwdTurn0 + ConsumerWGs;
    using QTile = SwizzledSlabs<kBlockM, HeadDim>;
    using KVTile = SwizzledSlabs<BlockN, HeadDim>;
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
        1024 + kQBuffers * QTile::kBytes + (KStages + VStages) * KVTile::kBytes + 8 * kBarriers + 4 * kItemSlots;
    static_assert(HeadDim == 64 || HeadDim == 128, "wgmma tiles of N = 64 or 128");
    static_assert(BlockN == 64 || BlockN == 128, "wgmma tiles of N = 64 or 128");
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

// Diagnostics for bench/hopper_trace.py: built with FA2_FWD_TRACE, lane 0 of warpgroup 0's and warpgroup 1's first
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

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_fwd_hopper(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                     u16* __restrict__ o, float* __restrict__ lse, const int* __restrict__ cu_seqlens_q,
                     const int* __restrict__ cu_seqlens_k, const float* __restrict__, const u32* __restrict__,
                     const int* __restrict__ block_table, i64 q_batch_stride,
                     int q_row_stride, i64 q_head_stride, i64 k_batch_stride, int k_row_stride, i64 k_head_stride,
                     i64 v_batch_stride, int v_row_stride, i64 v_head_stride, i64 o_batch_stride, int o_row_stride,
                     i64 o_head_stride, i64 lse_batch_stride, i64 lse_head_stride, int seqlen_q, int seqlen_k,
                     int nheads, int heads_per_kv, int, int window_left, int window_right, float scale,
                     float scale_log2, float, int, u32, u32, u32, u32, u32, float, int total_q, int total_k,
                     int page_size, u32 page_magic, int page_shift, int max_pages, int num_pages, int* error_claim,
                     long long* error_host, int batch, int heads_per_group,
                     int* __restrict__ tile_counter, const __grid_constant__ TensorMap tmap_q,
                     const __grid_constant__ TensorMap tmap_k, const __grid_constant__ TensorMap tmap_v,
                     const __grid_constant__ TensorMap tmap_o) {
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    using Elem = typename Tr::Elem;
    constexpr int kNT = Tr::kBlockN / 8, kDT = Tr::kHeadDim / 8, kKSteps = Tr::kHeadDim / 16;
    constexpr int kKS = Tr::kKStages, kVS = Tr::kVStages;

    extern __shared__ unsigned char smem_raw[];
    const u32 smem_q = (smem_u32(smem_raw) + 1023) & ~1023u;
    const u32 smem_k = smem_q + Tr::kQBuffers * QTile::kBytes;
    const u32 smem_v = smem_k + kKS * KVTile::kBytes;
    // Barriers: full[s] (the K and V of the tile in K slot s landed: the producer's 128 threads' cp.async arrivals,
    // or the first thread's arrival for all with the TMA copies' bytes expected; one wait per tile),
    // k_empty[s] and v_empty[s] (the 8 consumer warps are done with K slot s, V slot s), q_full[b] and q_empty[b]
    // likewise for the Q buffers.
    const u32 bars = smem_v + kVS * KVTile::kBytes;
    const auto full = [&](int s) { return bars + 8 * s; };
    const auto k_empty = [&](int s) { return bars + 8 * (kKS + s); };
    const auto v_empty = [&](int s) { return bars + 8 * (2 * kKS + s); };
    const auto q_full = [&](int b) { return bars + 8 * (2 * kKS + kVS + b); };
    const auto q_empty = [&](int b) { return bars + 8 * (2 * kKS + kVS + Tr::kQBuffers + b); };
    int* const item_slots = reinterpret_cast<int*>(smem_raw + (bars + 8 * Tr::kBarriers - smem_u32(smem_raw)));
    if (threadIdx.x == 0) {
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
    __syncthreads();

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int m_blocks = (seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
    const int heads = nheads * batch, items = m_blocks * heads;
    // Work item -> (query tile, head, batch row). The (batch row, head) pairs go in groups of heads_per_group
    // whose K/V fit in L2 together, so that the blocks at work at any time share them (all heads at once
    // overflowed it: 60% hits at 32 x 4 MB); within a group the last query tiles of every head first, as under
    // a causal mask they see the most keys (with the tile counter, blocks then take items longest first).
    const auto coords = [&](int item, int& m_block, int& head, int& b) {
        const int group_items = m_blocks * heads_per_group, group = item / group_items;
        const int members = min(heads_per_group, heads - group * heads_per_group), rank = item - group * group_items;
        const int tile = rank / members, pair = group * heads_per_group + rank - tile * members;
        m_block = m_blocks - 1 - tile;
        head = pair % nheads;
        b = pair / nheads;
    };
    // A sequence's lengths and first rows (varlen: from cu_seqlens, checked; `reporter` reports a bad one).
    struct Bounds {
        int seqlen_q, seqlen_k, q_start, k_start;
    };
    const auto bounds = [&](int b, bool reporter) {
        Bounds r{seqlen_q, seqlen_k, 0, 0};
        if constexpr (Tr::kVarlen) {
            const SeqBounds seq(cu_seqlens_q, cu_seqlens_k, b, total_q, total_k, error_claim, error_host, r.seqlen_q,
                                r.seqlen_k, reporter ? 1 : 0);
            // (the same on every lane: uniform, the loops over the sequence's tiles and what they count stay off
            // vector registers and lane loops, as with the padded kernel's bounds from kernel arguments)
            // (paged: cu_seqlens_k counts keys in the sequence's pages, which start at its block_table row)
            r = {warp_uniform(r.seqlen_q), warp_uniform(r.seqlen_k), warp_uniform(seq.q_start),
                 Tr::kPaged ? 0 : warp_uniform(seq.k_start)};
        }
        return r;
    };

    if (warp >= Tr::kConsumerWarps) {
        warpgroup_release_registers<Tr::kProducerRegisters>();
        if constexpr (Tr::kTma) {
            // Producer, padded calls: the first thread issues every copy (a slab of 64 columns per box), the
            // others leave. Q lands on q_full, a tile's K and V together on full, each barrier expecting the bytes.
            if (threadIdx.x != 32 * Tr::kConsumerWarps) return;
            u32 tiles = 0, items_loaded = 0;
            const auto mark = [&](int point) { fwd_mark(point, items_loaded); };
            // The output rows the consumers staged in Q buffer `buffer`, out to o for the item its words name.
            const auto store_rows = [&](int buffer) {
                const int* slot = item_slots + Tr::kSlotWords * buffer;
                const u32 tile = smem_q + buffer * QTile::kBytes;
                for (int slab = 0; slab < QTile::kSlabs; ++slab)
                    tma_store(tmap_o, 64 * slab, slot[5], slot[4] * Tr::kBlockM, slot[6],
                              tile + slab * QTile::kSlabBytes);
                bulk_commit();
            };
            for (int item = blockIdx.x;;) {
                const int q_buffer = ring_slot<Tr::kQBuffers>(items_loaded);
                int* const slot = item_slots + Tr::kSlotWords * q_buffer;
                if (item >= items) {
                    // The rows of the last items out, as the consumers stage them, then the end in a free buffer.
                    for (u32 last = items_loaded > Tr::kQBuffers ? items_loaded - Tr::kQBuffers : 0;
                         last < items_loaded; ++last) {
                        mbar_wait(q_empty(ring_slot<Tr::kQBuffers>(last)), ring_phase<Tr::kQBuffers>(last));
                        store_rows(ring_slot<Tr::kQBuffers>(last));
                    }
                    bulk_wait<0>();  // (every row out, every buffer read, before the block can leave)
                    slot[0] = items;
                    mbar_arrive(q_full(q_buffer));
                    return;
                }
                // The next item now, so that the atomic's round trip overlaps this one's copies.
                const int next = tile_counter != nullptr ? atomicAdd(tile_counter, 1) + (int)gridDim.x
                                                         : item + (int)gridDim.x;
                int m_block, head, b;
                coords(item, m_block, head, b);
                const int row0 = m_block * Tr::kBlockM, kv_head = head / heads_per_kv;
                mark(20);
                mbar_wait(q_empty(q_buffer), ring_phase<Tr::kQBuffers>(items_loaded) ^ 1);
                if (items_loaded >= Tr::kQBuffers) {
                    store_rows(q_buffer);
                    bulk_wait_read<0>();  // (the rows read out before Q lands there)
                }
                slot[0] = item, slot[1] = seqlen_q, slot[2] = seqlen_k, slot[3] = 0;
                slot[4] = m_block, slot[5] = head, slot[6] = b;
                mark(22);
                mbar_arrive_expect_tx(q_full(q_buffer), QTile::kBytes);  // (release: the item's words)
                // (Q's slabs here and the rows' in store_rows written out: through tma_load_tile / tma_store_tile
                // ptxas orders the producer's item set-up differently, not measured)
                for (int slab = 0; slab < QTile::kSlabs; ++slab)
                    tma_load(smem_q + q_buffer * QTile::kBytes + slab * QTile::kSlabBytes, tmap_q, 64 * slab, head,
                             row0, b, q_full(q_buffer));
                const WindowMask<Tr::kMask> mask{seqlen_q, seqlen_k, window_left, window_right};
                int n_first, n_blocks;
                mask.template key_tiles<Tr::kBlockN>(row0, Tr::kBlockM, n_first, n_blocks);
                for (int t = 0, key = n_first * Tr::kBlockN; t < n_blocks; ++t, ++tiles, key += Tr::kBlockN) {
                    const int k_slot = ring_slot<kKS>(tiles), v_slot = ring_slot<kVS>(tiles);
                    mbar_wait(k_empty(k_slot), ring_phase<kKS>(tiles) ^ 1);
                    mbar_arrive_expect_tx(full(k_slot), 2 * KVTile::kBytes);
                    tma_load_tile<KVTile>(smem_k + k_slot * KVTile::kBytes, tmap_k, kv_head, key, b, full(k_slot));
                    mbar_wait(v_empty(v_slot), ring_phase<kVS>(tiles) ^ 1);
                    tma_load_tile<KVTile>(smem_v + v_slot * KVTile::kBytes, tmap_v, kv_head, key, b, full(k_slot));
                }
                mark(23);
                ++items_loaded;
                item = next;
            }
        }
        // Producer, varlen calls: a tile (zeros from row `valid` on) into swizzled slabs. After a slot's copies, one
        // arrival per thread on its barrier, made when they have landed. An item's Q and whole output tiles, and
        // with packed K/V (not paged) its sequence's whole K/V tiles, go by the first thread's TMA copies instead.
        const int ptid = threadIdx.x - 32 * Tr::kConsumerWarps;
        using Loader = SlabLoader<Tr::kProducerThreads, Tr::kHeadDim>;
        Loader loader(ptid);
        constexpr int kRowStep = Loader::kRowStep;
        int out_row_stride = o_row_stride, row_pages = max_pages;
        // With three consumer warpgroups the producer has 32 registers: its rows and these two strides are taken
        // afresh per item (keep_here), or ptxas holds each array's row offset and the strides' sign words through
        // the item loop, and spills.
        const auto renew_per_item = [&] {
            if constexpr (Tr::kConsumerWGs == 3) {
                int thread = ptid;
                keep_here(thread);
                loader = Loader(thread);
                keep_here(out_row_stride);
                keep_here(row_pages);
            }
        };
        const auto load_tile = [&](auto tile, u32 dst, const u16* src, int row_stride, int valid) {
            loader.template load<decltype(tile)>(dst, src, row_stride, valid);
        };
        u32 tiles = 0;  // K/V tiles loaded
        u32 items_loaded = 0;  // (Q buffer items_loaded % kQBuffers next)
        int exchange = 0;
        const auto q_buffer = [&] { return ring_slot<Tr::kQBuffers>(items_loaded); };
        // The output rows the consumers staged in Q buffer `buffer` for the item its slot still names, out to o
        // (each thread the chunks it loads Q into, so its own copies cannot overtake these reads). Waited for on
        // q_empty: the consumers hand a Q buffer back once their rows are in it.
        const auto store_rows = [&](int buffer) {
            const int* slot = item_slots + Tr::kSlotWords * buffer;
            const int seqlen = slot[1], q_start = slot[3], m_block = slot[4], head = slot[5], b = slot[6];
            // (read before rewritten)
            named_barrier_sync<Tr::kProducerBarrier, Tr::kProducerThreads>();
            const int row0 = m_block * Tr::kBlockM;
            if (seqlen - row0 >= Tr::kBlockM) {  // a whole tile: the first thread's TMA store
                if (ptid == 0) {
                    tma_store_tile<QTile>(tmap_o, head, q_start + row0, 0, smem_q + buffer * QTile::kBytes);
                    bulk_wait_read<0>();  // (the rows read out before Q lands there)
                }
                return;
            }
            const int first_row = loader.first_row, column = loader.column;
            u16* to = o + b * o_batch_stride + (i64)(q_start + row0 + first_row) * out_row_stride +
                      head * o_head_stride + column;
            u32 from = QTile::at(smem_q + buffer * QTile::kBytes, first_row, column);
#pragma unroll 1
            for (int row = first_row; row < Tr::kBlockM && row < seqlen - row0;
                 row += kRowStep, from += kRowStep * QTile::kRowBytes, to += (i64)kRowStep * out_row_stride) {
                u32 x[4];
                ld_shared_v4(from, x);
                *reinterpret_cast<uint4*>(to) = make_uint4(x[0], x[1], x[2], x[3]);
            }
            // (every thread's reads done before the first thread's TMA copy of the next Q lands there)
            named_barrier_sync<Tr::kProducerBarrier, Tr::kProducerThreads>();
        };
        // The next Q buffer once the consumers hand it back, with the rows of the item it held written out.
        const auto free_buffer = [&] {
            mbar_wait(q_empty(q_buffer()), ring_phase<Tr::kQBuffers>(items_loaded) ^ 1);
            if (items_loaded >= Tr::kQBuffers) store_rows(q_buffer());
        };
        // Hands `item` (or, past the last, the end) and its sequence's bounds to the consumers with the next Q
        // buffer, once free_buffer has it back (varlen: so that they do not wait for cu_seqlens at every item's
        // start).
        const auto publish = [&](int item, const Bounds& seq, int m_block, int head, int b) {
            if (ptid == 0) {
                int* slot = item_slots + Tr::kSlotWords * q_buffer();
                slot[0] = item, slot[1] = seq.seqlen_q, slot[2] = seq.seqlen_k, slot[3] = seq.q_start;
                slot[4] = m_block, slot[5] = head, slot[6] = b;
            }
        };
        // The item after `item`: with a tile counter the one the first thread took (`ticket`), handed to the others
        // through two exchange words in turn (a word is rewritten only after every thread has read it); without,
        // a grid stride on.
        const auto next_item = [&](int item, int ticket) {
            if (tile_counter == nullptr) return item + (int)gridDim.x;
            if (ptid == 0) item_slots[Tr::kSlotWords * Tr::kQBuffers + exchange] = ticket;
            named_barrier_sync<Tr::kProducerBarrier, Tr::kProducerThreads>();
            const int next = warp_uniform(item_slots[Tr::kSlotWords * Tr::kQBuffers + exchange]);
            exchange ^= 1;
            return next;
        };
        const auto mark = [&](int point) {
            if (ptid == 0) fwd_mark(point, items_loaded);
        };
        for (int item = blockIdx.x;;) {
            renew_per_item();
            // The first thread takes the next item now, so that the atomic's round trip overlaps this one's loads.
            int ticket = 0;
            if (tile_counter != nullptr && ptid == 0 && item < items) ticket = atomicAdd(tile_counter, 1) + gridDim.x;
            if (item >= items) {
                // The rows of the last items out, as the consumers stage them, then the end in a free buffer.
                for (u32 last = items_loaded > Tr::kQBuffers ? items_loaded - Tr::kQBuffers : 0; last < items_loaded;
                     ++last) {
                    mbar_wait(q_empty(ring_slot<Tr::kQBuffers>(last)), ring_phase<Tr::kQBuffers>(last));
                    store_rows(ring_slot<Tr::kQBuffers>(last));
                }
                publish(items, Bounds{}, 0, 0, 0);
                if (ptid == 0) mbar_arrive(q_full(q_buffer()));  // (release: the item slot's store)
                break;
            }
            int m_block, head, b;
            coords(item, m_block, head, b);
            const int row0 = m_block * Tr::kBlockM, kv_head = head / heads_per_kv;
            // (a sequence's first item: its last query tile of head 0)
            const Bounds seq = bounds(b, ptid == 0 && m_block == m_blocks - 1 && head == 0);
            if (Tr::kVarlen && row0 >= seq.seqlen_q) {  // past this sequence's queries: the consumers never see it
                item = next_item(item, ticket);
                continue;
            }
            mark(20);
            free_buffer();
            publish(item, seq, m_block, head, b);
            mark(22);
            const WindowMask<Tr::kMask> mask{seq.seqlen_q, seq.seqlen_k, window_left, window_right};
            int n_first, n_blocks;
            mask.template key_tiles<Tr::kBlockN>(row0, Tr::kBlockM, n_first, n_blocks);
            // The next tile's K and V rows, and the keys left from its first on (running: fewer live registers)
            const int first_key = n_first * Tr::kBlockN;
            int keys_left = seq.seqlen_k - first_key;
            const u16* k_tile = k + b * k_batch_stride + (i64)(seq.k_start + first_key) * k_row_stride +
                                kv_head * k_head_stride;
            const u16* v_tile = v + b * v_batch_stride + (i64)(seq.k_start + first_key) * v_row_stride +
                                kv_head * v_head_stride;
            // Paged: lane j of producer warp w looks up row 32 w + j of the next tile, its K and V rows alike (a bad
            // block_table entry is reported and its rows read as zeros, as in flash_fwd). (Looking the rows up a
            // tile ahead measured the same: bench/NOTES.md.)
            const u16* k_row = nullptr;
            const u16* v_row = nullptr;
            const auto look_up_rows = [&] {
                const PagedKeys keys{block_table + (i64)b * row_pages, {page_magic, page_shift}, page_size,
                                     num_pages};
                int page, slot;
                const int row = ptid;
                const bool ok = row < keys_left && keys.locate(seq.seqlen_k - keys_left + row, page, slot, b,
                                                               error_claim, error_host);
                k_row = ok ? k + kv_head * k_head_stride + page * k_batch_stride + (i64)slot * k_row_stride : nullptr;
                v_row = ok ? v + kv_head * v_head_stride + page * v_batch_stride + (i64)slot * v_row_stride : nullptr;
            };
            // The next tile's K or V rows: from `tile` (packed), or from their pages (paged: `row` is this lane's
            // row, and zero-filled rows name `pool`, the start of K or V, as their source, which is not read).
            const auto load_rows = [&](u32 dst, const u16* tile, const u16* row, const u16* pool, int row_stride) {
                if constexpr (Tr::kPaged)
                    loader.template load_paged_rows<KVTile>(dst, row, pool, ptid >> 5, ptid & 31);
                else
                    load_tile(KVTile{}, dst, tile, row_stride, keys_left);
            };
            const auto load_kv = [&] {  // the next tile's K and V, then its one arrival
                const int k_slot = ring_slot<kKS>(tiles), v_slot = ring_slot<kVS>(tiles);
                if constexpr (Tr::kPaged) look_up_rows();  // (its load in flight while the slot is waited for)
                mbar_wait(k_empty(k_slot), ring_phase<kKS>(tiles) ^ 1);
                // Packed K/V: a whole tile of the sequence's keys by TMA (the first thread's copies and arrivals);
                // the sequence's last, ragged tile by cp.async, whose zeros past its keys keep
                // another sequence's rows (which may hold anything) out of P V.
                if (!Tr::kPaged && keys_left >= Tr::kBlockN) {
                    const int row = seq.k_start + seq.seqlen_k - keys_left;
                    if (ptid == 0) {
                        mbar_arrive_expect_tx<Tr::kCopyArrivals>(full(k_slot), 2 * KVTile::kBytes);
                        tma_load_tile<KVTile>(smem_k + k_slot * KVTile::kBytes, tmap_k, kv_head, row, 0, full(k_slot));
                    }
                    mbar_wait(v_empty(v_slot), ring_phase<kVS>(tiles) ^ 1);
                    if (ptid == 0)
                        tma_load_tile<KVTile>(smem_v + v_slot * KVTile::kBytes, tmap_v, kv_head, row, 0, full(k_slot));
                } else {
                    load_rows(smem_k + k_slot * KVTile::kBytes, k_tile, k_row, k, k_row_stride);
                    mbar_wait(v_empty(v_slot), ring_phase<kVS>(tiles) ^ 1);
                    load_rows(smem_v + v_slot * KVTile::kBytes, v_tile, v_row, v, v_row_stride);
                    // (packed: fenced here, once an item, so that the consumers' steady loop fences only when paged)
                    if constexpr (Tr::kPaged)
                        cp_async_mbar_arrive(full(k_slot));
                    else
                        cp_async_fenced_arrive(full(k_slot));
                }
                ++tiles;
                k_tile += (i64)Tr::kBlockN * k_row_stride;
                v_tile += (i64)Tr::kBlockN * v_row_stride;
                keys_left -= Tr::kBlockN;
            };
            // Q by TMA: rows past the sequence's end are the next one's, or zeros past the array's (each output row
            // depends on its own query row alone, and these are never written out).
            if (ptid == 0) {
                mbar_arrive_expect_tx(q_full(q_buffer()), QTile::kBytes);  // (release: the item's words)
                tma_load_tile<QTile>(smem_q + q_buffer() * QTile::kBytes, tmap_q, head, seq.q_start + row0, 0,
                                     q_full(q_buffer()));
            }
            for (int t = 0; t < n_blocks; ++t) load_kv();
            mark(23);
            ++items_loaded;
            item = next_item(item, ticket);
        }
        cp_async_wait_all();  // leave nothing in flight into shared memory
        if (ptid == 0) bulk_wait<0>();  // (every row out before the block can leave)
        return;
    }

    // Consumers: warpgroup wg owns rows 64 wg .. 64 wg + 63 of each item's tile, warp w of it 16 of those.
    // Per key tile j a warpgroup issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} together, then turns S_j into
    // P_j, and the warpgroups take turns to issue (named barriers 1, 2 and 3), so that one's softmax runs under
    // the others' products. (ptxas puts the wait for P_{j-1} V_{j-1} ahead of the softmax; held below it, so that
    // the softmax also ran under the warpgroup's own product, the kernel was 2.5-7.5% slower: bench/NOTES.md.)
    warpgroup_claim_registers<Tr::kConsumerRegisters>();
    // The warpgroup as warp_uniform(): from `warp >> 2` ptxas kept every branch on the warpgroup divergent (a
    // WARPSYNC or BSSY/BSYNC pair around each; 464 more instructions, 3-7% slower) and serialised any wgmma in
    // such a branch.
    const int wg = warp_uniform(warp >> 2);
    // P V over 128-key tiles covers only the 64-key halves a warpgroup's rows can see (kLow | kHigh). (S stays
    // whole: with S's accumulators written by different wgmma in a branch, ptxas serialises every wgmma.)
    constexpr bool kHalves = Tr::kBlockN == 128;
    constexpr int kHalfKeys = Tr::kBlockN / 2, kLow = 1, kHigh = 2, kBoth = kLow | kHigh;
    // Warpgroup w waits at barrier kFwdTurn0 + w for the one before it and hands the turn on at the next one's.
    const auto turn_wait = [&] {
        if (wg == 0)
            named_barrier_sync<kFwdTurn0, kFwdTurnThreads>();
        else if (Tr::kConsumerWGs == 2 || wg == 1)
            named_barrier_sync<kFwdTurn1, kFwdTurnThreads>();
        else
            named_barrier_sync<kFwdTurn2, kFwdTurnThreads>();
    };
    const auto turn_pass = [&] {
        if (wg == 0)
            named_barrier_arrive<kFwdTurn1, kFwdTurnThreads>();
        else if (Tr::kConsumerWGs == 2 || wg == 2)
            named_barrier_arrive<kFwdTurn0, kFwdTurnThreads>();
        else
            named_barrier_arrive<kFwdTurn2, kFwdTurnThreads>();
    };
    if (wg == Tr::kConsumerWGs - 1) turn_pass();  // warpgroup 0 issues first
    u32 tiles = 0;  // K/V tiles taken (K's next is tile `tiles`)
    u32 items_taken = 0;  // (Q buffer items_taken % kQBuffers next)
    const auto mark = [&](int point) {
        if ((warp & 3) == 0 && lane == 0 && wg < 2) fwd_mark(10 * wg + point, items_taken);
    };
    for (;;) {
        const int q_buffer = ring_slot<Tr::kQBuffers>(items_taken);
        mbar_wait(q_full(q_buffer), ring_phase<Tr::kQBuffers>(items_taken));  // the item, and its Q
        mark(0);
        // (read by lane 0, the lane that later hands the buffer back, so the reads are ordered before its reuse)
        int slot[Tr::kSlotWords];
#pragma unroll
        for (int i = 0; i < Tr::kSlotWords; ++i)
            slot[i] = __shfl_sync(~0u, lane == 0 ? item_slots[Tr::kSlotWords * q_buffer + i] : 0, 0);
        if (slot[0] >= items) break;
        const int m_block = slot[4], head = slot[5], b = slot[6];
        const int row0 = m_block * Tr::kBlockM, wg_row0 = row0 + 64 * wg, warp_row0 = wg_row0 + 16 * (warp & 3);
        const Bounds seq{slot[1], slot[2], slot[3], 0};
        const int seqlen_q = seq.seqlen_q;
        const WindowMask<Tr::kMask> mask{seqlen_q, seq.seqlen_k, window_left, window_right};
        int n_first, n_blocks, my_first, my_count;
        mask.template key_tiles<Tr::kBlockN>(row0, Tr::kBlockM, n_first, n_blocks);
        mask.template key_tiles<Tr::kBlockN>(wg_row0, 64, my_first, my_count);
        if (wg_row0 >= seqlen_q) my_count = 0;  // a ragged last tile: this warpgroup has no rows
        // Every warpgroup takes a turn per tile of the block and one for its last P V, or, where each passes over
        // at least one tile, one turn fewer: it passes over its first tile before the first it computes, or else
        // its last after its last P V, without a turn. (A turn for such a tile held the warpgroup that passes over
        // the block's last tile until the one that computes it had issued it, and the one that passes over the
        // first until the others had their first softmax done: a window item of 192 rows at d=64 has both.)
        // Each warpgroup is then at most one tile ahead of another in the turn it takes, which needs rings of
        // four (so that the tile it waits for has its slots back from every warpgroup's turns before this one).
        bool free_pass = false;
        if constexpr (kKS >= 4 && kVS >= 4 && Tr::kMask == kMaskWindow) {
            int fewest_passes = n_blocks;
#pragma unroll
            for (int w = 0; w < Tr::kConsumerWGs; ++w) {
                int first, count;
                mask.template key_tiles<Tr::kBlockN>(row0 + 64 * w, 64, first, count);
                fewest_passes = min(fewest_passes, n_blocks - (row0 + 64 * w < seqlen_q ? count : 0));
            }
            free_pass = fewest_passes > 0;
        }
        // This warpgroup's tiles among the block's: [mine_begin, mine_end); it passes over the others.
        const int mine_begin = my_first - n_first, mine_end = mine_begin + my_count;
        // Of its first and last tiles, the 64-key half its rows see if they see only one (the band's first tile
        // under a sliding window, the causal diagonal, a ragged end): P V leaves the other out, where P is 0.
        int first_half = kBoth, last_half = kBoth;
        if constexpr (kHalves) {
            int half_first, half_count;  // the 64-key tiles its rows see
            mask.template key_tiles<kHalfKeys>(wg_row0, 64, half_first, half_count);
            if (half_first % 2) first_half = kHigh;
            if ((half_first + half_count) % 2) last_half = kLow;
        }
        mark(6);

        float acc_o[1][kDT][4];
        zero_fragments(acc_o);
        OnlineSoftmax<1, kNT> softmax;
        softmax.init();
        float s[1][kNT][4];
        u32 p[kNT / 2][4];  // P_{j-1}, the A operand of the product with V_{j-1}
        float correction[2];
        const u32 q_rows = QTile::at(smem_q + q_buffer * QTile::kBytes, 64 * wg, 0);  // this warpgroup's 64 rows
        const auto release = [&](u32 bar, u32 also = 0) {
            __syncwarp();
            if (lane == 0) {
                mbar_arrive(bar);
                if (also) mbar_arrive(also);
            }
        };
        // A tile of the block that this warpgroup's rows cannot see: its turn passes (unless `take_turn` is false),
        // its slots go back (once landed, so that every arrival on a slot's barrier counts towards the same fill).
        const auto pass_over = [&](bool take_turn) {
            mbar_wait(full(ring_slot<kKS>(tiles)), ring_phase<kKS>(tiles));
            if (take_turn) {
                turn_wait();
                turn_pass();
            }
            release(k_empty(ring_slot<kKS>(tiles)), v_empty(ring_slot<kVS>(tiles)));
            ++tiles;
        };
        // S = Q K^T over the head dim: k16 steps 32 bytes apart in a slab, then the next slab.
        const auto issue_s = [&] {
            const u32 k_slot = smem_k + ring_slot<kKS>(tiles) * KVTile::kBytes;
#pragma unroll
            for (int kk = 0; kk < kKSteps; ++kk) {
                const u32 step = (kk & 3) * 32;
                Wgmma<Elem, Tr::kBlockN>::ss(s, smem_desc_sw128(q_rows + (kk >> 2) * QTile::kSlabBytes + step, 16),
                                             smem_desc_sw128(k_slot + (kk >> 2) * KVTile::kSlabBytes + step, 16),
                                             kk > 0);
            }
            wgmma_commit();
        };
        // O += P V with V in slot `slot`, over the keys of `halves`: k16 steps 16 key rows apart.
        const auto issue_pv = [&](int slot, int halves) {
            const u32 v_slot = smem_v + slot * KVTile::kBytes;
            const auto steps = [&](auto begin, auto end) {  // k16 steps [begin, end)
                wgmma_fence();  // (each branch its own fence and commit: ptxas would inject them)
#pragma unroll
                for (int kk = decltype(begin)::value; kk < decltype(end)::value; ++kk)
                    Wgmma<Elem, Tr::kHeadDim>::rs_mn(
                        acc_o, p[kk], smem_desc_sw128(KVTile::at(v_slot, kk * 16, 0), KVTile::kSlabBytes), 1);
                wgmma_commit();
            };
            if (!kHalves || halves == kBoth)
                steps(Const<0>{}, Const<kNT / 2>{});
            else if (halves == kLow)
                steps(Const<0>{}, Const<kNT / 4>{});
            else
                steps(Const<kNT / 4>{}, Const<kNT / 2>{});
        };
        // The landed scores of tile j: masked where some row of the warpgroup cannot see some key, then P.
        const auto softmax_s = [&](int j) {
            pin_registers(s);
            const int col0 = (n_first + j) * Tr::kBlockN;
            if (mask.tile_needs_mask(wg_row0, 64, col0, Tr::kBlockN)) mask.apply(s, warp_row0, col0, lane);
            softmax.probabilities(s, scale_log2, correction);
        };
        const auto to_p = [&] {
#pragma unroll
            for (int kk = 0; kk < kNT / 2; ++kk) c_to_a<Elem>(p[kk], s[0][2 * kk], s[0][2 * kk + 1]);
        };

        for (int j = 0; j < mine_begin; ++j) pass_over(!(free_pass && j == 0));
        if (my_count > 0) {
            mbar_wait(full(ring_slot<kKS>(tiles)), ring_phase<kKS>(tiles));
            mark(7);
            if constexpr (Tr::kPaged) fence_proxy_async_smem();  // the producer's cp.async K/V, read by wgmma
            turn_wait();
            mark(8);
            wgmma_fence();
            issue_s();
            turn_pass();
            wgmma_wait<0>();
            release(k_empty(ring_slot<kKS>(tiles)));
            mark(1);
            softmax_s(mine_begin);
            to_p();
            mark(2);
            u32 prev = tiles++;  // tile j - 1, whose V goes into the product with P_{j-1}
            int prev_halves = my_count > 1 ? first_half : first_half & last_half;
            for (int j = mine_begin + 1; j < mine_end; ++j) {
                // S_j and O += P_{j-1} V_{j-1} issued together; P_j computed while the second runs.
                mbar_wait(full(ring_slot<kKS>(tiles)), ring_phase<kKS>(tiles));  // (V_{j-1} landed with K_{j-1})
                if constexpr (Tr::kPaged) fence_proxy_async_smem();
                turn_wait();
                wgmma_fence();
                issue_s();
                issue_pv(ring_slot<kVS>(prev), prev_halves);
                turn_pass();
                wgmma_wait<1>();
                softmax_s(j);
                wgmma_wait<0>();
                pin_registers(acc_o);
                pin_registers(p);
                release(k_empty(ring_slot<kKS>(tiles)), v_empty(ring_slot<kVS>(prev)));
                softmax.rescale(acc_o, correction);
                to_p();
                prev = tiles++;
                prev_halves = j == mine_end - 1 ? last_half : kBoth;
            }
            mark(3);
            turn_wait();
            wgmma_fence();
            issue_pv(ring_slot<kVS>(prev), prev_halves);
            turn_pass();
            wgmma_wait<0>();
            mark(4);
            pin_registers(acc_o);
            pin_registers(p);
            release(v_empty(ring_slot<kVS>(prev)));
        } else {
            turn_wait();  // every warpgroup takes n_blocks + 1 turns per item
            turn_pass();
        }
        for (int j = mine_end; j < n_blocks; ++j) pass_over(!(free_pass && mine_begin == 0 && j == n_blocks - 1));

        // O = diag(l)^-1 O and L = m + log(l). O's rows go into this warpgroup's rows of the item's Q buffer
        // (Q is no longer read; stmatrix, conflict-free in the swizzled slabs) and the buffer back to the
        // producer, which writes them out before it loads another Q there: the warpgroup goes on to its next item.
        // (Written out here and in bwd_hopper.cu rather than through one helper: a shared one changed both kernels'
        // code and measured slower, bench/NOTES.md, session 21's review.)
        float row_lse[2];
        softmax.finalize(acc_o, row_lse, scale);
        mark(9);
        const u32 q_tile = smem_q + q_buffer * QTile::kBytes;
        static_assert(kDT % 4 == 0, "the output goes out in groups of four n8 tiles");
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
            for (int group = 0; group < kDT / 4; ++group) {
                u32 x[4];
#pragma unroll
                for (int p = 0; p < 4; ++p)
                    x[p] = Mma<Elem>::pack(acc_o[0][4 * group + p][2 * half], acc_o[0][4 * group + p][2 * half + 1]);
                stmatrix_x4(QTile::at(q_tile, 64 * wg + 16 * (warp & 3) + 8 * half + (lane & 7),
                                      (4 * group + (lane >> 3)) * 8),
                            x);
            }
            const int row = warp_row0 + (lane >> 2) + half * 8;
            if (row < seqlen_q && (lane & 3) == 0)
                lse[b * lse_batch_stride + head * lse_head_stride + seq.q_start + row] = row_lse[half];
        }
        fence_proxy_async_smem();  // the rows, written by stmatrix, read by a TMA store
        release(q_empty(q_buffer));  // (after __syncwarp: every lane's rows are in)
        mark(5);
        ++items_taken;
    }
    if (wg == 0) turn_wait();  // take the last warpgroup's last pass, so no arrival is left pending
}

}  // namespace fa2
