// The Hopper backward's consumer warpgroups: per step, S^T = K Q^T and dP^T = V dO^T, P^T and dS^T in registers,
// dV += P^T dO and dK += dS^T Q, dQ_i = dS K staged for the producer's reduction; at the end dK and dV out. The
// stores of dS^T and of dK/dV (stmatrix) stay in consume_dkdv: compiled as functions of their own, they left ptxas
// to place the accumulators in other registers.
#pragma once
#include "common/types.cuh"
#include "common/math.cuh"
#include "common/warp.cuh"
#include "sm80/memory.cuh"
#include "sm80/mma.cuh"
#include "sm80/tile_mma.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/warpgroup.cuh"
#include "sm90/wgmma.cuh"
#include "sm90/slabs.cuh"
#include "attention/masks.cuh"
#include "hopper/bwd_traits.cuh"

namespace fa2 {

// S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys (K and V rows at k_rows and v_rows, the step's Q
// and dO tiles at q_s and do_s), both operands from shared memory: k16 steps 32 bytes apart in a slab, then the
// next slab, over the score products' head dim (HopperBwdTraits::kScoreDim).
template <class Tr>
FA2_DEVICE void issue_st_dpt(float (&st)[1][Tr::kBlockM / 8][4], float (&dpt)[1][Tr::kBlockM / 8][4], u32 k_rows,
                             u32 v_rows, u32 q_s, u32 do_s) {
    using KVTile = typename Tr::KVTile;
    using QTile = typename Tr::QTile;
    using Elem = typename Tr::Elem;
    constexpr int kM = Tr::kBlockM, kKSteps = Tr::kScoreKSteps;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        const u32 step = (kk >> 2) * KVTile::kSlabBytes + (kk & 3) * 32;
        const u32 q_step = (kk >> 2) * QTile::kSlabBytes + (kk & 3) * 32;
        Wgmma<Elem, kM>::ss(st, smem_desc_sw128(k_rows + step, 16), smem_desc_sw128(q_s + q_step, 16), kk > 0);
    }
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        const u32 step = (kk >> 2) * KVTile::kSlabBytes + (kk & 3) * 32;
        const u32 q_step = (kk >> 2) * QTile::kSlabBytes + (kk & 3) * 32;
        Wgmma<Elem, kM>::ss(dpt, smem_desc_sw128(v_rows + step, 16), smem_desc_sw128(do_s + q_step, 16), kk > 0);
    }
}

// This thread's part of the 64 rows of half `mh` of dQ_i (its fp32 accumulators) into the staging tile at dq_tile,
// for the producer's bulk reduction (one per step); `adds`: added to what the same thread of warpgroup 0 stored there.
template <class Tr>
FA2_DEVICE void stage_dq(const float (&acc_dq)[1][Tr::kDqCols / 8][4], u32 dq_tile, int mh, int w4, int lane,
                         int dq_col0, bool adds) {
#pragma unroll
    for (int nt = 0; nt < Tr::kDqCols / 8; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = 64 * mh + 16 * w4 + (lane >> 2) + 8 * half;
            const int col = dq_col0 + nt * 8 + (lane & 3) * 2;
            const u32 at = dq_tile + (row * Tr::kDqPitch + col) * 4;
            float x = acc_dq[0][nt][2 * half], y = acc_dq[0][nt][2 * half + 1];
            if (adds) {  // the same thread of warpgroup 0 stored these two
                float x0, y0;
                ld_shared_v2_f32(at, x0, y0);
                x += x0, y += y0;
            }
            st_shared_v2_f32(at, x, y);
        }
}

// Half `mh` of dQ_i = dS K over this warpgroup's share (dQ's columns from dq_col0 over keys from dq_key0), dS^T and
// K read MN-major as stored (the dS^T tile at ds_buf, K at k_tile).
template <class Tr>
FA2_DEVICE void issue_dq(float (&acc_dq)[1][Tr::kDqCols / 8][4], u32 ds_buf, u32 k_tile, int mh, int dq_key0,
                         int dq_col0) {
    using KVTile = typename Tr::KVTile;
    using DsTile = typename Tr::DsTile;
#pragma unroll
    for (int kk = 0; kk < Tr::kDqKeys / 16; ++kk)
        Wgmma<typename Tr::Elem, Tr::kDqCols>::ss_mn(
            acc_dq, smem_desc_sw128(DsTile::at(ds_buf, dq_key0 + kk * 16, 64 * mh), DsTile::kSlabBytes),
            smem_desc_sw128(KVTile::at(k_tile, dq_key0 + kk * 16, dq_col0), KVTile::kSlabBytes), kk > 0);
}

