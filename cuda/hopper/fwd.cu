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
// FwdHopperParams (common/params.cuh): flash_fwd's parameters (cuda/fwd.cu) plus the batch size, the heads per L2
// group, the tile counter (null for the grid stride) and the tensor maps of q, k, v and o (fa2cupy/tensor_maps.py;
// paged calls have no K or V map); padded and varlen calls, varlen with paged K/V too, with softcap, ALiBi and
// dropout (HopperFwdTraits::kMods; padded ALiBi alone: kAlibiOnly) or without.
//
// The kernel assembles its parts: the traits and shared-memory layout (hopper/fwd_traits.cuh), the work items
// (hopper/scheduler.cuh), the producer (hopper/fwd_producer.cuh), the consumers' stages (hopper/fwd_consumer.cuh)
// and the producer's part of the epilogue (hopper/fwd_epilogue.cuh). The consumers' item loop is the kernel's own:
// moved into a function of its own (or its parts into theirs), the loop and the producer compiled to other
// instructions and registers.
#include "common/types.cuh"
#include "common/params.cuh"
#include "sm90/warpgroup.cuh"
#include "hopper/fwd_traits.cuh"
#include "hopper/scheduler.cuh"
#include "hopper/fwd_epilogue.cuh"
#include "hopper/fwd_producer.cuh"
#include "hopper/fwd_consumer.cuh"

