// The Hopper backward's producer warpgroup: K and V of the block's keys once, then each step's Q, dO and row
// statistics into a ring of slots ahead of the consumers (TMA from one thread; a varlen sequence's ragged tiles by
// every producer thread's cp.async), and each step's staged dQ_i out to the fp32 accumulator in one bulk reduction.
#pragma once
#include "common/types.cuh"
#include "common/math.cuh"
#include "common/warp.cuh"
#include "sm80/memory.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/tma.cuh"
#include "sm90/grid_dependencies.cuh"
#include "sm90/slabs.cuh"
#include "attention/masks.cuh"
#include "hopper/bwd_traits.cuh"

namespace fa2 {

// Dropout's keep flags of a step (first query row m0, the block's keys from key0) into the slot at `flags`, for the
// consumer threads that form P^T: thread c's scores are its keys key_lo + 8 eh (rows of S^T: warp W = c / 32 of
// those threads holds keys 16 W .. 16 W + 15 of the block, lane l keys g = l / 4 and g + 8) and the queries
// m0 + 32 qb + 8 a + 2 t + e1 (t = l % 4). One Philox call (key 32 kbi + g, query residue 2 t + e1 of 32-query block
// qb: Dropout's grid) covers those scores of two threads, lane l of warps 2 kbi and 2 kbi + 1 (key members 0, 1 and
// 2, 3), so each call is drawn once and used whole: its 16 drop flags go into one 16-bit entry of the pair, entry
// 2 qb + e1 of pair 32 kbi + l (kDropPairBytes / 2 entries a pair), the flag of query member a and key member j at bit
// 2 a + j of the low byte (j = 0, 1: warp 2 kbi's) or 2 a + j - 2 of the high byte (warp 2 kbi + 1's): DropBits.
// Each of the producer's warps 1-3 (index u among them) keeps one key, u % kDropKeys, so that the key's share of the
// calls is worked out once a step, and takes that key's calls in turn.
//
// Registers (the producer works in 24): every value the calls share goes through this thread's 32 bytes at
// `scratch` and is read back per call (volatile): the Philox key and counter words and the key's share, written per
// step, and the key's counter word (Dropout::group), written once (drop_flags_setup). Held in registers, ptxas
// hoisted the rounds' keys and the key's word out of the loops and spilled 4-90 bytes.
template <class Tr>
FA2_DEVICE void drop_flags_setup(u32 scratch, int key0, int u) {
    const int key = u % Tr::kDropKeys;
    st_shared_u32(scratch + 28, Dropout::group(key0 + 32 * (key >> 3) + (key & 7)));
}
template <class Tr>
FA2_DEVICE void draw_drop_flags(u32 flags, u32 scratch, const Dropout& dropout, int key0, int m0, int u) {
    constexpr int kQBlocks = Tr::kBlockM / 32, kGroups = (Tr::kProducerThreads - 32) / Tr::kDropKeys;
    static_assert((Tr::kProducerThreads - 32) % Tr::kDropKeys == 0, "whole groups of the keys");
    u32 key_group;
    asm volatile("ld.volatile.shared.u32 %0, [%1 + 28];\n" : "=r"(key_group) : "r"(scratch) : "memory");
    const Dropout::Fixed key_part = dropout.fix_key(key_group);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n"
                 "st.shared.v4.b32 [%0 + 16], {%5, %6, %7, %8};\n" ::"r"(scratch),
                 "r"(dropout.key0), "r"(dropout.key1), "r"(dropout.offset), "r"(dropout.bh), "r"(key_part.v0),
                 "r"(key_part.v1), "r"(key_part.v2), "r"(key_group)
                 : "memory");
#pragma unroll 1
    for (int j = u / Tr::kDropKeys; j < kQBlocks * 8; j += kGroups) {
        const int qb = j >> 3, r_q = j & 7;
        Dropout d = dropout;
        Dropout::Fixed fixed;
        u32 kg;
        asm volatile("ld.volatile.shared.v4.b32 {%0, %1, %2, %3}, [%8];\n"
                     "ld.volatile.shared.v4.b32 {%4, %5, %6, %7}, [%8 + 16];\n"
                     : "=r"(d.key0), "=r"(d.key1), "=r"(d.offset), "=r"(d.bh), "=r"(fixed.v0), "=r"(fixed.v1),
                       "=r"(fixed.v2), "=r"(kg)
                     : "r"(scratch)
                     : "memory");
        u32 w[4];
        d.words_fixed_key(w, fixed, Dropout::group(m0 + 32 * qb, r_q));
        u32 entry = 0;
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const u32 y = d.drop_flags(w[a]) >> 7 & 0x01010101u;  // member j's flag at bit 8 j
            // members 0, 1 at bits 2 a, 2 a + 1 of the low byte, members 2, 3 at those of the high byte
            entry |= prmt_b32(y | y >> 7, 0u, 0x4420u) << (2 * a);
        }
        // the pair of lane 4 g + t (kg: the key's word, 32-key block and g)
        const int pair = 32 * (int)((kg >> 3) - ((u32)key0 >> 5)) + 4 * (int)(kg & 7u) + (r_q >> 1);
        st_shared_u16(flags + pair * Tr::kDropPairBytes + (2 * qb + (r_q & 1)) * 2, entry);
    }
}