// dV += P^T dO and dK += dS^T Q: P^T and dS^T as register A operands, dO and Q (the step's tiles at do_s and q_s)
// read MN-major as stored.
template <class Tr>
FA2_DEVICE void issue_dv_dk(float (&acc_dv)[1][Tr::kHeadDim / 8][4], float (&acc_dk)[1][Tr::kHeadDim / 8][4],
                            const u32 (&pa)[Tr::kBlockM / 16][4], const u32 (&dsa)[Tr::kBlockM / 16][4], u32 q_s,
                            u32 do_s) {
    using QTile = typename Tr::QTile;
    using Elem = typename Tr::Elem;
    constexpr int kQT = Tr::kBlockM / 8;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kQT / 2; ++kk)
        Wgmma<Elem, Tr::kHeadDim>::rs_mn(acc_dv, pa[kk], smem_desc_sw128(QTile::at(do_s, kk * 16, 0),
                                                                          QTile::kSlabBytes), 1);
#pragma unroll
    for (int kk = 0; kk < kQT / 2; ++kk)
        Wgmma<Elem, Tr::kHeadDim>::rs_mn(acc_dk, dsa[kk], smem_desc_sw128(QTile::at(q_s, kk * 16, 0),
                                                                           QTile::kSlabBytes), 1);
}

// P^T = exp(S^T scale - L) and dS^T = P^T o (dP^T - D) in place, this thread's scores (keys key_lo and key_lo + 8;
// their key - query offsets from key_offset): L and D of the step's queries from lse_s and dsum_s, masked(offset,
// key) saying which scores are masked (P = 0).
template <class Tr, class Masked>
FA2_DEVICE void scores_to_ds(float (&st)[1][Tr::kBlockM / 8][4], float (&dpt)[1][Tr::kBlockM / 8][4],
                             const float* lse_s, const float* dsum_s, const Masked& masked, int key_lo,
                             int key_offset, int lane, float scale_log2) {
    constexpr int kQT = Tr::kBlockM / 8;
#pragma unroll
    for (int nt = 0; nt < kQT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int qc = nt * 8 + (lane & 3) * 2 + (e & 1), key = key_lo + (e >> 1) * 8;
            float p = fast_exp2(st[0][nt][e] * scale_log2 - lse_s[qc]);
            if (masked(key_offset + (e >> 1) * 8 - nt * 8 - (e & 1), key)) p = 0.f;
            dpt[0][nt][e] = p * (dpt[0][nt][e] - dsum_s[qc]);
            st[0][nt][e] = p;
        }
    }
}

// The logit of raw score s as the Hopper forward forms it (Cap, a softcap: cap tanh(scale s / cap) by fast_tanh;
// else scale s), less ALiBi's slope |distance| (slope 0 without ALiBi); dcap = dlogit / d(scale s), 1 - tanh^2 with
// a softcap.
template <bool Cap>
FA2_DEVICE float modified_logit(float s, const ScoreMods& mods, float distance, float& dcap) {
    float logit;
    if constexpr (Cap) {
        const float t = fast_tanh(s * mods.cap_inv);
        dcap = fmaf(-t, t, 1.f);
        logit = mods.cap * t;
    } else {
        dcap = 1.f;
        logit = s * mods.scale;
    }
    return fmaf(-mods.slope, fabsf(distance), logit);
}

// P^T of raw score s, unmasked, against *lse_log2 (L in the log2 domain): exp(logit - L) with the score modifiers
// (Mods: modified_logit, dcap its derivative), or without them (dropout alone) exp(scale s - L), the scale folded
// into the exponent as in scores_to_ds, dcap 1. (L is read after the logit is formed: read before, as an argument,
// ptxas scheduled the rows otherwise.)
template <bool Cap, bool Mods>
FA2_DEVICE float step_p(float s, const float* lse_log2, float scale_log2, const ScoreMods& mods, float distance,
                        float& dcap) {
    if constexpr (Mods) {
        const float logit = modified_logit<Cap>(s, mods, distance, dcap);
        return fast_exp2(logit * kLog2e - *lse_log2);
    }
    dcap = 1.f;
    return fast_exp2(s * scale_log2 - *lse_log2);
}