namespace fa2 {

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_fwd_hopper(const __grid_constant__ FwdHopperParams kernel_params) {
    extern __shared__ unsigned char smem_raw[];
    const HopperFwdSmem<Tr> smem(smem_raw);
    if constexpr (Tr::kVarlen && !Tr::kPaged && VarlenLoader<Tr>::kPasses == 1) {
        // arrays narrower than the kernel: their columns past them in Q, K and V zero (SlabLoader; the tiles end
        // where the barriers start)
        if (kernel_params.fwd.headdim < Tr::kHeadDim) zero_shared(smem.q, smem.bars - smem.q);
    }
    if (threadIdx.x == 0) smem.init_barriers();
    __syncthreads();

    // The fields through a local copy (common/params.cuh); the tensor maps where they are, in the parameter space,
    // which the TMA copies name by address.
    const FwdParams params = kernel_params.fwd;
    const HopperFwdArgs args{params.k, params.v, params.o, params.lse, params.cu_seqlens_q, params.cu_seqlens_k,
                             params.block_table, params.k_batch_stride, params.k_row_stride, params.k_head_stride,
                             params.v_batch_stride, params.v_row_stride, params.v_head_stride, params.o_batch_stride,
                             params.o_row_stride, params.o_head_stride, params.lse_batch_stride,
                             params.lse_head_stride, params.max_seqlen_q, params.max_seqlen_k, params.nheads,
                             params.heads_per_kv, params.window_left, params.window_right, params.scale,
                             params.scale_log2, params.total_q, params.total_k, params.page_size, params.page_magic,
                             params.page_shift, params.max_pages, params.num_pages, params.error_claim,
                             params.error_host, kernel_params.tile_counter, kernel_params.tmap_q,
                             kernel_params.tmap_k, kernel_params.tmap_v, kernel_params.tmap_o, params.softcap,
                             {kernel_params.mods_unit, kernel_params.mods_unit_inv},
                             params.alibi_slopes, params.alibi_batch_stride, params.headdim, params.headdim_v,
                             params.rng_state, params.seed, params.offset, params.dropout_threshold,
                             params.dropout_scale};
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const HopperFwdScheduler<Tr::kBlockM> sched(params.max_seqlen_q, params.nheads, kernel_params.batch,
                                                kernel_params.heads_per_group, kernel_params.tail_heads);
    if (warp >= Tr::kConsumerWarps) {  // the producer warpgroup, its registers given to the consumers
        warpgroup_release_registers<Tr::kProducerRegisters>();
        if constexpr (Tr::kTma) {
            if (threadIdx.x != 32 * Tr::kConsumerWarps) return;  // (one thread issues every copy)
            produce_padded<Tr>(smem, sched, args);
            return;
        }
        produce_varlen<Tr>(smem, sched, args);
        return;
    }
    // The consumer warpgroups: per item, its tiles' plan, the main loop and the epilogue.
    warpgroup_claim_registers<Tr::kConsumerRegisters>();
    HopperFwdConsumer<Tr> consumer(smem, args, warp, lane);
    const int& wg = consumer.wg;
    using QTile = typename Tr::QTile;
    constexpr int kNT = Tr::kBlockN / 8, kDT = Tr::kHeadDimV / 8;
    constexpr int kKS = Tr::kKStages, kVS = Tr::kVStages;
    using Softmax = OnlineSoftmax<1, kNT>;
    constexpr bool kHalves = Tr::kBlockN == 128;
    if (wg == Tr::kConsumerWGs - 1) consumer.turn_pass();  // warpgroup 0 issues first
    for (;;) {
        const int q_buffer = ring_slot<Tr::kQBuffers>(consumer.items_taken);
        mbar_wait(smem.q_full(q_buffer), ring_phase<Tr::kQBuffers>(consumer.items_taken));  // the item, and its Q
        consumer.mark(0);
        // (read by lane 0, the lane that later hands the buffer back, so the reads are ordered before its reuse)
        int slot[Tr::kSlotWords];
#pragma unroll
        for (int i = 0; i < Tr::kSlotWords; ++i)
            slot[i] = __shfl_sync(~0u, lane == 0 ? smem.item_slots[Tr::kSlotWords * q_buffer + i] : 0, 0);
        if (slot[0] >= sched.items) break;
        const int m_block = slot[4], head = slot[5], b = slot[6];
        const int row0 = m_block * Tr::kBlockM, wg_row0 = row0 + 64 * wg, warp_row0 = wg_row0 + 16 * (warp & 3);
        const HopperFwdBounds seq{slot[1], slot[2], slot[3], 0};
        const int seqlen_q = seq.seqlen_q;
        const WindowMask<Tr::kMask> mask{seqlen_q, seq.seqlen_k, args.window_left, args.window_right};
        // (kMods: the item's ALiBi slope in UnitScoreMods' unit; the rest of its UnitScoreMods is rebuilt per tile
        // from the call's constants and the mask, so that the loop holds one register for them: held whole, they
        // spilled at d = 256)
        const float slope =
            Tr::kMods ? alibi_slope(args.alibi_slopes, args.alibi_batch_stride, b, head) * args.mods.unit_inv : 0.f;
        const bool drop = Tr::kMods && !Tr::kAlibiOnly && args.dropout_threshold != 0;  // dropout: consumer.drop()
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
        int first_half = kBothHalves, last_half = kBothHalves;
        if constexpr (kHalves) {
            int half_first, half_count;  // the 64-key tiles its rows see
            mask.template key_tiles<Tr::kBlockN / 2>(wg_row0, 64, half_first, half_count);
            if (half_first % 2) first_half = kHighKeys;
            if ((half_first + half_count) % 2) last_half = kLowKeys;
        }
        consumer.mark(6);
        float acc_o[1][kDT][4];
        zero_fragments(acc_o);
        Softmax softmax;
        softmax.init();
        float s[1][kNT][4];
        u32 p[kNT / 2][4];  // P_{j-1}, the A operand of the product with V_{j-1}
        float correction[2];

        // The main loop: the block's key tiles, this warpgroup's own (S, softmax, P V) and, in their places,
        // the ones it passes over.
        const u32 q_rows = QTile::at(smem.q + q_buffer * QTile::kBytes, 64 * wg, 0);  // this warpgroup's 64 rows

        for (int j = 0; j < mine_begin; ++j) consumer.pass_over(!(free_pass && j == 0));
        if (my_count > 0) {
            mbar_wait(smem.full(ring_slot<kKS>(consumer.tiles)), ring_phase<kKS>(consumer.tiles));
            consumer.mark(7);
            if constexpr (Tr::kPaged) fence_proxy_async_smem();  // the producer's cp.async K/V, read by wgmma
            consumer.turn_wait();
            consumer.mark(8);
            wgmma_fence();
            consumer.issue_s(s, q_rows);
            consumer.turn_pass();
            wgmma_wait<0>();
            consumer.release(smem.k_empty(ring_slot<kKS>(consumer.tiles)));
            consumer.mark(1);
            consumer.probabilities(mask, slope, n_first, wg_row0, warp_row0, mine_begin, s, softmax, correction);
            scores_to_operand<Tr>(p, s);
            if (drop) consumer.drop(p, b, head, n_first, warp_row0, mine_begin);
            consumer.mark(2);
            u32 prev = consumer.tiles++;  // tile j - 1, whose V goes into the product with P_{j-1}
            int prev_halves = my_count > 1 ? first_half : first_half & last_half;
            for (int j = mine_begin + 1; j < mine_end; ++j) {
                // S_j and O += P_{j-1} V_{j-1} issued together; P_j computed while the second runs. (V_{j-1} landed
                // with K_{j-1}.)
                mbar_wait(smem.full(ring_slot<kKS>(consumer.tiles)), ring_phase<kKS>(consumer.tiles));
                if constexpr (Tr::kPaged) fence_proxy_async_smem();
                consumer.turn_wait();
                wgmma_fence();
                consumer.issue_s(s, q_rows);
                consumer.issue_pv(acc_o, p, ring_slot<kVS>(prev), prev_halves);
                consumer.turn_pass();
                wgmma_wait<1>();
                const bool moved =
                    consumer.probabilities(mask, slope, n_first, wg_row0, warp_row0, j, s, softmax, correction);
                wgmma_wait<0>();
                pin_registers(acc_o);
                pin_registers(p);
                consumer.release(smem.k_empty(ring_slot<kKS>(consumer.tiles)), smem.v_empty(ring_slot<kVS>(prev)));
                if (moved) softmax.rescale(acc_o, correction);
                scores_to_operand<Tr>(p, s);
                if (drop) consumer.drop(p, b, head, n_first, warp_row0, j);
                prev = consumer.tiles++;
                prev_halves = j == mine_end - 1 ? last_half : kBothHalves;
            }
            consumer.mark(3);
            consumer.turn_wait();
            wgmma_fence();
            consumer.issue_pv(acc_o, p, ring_slot<kVS>(prev), prev_halves);
            consumer.turn_pass();
            wgmma_wait<0>();
            consumer.mark(4);
            pin_registers(acc_o);
            pin_registers(p);
            consumer.release(smem.v_empty(ring_slot<kVS>(prev)));
        } else {
            consumer.turn_wait();  // every warpgroup takes n_blocks + 1 turns per item
            consumer.turn_pass();
        }
        for (int j = mine_end; j < n_blocks; ++j)
            consumer.pass_over(!(free_pass && mine_begin == 0 && j == n_blocks - 1));

        // The epilogue: O = diag(l)^-1 O and L = m + log(l); O's rows into this warpgroup's rows of the item's Q
        // buffer (Q is no longer read; stmatrix, conflict-free in the swizzled slabs) and the buffer back to the
        // producer, which writes them out before it loads another Q there (fwd_epilogue.cuh): the warpgroup goes
        // on to its next item. (In this loop rather than a function of its own: compiled apart, the stores' loop
        // left ptxas to place the accumulators in other registers. Written out here and in hopper/bwd.cu's dK/dV
        // staging rather than through one helper: a shared one changed both kernels' code and measured slower,
        // docs/design.md.)
        float row_lse[2];
        // (modified scores: logits in UnitScoreMods' unit; dropout: the kept scores' 256 / threshold)
        softmax.finalize(acc_o, row_lse,
                         consumer.modify(slope) ? args.mods.unit : args.scale,
                         drop ? args.dropout_scale : 1.f);
        consumer.mark(9);
        const u32 q_tile = smem.q + q_buffer * QTile::kBytes;
        static_assert(kDT % 4 == 0, "the output goes out in groups of four n8 consumer.tiles");
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
            for (int group = 0; group < kDT / 4; ++group) {
                u32 x[4];
#pragma unroll
                for (int p = 0; p < 4; ++p)
                    x[p] = Mma<typename Tr::Elem>::pack(acc_o[0][4 * group + p][2 * half],
                                                        acc_o[0][4 * group + p][2 * half + 1]);
                stmatrix_x4(QTile::at(q_tile, 64 * wg + 16 * (warp & 3) + 8 * half + (lane & 7),
                                      (4 * group + (lane >> 3)) * 8),
                            x);
            }
            const int row = warp_row0 + (lane >> 2) + half * 8;
            if (row < seq.seqlen_q && (lane & 3) == 0)
                args.lse[b * args.lse_batch_stride + head * args.lse_head_stride + seq.q_start + row] =
                    row_lse[half];
        }
        fence_proxy_async_smem();            // the rows, written by stmatrix, read by a TMA store
        consumer.release(smem.q_empty(q_buffer));  // (after __syncwarp: every lane's rows are in)
        consumer.mark(5);
        ++consumer.items_taken;
    }
    if (wg == 0) consumer.turn_wait();  // take the last warpgroup's last pass, so no arrival is left pending

}

}  // namespace fa2