// A ragged Q/dO tile pair (varlen) by warps 0 and 1 alone, for all four producer warps' shares: thread ptid takes
// its own and thread ptid + 64's.
template <class Tr>
FA2_DEVICE void load_ragged_by_two_warps(u32 q_dst, u32 do_dst, const u16* q, const u16* dout, int q_stride,
                                         int do_stride, int valid, int ptid, int cols, int cols_do) {
    using QTile = typename Tr::QTile;
#pragma unroll 1
    for (int part = 0; part < 2; ++part) {
        const SlabLoader<Tr::kProducerThreads, Tr::kHeadDim> share(ptid + 64 * part, cols);
        share.template load<QTile>(q_dst, q, q_stride, valid, cols);
        share.template load<QTile>(do_dst, dout, do_stride, valid, cols_do);
    }
}

template <class Tr, class BlockSteps, class WalksRotated>
FA2_DEVICE void produce_dkdv(const HopperBwdSmem<Tr>& smem, const HopperBwdArgs& args,
                             const WindowMask<Tr::kMask>& mask, const BlockSteps& block_steps,
                             const WalksRotated& walks_rotated, const int& kv_head,
                             const int& batch, const int& key0, const int& q_start, const int& k_start) {
    using KVTile = typename Tr::KVTile;
    using QTile = typename Tr::QTile;
    using Steps = HopperBwdSteps<Tr::kBlockM>;
    constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kS = Tr::kStages, kLag = kS < 2 ? kS : 2;
    // Tiles into swizzled slabs (zeros from row `valid` on), each thread its chunks (SlabLoader).
    const int ptid = threadIdx.x - Tr::kConsumerThreads;
    const SlabLoader<Tr::kProducerThreads, Tr::kHeadDim> loader(ptid, args.headdim);
    // (`cols`: the array's head dim, q's and k's or v's and dO's)
    const auto load_tile = [&](auto tile, u32 dst, const u16* src, int row_stride, int valid, int cols) {
        loader.template load<decltype(tile)>(dst, src, row_stride, valid, cols);
    };
    const int map_batch = Tr::kVarlen ? 0 : batch;  // (varlen: the maps span the packed arrays' rows)
    if (Tr::kTma || args.seqlen_k - key0 >= kN) {  // (varlen: the first thread arrives for all)
        if (ptid == 0) {
            mbar_arrive_expect_tx<Tr::kCopyArrivals>(smem.kv_full, 2 * KVTile::kBytes);
            tma_load_tile<KVTile>(smem.k, args.tmap_k, kv_head, k_start + key0, map_batch, smem.kv_full);
            tma_load_tile<KVTile>(smem.v, args.tmap_v, kv_head, k_start + key0, map_batch, smem.kv_full);
        }
    } else {
        load_tile(KVTile{}, smem.k,
                  args.k + batch * args.k_batch_stride + (i64)(k_start + key0) * args.k_row_stride +
                      kv_head * args.k_head_stride,
                  args.k_row_stride, args.seqlen_k - key0, args.headdim);
        load_tile(KVTile{}, smem.v,
                  args.v + batch * args.v_batch_stride + (i64)(k_start + key0) * args.v_row_stride +
                      kv_head * args.v_head_stride,
                  args.v_row_stride, args.seqlen_k - key0, args.headdim_v);
        cp_async_fenced_arrive(smem.kv_full);  // (fenced: the consumers read it unfenced)
    }
    const Steps steps = block_steps();
    // Step j's dQ_j, once staged, goes out in one bulk reduction of its rows before seqlen_q, from its first
    // query row's accumulator row on (the first thread), and the staging tile back to the consumers once read.
    // Taken kLag steps late, after the load that the consumers' release of step j's slot let through: two with a
    // ring of two slots, so the consumers never wait for it; one with one slot (head dim 256), as the consumers'
    // step j + 1 stages its dQ only once step j's has been read, and their release of step j + 1 is what lets the
    // load of step j + 2 through. The step's rows are worked out here (carried from its load, they spilled at
    // head dim 64 beside the statistics loaded a step ahead); the accumulator row is an int, as rows of 272
    // bytes or more fit in device memory.
    //
    // Counted (args.dq_semaphore set, not deterministic): once a step's addition is done in memory, the tile's count
    // goes up by one (release), so that the dQ conversion can take each tile once its count reaches the key tiles
    // that add to it, while this kernel still runs (BwdParams::dq_arrivals). A step's addition is counted two steps
    // later, before that step's is issued (the wait for its completion then seldom waits), the last two after the
    // walk.
    //
    // Deterministic (args.dq_semaphore set): the key tiles whose blocks add to a query tile's dQ do so in turn, so
    // that the sum has one order. The turn flag of (head, query tile) counts the additions done, and a turn passes
    // once the addition is done in memory; the staging tile goes back to the consumers as soon as it is read, before
    // that. The order is from the last of those key tiles to the first: this block's turn is the number of them
    // after its own (the mask's key_tiles over the tile's rows, which are exactly the key tiles whose walks include
    // the tile). Under a causal mask a block's walk reaches a tile steps after the block of the next key tile did
    // (both walk up from their first visible query tile, the next block's later), without one they reach it
    // together and the turns stagger the blocks by a reduction each; the blocks launch last key tile first, so the
    // block waited for has started. Rotated walks (steps.rotated: no mask, the group's blocks all on the GPU at
    // once) take their turns in the order their walks reach the tile instead (rotated_turn).
    // (counted: the last two steps whose additions are issued but not yet counted, as their flags' indices, the
    // later first; -1: none)
    //
    // Who issues them: the first thread, between its loads; or in deterministic calls without dropout, in the
    // kernels HopperBwdTraits::kOwnReducers names (HopperBwdTraits::own_reducers), the first thread of warp 3,
    // each step as soon as it is staged, so that the waits for the turns and for each addition hold up no load.
    // Warps 2 and 3 have nothing else to do there but, with 128 query rows a step (head dim 64), store row
    // statistics: warp 2 then stores warp 3's rows too; in varlen calls copy a sequence's ragged tiles: warps 0 and 1
    // then copy them for all four; and in modifier kernels arrive on each step's full barrier (which counts every
    // producer thread, for dropout's draws): the barrier then counts warps 0 and 1 alone (init_barriers). The
    // branch that takes those warps out of the walk is on a warp-uniform index: as a per-thread branch, it cost the
    // 24-register modifier producers 52-64 bytes of spills in the walk. At the wide head dims the first
    // threads of warps 2 and 3 each add half of the step's rows, on turns of their own (HopperBwdTraits::kTurnPlanes:
    // a turn passes once its half is added, so the next block's first half goes in while this one's second is in
    // flight). The varlen d = 256 modifier kernel keeps the first thread: its 56-register producer spilled 20 bytes.
    // (The switch is read from the arguments where it is used: held in a register across the walk, or tested in a
    // kernel that has no such reducer, it cost the 24-register producers 4-24 bytes of spills. Warp 3 whole, as a
    // thread of warp 2 alone, beside its warp's other lanes in the walk, hung the kernel.)
    constexpr bool kOwnReducer = Tr::kOwnReducers;
    // (HopperBwdTraits::own_reducers written out, the threshold read only in kernels with dropout: calling it
    // reordered the machine code of 76 of the 102 kernels)
    const auto own = [&] {
        if constexpr (Tr::kDropout)
            return kOwnReducer && args.deterministic && args.dropout_threshold == 0;
        else
            return kOwnReducer && args.deterministic;
    };
    if (ptid == 0) st_shared_u32(smem.uncounted(), ~0u), st_shared_u32(smem.uncounted() + 4, ~0u);
    // (own_now: own(), passed where the caller knows it)
    const auto reduce_step = [&](int j, bool own_now) {
        if (ptid != (own_now ? 96 : 0) && !(Tr::kTurnPlanes == 2 && own_now && ptid == 64)) return;
        const int head = kv_head * args.heads_per_kv + j / steps.m_count, m0 = steps.m0(j);
        const int t = j % Tr::kDqTiles, rows = min(kM, args.seqlen_q - m0), tile = head * args.sem_tiles + m0 / kM;
        mbar_wait(smem.dq_staged(t), (j / Tr::kDqTiles) & 1);
        // This thread's rows of the step, from r0 (with two reducing threads, warp 2's the first half and warp 3's
        // the second, each on its flag in plane p of the call's flags: plane 0 first, each the batch rows', heads'
        // and tiles' flags)
        int r0 = 0, n = rows, flag = tile;
        if constexpr (Tr::kTurnPlanes == 2) {
            if (own_now) {
                const int p = ptid == 64 ? 0 : 1;
                r0 = p * (kM / 2), n = min(kM / 2, rows - r0);
                flag += p * int(gridDim.z) * args.nheads * args.sem_tiles;
            }
        }
        bool pass = false;  // (deterministic: the turn passed on once the addition is done)
        if (args.dq_semaphore != nullptr && !args.deterministic) {
            const int older = ld_shared_s32(smem.uncounted() + 4);
            if (older >= 0) {
                bulk_wait<1>();  // (the addition two steps back done; the last may still run)
                pass_turn(args.dq_semaphore + older);
            }
            st_shared_u32(smem.uncounted() + 4, ld_shared_s32(smem.uncounted()));
            st_shared_u32(smem.uncounted(), tile);
        } else if (args.dq_semaphore != nullptr) {
            int turn;
            if (walks_rotated(steps.m_count)) {
                const int key_tiles = (args.seqlen_k + kN - 1) / kN;
                turn = rotated_turn(key0 / kN, key_tiles, steps.m_count, steps.m_shift, m0 / kM - steps.m_begin);
            } else {
                int first, count;
                mask.template key_tiles<kN>(m0, rows, first, count);
                turn = first + count - 1 - key0 / kN;
            }
            wait_for_turn(args.dq_semaphore + flag, turn);
            pass = true;
        }
        const int row = int(batch * args.stat_batch_stride + head * args.stat_head_stride + q_start + m0) + r0;
        const u32 staged = smem.dq + (t * kM + r0) * Tr::kDqPitch * 4;
        if (Tr::kDqReduceByMap && args.dq_by_map && n == kM)
            tma_reduce_add_2d(args.tmap_dq, 0, row, staged);
        else if (Tr::kTurnPlanes == 1 || n > 0)  // (a second half may be empty; a step's rows never are)
            bulk_reduce_add_f32(args.dq_accum + (i64)row * Tr::kDqPitch, staged, n * Tr::kDqPitch * 4);
        bulk_commit();
        bulk_wait_read<0>();
        mbar_arrive(smem.dq_free(t));  // (the staging tile is read: the consumers may stage the next step's dQ)
        if (pass) {
            bulk_wait<0>();  // (the addition done, not only its reads)
            pass_turn(args.dq_semaphore + flag);
        }
    };
    // Thread ptid < kM's row statistics of a step, lse (+inf past seqlen_q, so that P = 0: plain loads, which a
    // zero-filling copy cannot give) and D, loaded a step ahead: their wait falls under the wait for the slot,
    // not on the way to the step's full barrier (nothing reads them before the step's stores).
    // (with 128 rows a step and warp 3 reducing, warp 2's threads also take warp 3's rows, ptid + 32)
    float lse_next = 0.f, dsum_next = 0.f, lse_next3 = 0.f, dsum_next3 = 0.f;
    const auto load_stats = [&](int head, int m0, bool own_now) {
        if (ptid >= kM) return;
        lse_next = pos_inf(), dsum_next = 0.f;
        if (m0 + ptid < args.seqlen_q) {
            const int row = int(batch * args.stat_batch_stride + head * args.stat_head_stride + q_start + m0 + ptid);
            lse_next = args.lse[row], dsum_next = args.dsum[row];
        }
        if constexpr (kOwnReducer && kM == 128) {
            if (own_now && ptid >= 64 && ptid < 96) {
                lse_next3 = pos_inf(), dsum_next3 = 0.f;
                if (m0 + ptid + 32 < args.seqlen_q) {
                    const int row =
                        int(batch * args.stat_batch_stride + head * args.stat_head_stride + q_start + m0 + ptid + 32);
                    lse_next3 = args.lse[row], dsum_next3 = args.dsum[row];
                }
            }
        }
    };
    // (launched programmatically, sm_90: the preprocess's D and zeroed dQ accumulator, and the counts, only
    // from here on; K and V, like Q and dO, are the call's inputs, written before the preprocess started)
    wait_for_prior_grids();
    load_stats(kv_head * args.heads_per_kv, steps.first_m0(), own());
    // (warp 3, and warp 2 with 64 query rows a step: the first threads of the reducing ones reduce, the rest are done)
    if (own() && warp_uniform(ptid >> 5) >= (kM == 64 ? 2 : 3)) {  // (uniform: see above)
        if (ptid == 64 || ptid == 96)
            for (int j = 0; j < steps.count; ++j) reduce_step(j, true);  // (each waits for its addition to be done)
        return;
    }
    const u32 drop_scratch = smem.drop + kS * Tr::kDropSlotBytes + 32 * ptid;  // (draw_drop_flags')
    if constexpr (Tr::kDropout) {
        if (ptid >= 32) drop_flags_setup<Tr>(drop_scratch, key0, ptid - 32);
    }
    // The walk. Varlen kernels instantiate it twice, for calls with reducers of their own (warps 0 and 1 then copy
    // a sequence's ragged tiles for all four warps) and the others: with that choice made per step, the head dim 128
    // producer spilled 12-64 bytes. (own_case: Const<1> or <0> there, <-1> in padded kernels: own() per step)
    const auto walk = [&](auto own_case) {
        constexpr int kCase = decltype(own_case)::value;
        const auto own_here = [&] {
            if constexpr (kCase < 0)
                return own();
            else
                return kCase == 1;
        };
        constexpr bool kSplitCopies = !Tr::kTma && kCase == 1;
        for (int it = 0, head = kv_head * args.heads_per_kv, m0 = steps.first_m0(); it < steps.count; ++it) {
            const int s = it % kS;
            mbar_wait(smem.empty(s), ((it / kS) & 1) ^ 1);
            if (Tr::kTma || args.seqlen_q - m0 >= kM) {  // (varlen: the first thread arrives for all)
                if (ptid == 0) {
                    mbar_arrive_expect_tx<Tr::kCopyArrivals>(smem.full(s), 2 * QTile::kBytes);
                    tma_load_tile<QTile>(smem.q + s * QTile::kBytes, args.tmap_q, head, q_start + m0, map_batch,
                                         smem.full(s));
                    tma_load_tile<QTile>(smem.dout + s * QTile::kBytes, args.tmap_do, head, q_start + m0, map_batch,
                                         smem.full(s));
                }
            } else if constexpr (!kSplitCopies) {
                load_tile(QTile{}, smem.q + s * QTile::kBytes,
                          args.q + batch * args.q_batch_stride + (i64)(q_start + m0) * args.q_row_stride +
                              head * args.q_head_stride,
                          args.q_row_stride, args.seqlen_q - m0, args.headdim);
                load_tile(QTile{}, smem.dout + s * QTile::kBytes,
                          args.dout + batch * args.do_batch_stride + (i64)(q_start + m0) * args.do_row_stride +
                              head * args.do_head_stride,
                          args.do_row_stride, args.seqlen_q - m0, args.headdim_v);
                cp_async_fenced_arrive(smem.full(s));
            } else if (ptid < 64) {  // (each thread its own share and that of thread ptid + 64, and arrives for both)
                load_ragged_by_two_warps<Tr>(
                    smem.q + s * QTile::kBytes, smem.dout + s * QTile::kBytes,
                    args.q + batch * args.q_batch_stride + (i64)(q_start + m0) * args.q_row_stride +
                        head * args.q_head_stride,
                    args.dout + batch * args.do_batch_stride + (i64)(q_start + m0) * args.do_row_stride +
                        head * args.do_head_stride,
                    args.q_row_stride, args.do_row_stride, args.seqlen_q - m0, ptid, args.headdim, args.headdim_v);
                cp_async_fenced_arrive<2>(smem.full(s));
            }
            if (ptid < kM) {
                smem.stats[s * kM + ptid] = lse_next * kLog2e;
                smem.stats[(kS + s) * kM + ptid] = dsum_next;
            }
            if constexpr (Tr::kDropout && kCase != 1) {
                // (warps 1-3: warp 0's first thread issues the copies and the dQ reductions, which wait for no draw;
                // after the statistics' stores, so that their registers are free; on a warp-uniform index, whose
                // predicate ptxas holds in a uniform register: per thread, it spilled 4 bytes at head dim 192)
                if (args.dropout_threshold != 0 && warp_uniform(ptid >> 5) >= 1)
                    draw_drop_flags<Tr>(smem.drop + s * Tr::kDropSlotBytes, drop_scratch,
                                        make_dropout(args.dropout_threshold, args.seed, args.offset, args.rng_state,
                                                     batch, args.nheads, head, args.dropout_scale),
                                        key0, m0, ptid - 32);
            }
            if constexpr (kOwnReducer && kM == 128) {
                if (own_here() && ptid >= 64 && ptid < 96) {  // (warp 3's rows too, and arriving for them)
                    smem.stats[s * kM + ptid + 32] = lse_next3 * kLog2e;
                    smem.stats[(kS + s) * kM + ptid + 32] = dsum_next3;
                    mbar_arrive<2>(smem.full(s));
                } else if (ptid < kM) {
                    mbar_arrive(smem.full(s));
                }
            } else if (Tr::kMods || ptid < kM) {
                mbar_arrive(smem.full(s));  // (release: the stores above)
            }
            if (it >= kLag && !own_here()) reduce_step(it - kLag, false);
            m0 += kM;  // step it + 1's query head and first row (the next head's where the walk is back at its start)
            if (m0 == (steps.m_begin + steps.m_count) * kM) m0 = steps.m_begin * kM;
            if (m0 == steps.first_m0()) ++head;
            if (it + 1 < steps.count) load_stats(head, m0, own_here());
        }
        if constexpr (!Tr::kTma) {  // (varlen: the last steps' reductions, kLag behind the loads, here: held past
            if (!own_here())      // the walk, the count's predicate spilled 4 bytes at head dim 64)
                for (int j = max(steps.count - kLag, 0); j < steps.count; ++j) reduce_step(j, false);
        }
    };
    if constexpr (kOwnReducer && !Tr::kTma) {
        if (own())
            walk(Const<1>{});
        else
            walk(Const<0>{});
    } else {
        walk(Const<kOwnReducer ? -1 : 0>{});
    }
    if constexpr (Tr::kTma) {
        if (!own()) {  // (the last steps' reductions, kLag behind the loads)
            if (kLag == 2 && steps.count >= 2) reduce_step(steps.count - 2, false);
            if (steps.count >= 1) reduce_step(steps.count - 1, false);
        }
    }
    bulk_wait<0>();
    if (ptid == 0 && args.dq_semaphore != nullptr && !args.deterministic) {
        for (int i = 0; i < 2; ++i) {
            const int uncounted = ld_shared_s32(smem.uncounted() + 4 * i);
            if (uncounted >= 0) pass_turn(args.dq_semaphore + uncounted);
        }
    }
    if (ptid == 0) bwd_mark(6);  // the producer's end
    cp_async_wait_all();  // leave nothing in flight into shared memory
}

}  // namespace fa2