// A step's case of the modifier rows as compile-time switches, run(Bool<Cap>, Bool<Drop>, Bool<Mods>) (step_p's
// and DropBits'): chosen once per step (uniform), not per score: with the switch in the loop ptxas serialised the
// d = 128 kernel's wgmmas (C7512). Without dropout the modifiers are on (slope 0 without ALiBi).
template <class Tr, class Run>
FA2_DEVICE void with_step_case(const ScoreMods& mods, bool drop, const Run& run) {
    if constexpr (Tr::kAlibiOnly) {  // (ALiBi alone: the modifiers on, no softcap, no dropout)
        run(Bool<false>{}, Bool<false>{}, Bool<true>{});
    } else if (Tr::kDropout && drop) {
        if (!mods.on())
            run(Bool<false>{}, Bool<true>{}, Bool<false>{});  // (dropout alone)
        else if (mods.cap > 0.f)
            run(Bool<true>{}, Bool<true>{}, Bool<true>{});
        else
            run(Bool<false>{}, Bool<true>{}, Bool<true>{});
    } else if (mods.cap > 0.f) {
        run(Bool<true>{}, Bool<false>{}, Bool<true>{});
    } else {
        run(Bool<false>{}, Bool<false>{}, Bool<true>{});
    }
}

// Dropout's keep flags of this thread's scores in the step (the producer's draw_drop_flags): of the 16-bit entries
// of its pair (lane l of warps 2 kbi and 2 kbi + 1 of the threads that form P^T), its own byte (the low one in warp
// 2 kbi, the high one in warp 2 kbi + 1) of entry 2 qb + e1 for 32-query block qb and query parity e1, bit 2 a + eh
// (query member a, key half eh) set where the score is dropped. Each byte is read where its eight scores are formed
// (held across the step, the flags took a register the modifier rows at head dim 128 do not have).
template <class Tr>
struct DropBits {
    u32 at;
    FA2_DEVICE DropBits(u32 flags, int thread)
        : at(flags + (32 * (thread >> 6) + (thread & 31)) * Tr::kDropPairBytes + (thread >> 5 & 1)) {}
    FA2_DEVICE u32 byte(int qb, int e1) const {
        u32 v;
        asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(at + (2 * qb + e1) * 2));
        return v;
    }
    // z of score (a, eh) of `flags` (byte()): keep_scale (256 / threshold) where kept, 0 where dropped.
    static FA2_DEVICE float factor(float keep_scale, u32 flags, int a, int eh) {
        return (flags >> (2 * a + eh) & 1u) ? 0.f : keep_scale;
    }
};

// Each of this thread's scores in a step of the modifier rows, in the order of its dropout flags (32-query block qb,
// query parity e1, query member a, key half eh): P^T by step_p (0 where masked), the softcap's derivative dcap and,
// with Drop, dropout's factor z (DropBits::factor; 1 without), handed to score(nt, e, qc, a, p, dcap, z) (qc: the
// score's query column in the step), and block_done(qb) after each 32-query block. The narrow rows'
// scores_to_ds_mods_of and the wide rows' wide_p_mods take their scores so.
template <class Tr, bool Cap, bool Drop, bool Mods, class Masked, class Score, class BlockDone>
FA2_DEVICE void for_each_step_score(const float (&st)[1][Tr::kBlockM / 8][4], const float* lse_s,
                                    const Masked& masked, int key_lo, int key_offset, int lane, const ScoreMods& mods,
                                    int m0, const DropBits<Tr>& drop, float keep_scale, const Score& score,
                                    const BlockDone& block_done) {
    constexpr int kQT = Tr::kBlockM / 8;
    static_assert(kQT % 4 == 0, "query steps of whole 32-query blocks (dropout's)");
    const float scale_log2 = mods.scale * kLog2e;
    // distance of this thread's first score (query m0 + (lane & 3) * 2, key key_lo): query + diag - key
    const float d0 = static_cast<float>(m0 + mods.diag - key_offset);
#pragma unroll
    for (int qb = 0; qb < kQT / 4; ++qb) {
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
            const u32 flags = Drop ? drop.byte(qb, e1) : 0u;
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int eh = 0; eh < 2; ++eh) {
                    const int nt = 4 * qb + a, e = 2 * eh + e1;
                    const int qc = nt * 8 + (lane & 3) * 2 + e1, key = key_lo + eh * 8;
                    const int offset = key_offset + eh * 8 - nt * 8 - e1;  // key - qc
                    const float distance = d0 + static_cast<float>(key_offset - offset);  // (a constant step from d0)
                    float dcap;
                    float p = step_p<Cap, Mods>(st[0][nt][e], lse_s + qc, scale_log2, mods, distance, dcap);
                    if (masked(offset, key)) p = 0.f;
                    score(nt, e, qc, a, p, dcap, Drop ? DropBits<Tr>::factor(keep_scale, flags, a, eh) : 1.f);
                }
        }
        block_done(qb);
    }
}

// One case of scores_to_ds_mods (below) (with_step_case's switches). Drop: dropout (keep flags `drop`), dV's P^T the
// dropped one, P^T o Z / (1 - p), and dS^T = P^T o (Z o dP^T / (1 - p) - D) (dP of the dropped output).
template <class Tr, bool Cap, bool Drop, bool Mods, class Masked>
FA2_DEVICE void scores_to_ds_mods_of(float (&st)[1][Tr::kBlockM / 8][4], float (&dpt)[1][Tr::kBlockM / 8][4],
                                     const float* lse_s, const float* dsum_s, const Masked& masked, int key_lo,
                                     int key_offset, int lane, const ScoreMods& mods, int m0,
                                     const DropBits<Tr>& drop, float keep_scale) {
    for_each_step_score<Tr, Cap, Drop, Mods>(
        st, lse_s, masked, key_lo, key_offset, lane, mods, m0, drop, keep_scale,
        [&](int nt, int e, int qc, int, float p, float dcap, float z) {
            if constexpr (Drop) {
                dpt[0][nt][e] = p * (dpt[0][nt][e] * z - dsum_s[qc]) * dcap;
                p *= z;
            } else {
                dpt[0][nt][e] = p * (dpt[0][nt][e] - dsum_s[qc]) * dcap;
            }
            st[0][nt][e] = p;
        },
        [](int) {});
}

// scores_to_ds with score modifiers (ScoreMods of the step's query head) and dropout: P^T = exp(logit - L), dS^T =
// P^T o (dP^T - D) o dlogit / d(scale s) (with dropout as scores_to_ds_mods_of says; `drop_flags`: the step's keep
// flags, read only with dropout on); the step's first query row m0 gives each score's ALiBi distance.
template <class Tr, class Masked>
FA2_DEVICE void scores_to_ds_mods(float (&st)[1][Tr::kBlockM / 8][4], float (&dpt)[1][Tr::kBlockM / 8][4],
                                  const float* lse_s, const float* dsum_s, const Masked& masked, int key_lo,
                                  int key_offset, int lane, const ScoreMods& mods, int m0,
                                  const HopperBwdArgs& args, u32 drop_flags, int thread) {
    const DropBits<Tr> drop(drop_flags, thread);
    with_step_case<Tr>(mods, args.dropout_threshold != 0, [&](auto cap, auto dropping, auto modify) {
        scores_to_ds_mods_of<Tr, decltype(cap)::value, decltype(dropping)::value, decltype(modify)::value>(
            st, dpt, lse_s, dsum_s, masked, key_lo, key_offset, lane, mods, m0, drop, args.dropout_scale);
    });
}

// dK and dV, staged in the K and V tiles, out to dk and dv: each 16-byte chunk of the rows these threads staged
// (sync_tid of the consumers that met), rows of the sequence and columns of the arrays' head dim only.
template <class Tr>
FA2_DEVICE void write_out_dk_dv(const HopperBwdSmem<Tr>& smem, const HopperBwdArgs& args, const int& wg,
                                const int& sync_tid, const int& batch, const int& kv_head, const int& key0,
                                const int& k_start) {
    using KVTile = typename Tr::KVTile;
    constexpr int kN = Tr::kBlockN;
    constexpr int kSyncThreads = Tr::kDqByKeys ? 128 : Tr::kConsumerThreads;
    u16* dk_rows = args.dk + batch * args.dk_batch_stride + kv_head * args.dk_head_stride;
    u16* dv_rows = args.dv + batch * args.dv_batch_stride + kv_head * args.dv_head_stride;
    constexpr int kChunksPerRow = Tr::kHeadDim / 8;
    constexpr int kSyncRows = kN * kSyncThreads / Tr::kConsumerThreads;  // the rows these threads staged
    const int row0 = Tr::kDqByKeys ? 64 * wg : 0;
    for (int idx = sync_tid; idx < kSyncRows * kChunksPerRow; idx += kSyncThreads) {
        const int r = row0 + idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
        if (key0 + r < args.seqlen_k && c < args.headdim) {
            u32 chunk[4];
            ld_shared_v4(KVTile::at(smem.k, r, c), chunk);
            st_global_v4(dk_rows + (i64)(k_start + key0 + r) * args.dk_row_stride + c, chunk);
            if (Tr::kVDim == Tr::kHeadDim || c < Tr::kVDim) {  // (dV's columns)
                ld_shared_v4(KVTile::at(smem.v, r, c), chunk);
                st_global_v4(dv_rows + (i64)(k_start + key0 + r) * args.dv_row_stride + c, chunk);
            }
        }
    }
}

template <class Tr, class BlockSteps>
FA2_DEVICE void consume_dkdv(const HopperBwdSmem<Tr>& smem, const HopperBwdArgs& args,
                             const WindowMask<Tr::kMask>& mask, const BlockSteps& block_steps, const int& kv_head,
                             const int& batch, const int& key0, const int& q_start, const int& k_start,
                             const int& warp, const int& lane) {
    using KVTile = typename Tr::KVTile;
    using QTile = typename Tr::QTile;
    using DsTile = typename Tr::DsTile;
    using Elem = typename Tr::Elem;
    using Steps = HopperBwdSteps<Tr::kBlockM>;
    constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kS = Tr::kStages;
    constexpr int kDT = Tr::kHeadDim / 8, kQT = kM / 8;
    // Warpgroup wg owns keys 64 wg .. 64 wg + 63 of the tile (warp w of it 16 of them) for S^T, dP^T, dK and dV,
    // and dQ_i's columns dq_col0 .. + kDqCols over keys dq_key0 .. + kDqKeys.
    const int wg = warp_uniform(warp >> 2), w4 = warp & 3, ctid = threadIdx.x;
    const int dq_key0 = Tr::kDqByKeys ? 64 * wg : 0, dq_col0 = Tr::kDqByKeys ? 0 : Tr::kDqCols * wg;
    // The threads that meet once dS^T is in and at the dK/dV write, and their index: both warpgroups (barrier
    // kBwdConsumers), or with dQ_i split by keys each warpgroup alone (kBwdConsumers + wg), as each then reads only
    // its own rows of dS^T, K and V. The staged dQ_i goes to the producer (dq_staged), which hands the tile back once
    // its reduction has read it (dq_free). By keys the two partial dQ_i meet in one staging tile (a pair, by the
    // step's parity): warpgroup 0 stores its part of each 64-row half, both meet (barrier kBwdDqHandoff), then
    // warpgroup 1 adds its own and hands the tile on.
    constexpr int kSyncThreads = Tr::kDqByKeys ? 128 : Tr::kConsumerThreads;
    const int sync_tid = Tr::kDqByKeys ? ctid - 128 * wg : ctid;
    const auto consumers_sync = [&] {
        if constexpr (Tr::kDqByKeys)
            named_barrier_sync(kBwdConsumers + wg, 128);
        else
            named_barrier_sync<kBwdConsumers, Tr::kConsumerThreads>();
    };
    const u32 k_rows = KVTile::at(smem.k, 64 * wg, 0), v_rows = KVTile::at(smem.v, 64 * wg, 0);
    float acc_dk[1][kDT][4], acc_dv[1][kDT][4];
    zero_fragments(acc_dk);
    zero_fragments(acc_dv);
    const int key_lo = key0 + 64 * wg + 16 * w4 + (lane >> 2);  // this thread's keys: key_lo, key_lo + 8
    const int key_offset = key_lo - (lane & 3) * 2;  // its first score's key minus query offset (query m0 + 0)
    mbar_wait(smem.kv_full, 0);
    if (ctid == 0) bwd_mark(1);  // K and V in
    const Steps steps = block_steps();
    // Step it's first query row, walked as the producer does (steps.m0 takes a run-time division a step).
    const int m_first = steps.m_begin * kM, m_last = (steps.m_begin + steps.m_count - 1) * kM;
    const int m_stop = steps.m_shift != 0 ? steps.first_m0() - kM : m_last;  // (a head's last step, then the next)
    int head = kv_head * args.heads_per_kv;  // the step's query head (with modifiers: its ALiBi slope's)
    for (int it = 0, m0 = steps.first_m0(); it < steps.count;
         ++it, head += m0 == m_stop, m0 = m0 == m_last ? m_first : m0 + kM) {
        const int s = it % kS;
        const u32 q_s = smem.q + s * QTile::kBytes, do_s = smem.dout + s * QTile::kBytes;
        mbar_wait(smem.full(s), (it / kS) & 1);
        if (ctid == 0 && it == 0) bwd_mark(2);  // the first step's Q, dO, lse and D in

        float st[1][kQT][4], dpt[1][kQT][4];
        issue_st_dpt<Tr>(st, dpt, k_rows, v_rows, q_s, do_s);
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(st);
        pin_registers(dpt);

        // P^T = exp(S^T scale - L) and dS^T = P^T o (dP^T - D), in place.
        const float* lse_s = smem.stats + s * kM;
        const float* dsum_s = smem.stats + (kS + s) * kM;
        // Which scores are masked: the test itself on every score, key < seqlen_k and, for a mask, the score's
        // key - query offset against the step's band (uniform). With a per-tile branch around it
        // (tile_needs_mask) or through visible(), ptxas kept more registers live and serialised the wgmma (C7512)
        // or spilled at 128 query rows; at 64 the visible() form measured 5% slower causal (docs/design.md).
        const int band_hi = m0 + mask.diag() + mask.right(), band_lo = m0 + mask.diag() - mask.left();
        const auto masked = [&](int offset, int key) {  // offset: key - (query - m0)
            return key >= args.seqlen_k || (Tr::kMask != kMaskNone && offset > band_hi) ||
                   (Tr::kMask == kMaskWindow && offset < band_lo);
        };
        if constexpr (Tr::kMods)
            scores_to_ds_mods<Tr>(st, dpt, lse_s, dsum_s, masked, key_lo, key_offset, lane,
                                  make_score_mods(args.scale, args.softcap,
                                                  alibi_slope(args.alibi_slopes, args.alibi_batch_stride, batch, head),
                                                  args.seqlen_q, args.seqlen_k),
                                  m0, args, smem.drop + s * Tr::kDropSlotBytes, ctid);
        else
            scores_to_ds<Tr>(st, dpt, lse_s, dsum_s, masked, key_lo, key_offset, lane, args.scale_log2);
        u32 pa[kQT / 2][4], dsa[kQT / 2][4];  // P^T and dS^T as A operands, k16 steps over the queries
#pragma unroll
        for (int kk = 0; kk < kQT / 2; ++kk) {
            c_to_a<Elem>(pa[kk], st[0][2 * kk], st[0][2 * kk + 1]);
            c_to_a<Elem>(dsa[kk], dpt[0][2 * kk], dpt[0][2 * kk + 1]);
        }
        // dS^T into this iteration's dQ operand buffer (stmatrix of the same packed registers).
        const u32 ds_buf = smem.ds + (it % Tr::kDsTiles) * DsTile::kBytes;
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int group = 0; group < kQT / 4; ++group) {
                u32 x[4];
#pragma unroll
                for (int p = 0; p < 4; ++p) x[p] = dsa[2 * group + p / 2][(p % 2) * 2 + half];
                stmatrix_x4(
                    DsTile::at(ds_buf, 64 * wg + 16 * w4 + 8 * half + (lane & 7), (4 * group + (lane >> 3)) * 8), x);
            }

        // dV += P^T dO, dK += dS^T Q (the scale of S applied to dK at the end).
        issue_dv_dk<Tr>(acc_dv, acc_dk, pa, dsa, q_s, do_s);
        wgmma_commit();

        // dQ_i = dS K over this warpgroup's keys, so their dS^T must be in (by columns: both warpgroups').
        fence_proxy_async_smem();
        consumers_sync();
        // With 128 query rows, dQ_i in its two 64-row halves one after the other (wgmma's M is 64): the second
        // half's accumulators take the registers P^T and dS^T leave once the first wait is over.
        constexpr int kDqHalves = kM / 64;
        const int dq_t = it % Tr::kDqTiles;
        const u32 dq_tile = smem.dq + dq_t * Tr::kDqBytes;
        const bool adds = Tr::kDqByKeys && wg == 1;  // (by keys: warpgroup 1 adds to warpgroup 0's part)
#pragma unroll
        for (int mh = 0; mh < kDqHalves; ++mh) {
            float acc_dq[1][Tr::kDqCols / 8][4];
            if (mh > 0) wgmma_fence();  // (the first half's registers were just read by the staging stores)
            issue_dq<Tr>(acc_dq, ds_buf, smem.k, mh, dq_key0, dq_col0);
            wgmma_commit();
            wgmma_wait<0>();
            pin_registers(acc_dv);
            pin_registers(acc_dk);
            pin_registers(acc_dq);
            if (mh == 0) {
                pin_registers(pa);
                pin_registers(dsa);
                mbar_arrive(smem.empty(s));  // Q, dO, lse and D of slot s are read
                // The producer's reduction has read this tile's last dQ (kDqTiles steps back).
                if (!adds && it >= Tr::kDqTiles) mbar_wait(smem.dq_free(dq_t), ((it / Tr::kDqTiles) - 1) & 1);
            }
            if (adds) named_barrier_sync(kBwdDqHandoff, Tr::kConsumerThreads);  // warpgroup 0's part is in

            // dQ_i into the staging tile, for the producer's bulk reduction (one per step).
            stage_dq<Tr>(acc_dq, dq_tile, mh, w4, lane, dq_col0, adds);
            if (Tr::kDqByKeys && !adds) named_barrier_sync(kBwdDqHandoff, Tr::kConsumerThreads);  // (stored)
        }
        if (Tr::kDqByKeys && !adds) continue;  // (by keys warpgroup 1 stores the sums)
        fence_proxy_async_smem();  // dQ_i to the producer, which issues its reduction
        __syncwarp();
        if (lane == 0) mbar_arrive(smem.dq_staged(dq_t));
        if (ctid == 0 && it == 0) bwd_mark(3);  // the first step done
    }
    if (ctid == 0) bwd_mark(4);  // the last step done

    // dK = scale dS^T Q and dV, staged in the K and V tiles (once the warpgroups that read these rows are done
    // with them) so that the global stores are 16-byte and row-contiguous. (stmatrix written out as in
    // hopper/fwd.cu's row write, not through a shared helper: that changed both kernels' code, docs/design.md.)
    consumers_sync();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int group = 0; group < kDT / 4; ++group) {
            u32 xk[4], xv[4];
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                xk[p] = Mma<Elem>::pack(acc_dk[0][4 * group + p][2 * half] * args.scale,
                                        acc_dk[0][4 * group + p][2 * half + 1] * args.scale);
                xv[p] = Mma<Elem>::pack(acc_dv[0][4 * group + p][2 * half], acc_dv[0][4 * group + p][2 * half + 1]);
            }
            const int row = 64 * wg + 16 * w4 + 8 * half + (lane & 7), col = (4 * group + (lane >> 3)) * 8;
            stmatrix_x4(KVTile::at(smem.k, row, col), xk);
            stmatrix_x4(KVTile::at(smem.v, row, col), xv);
        }
    }
    consumers_sync();
    write_out_dk_dv<Tr>(smem, args, wg, sync_tid, batch, kv_head, key0, k_start);
    if (ctid == 0) bwd_mark(5);  // dK and dV written (issued)
}

}  // namespace fa2
