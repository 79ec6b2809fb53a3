// The Hopper backward's consumer warpgroups at the wide head dims (192, 256), where a warpgroup cannot hold both
// dK and dV of 64 keys (2 x 64 x 256 / 128 = 256 registers a thread at 256). Both warpgroups work on the block's
// 64 keys and split the products by role: per step warpgroup 0 computes S^T = K Q^T, P^T = exp(S^T scale - L) and
// dV += P^T dO; warpgroup 1 computes dP^T = V dO^T, dS^T = P^T o (dP^T - D) with warpgroup 0's P^T (fp32, handed
// over in shared memory at barrier kBwdPReady), and dK += dS^T Q, storing dS^T for dQ_i = dS K, which they split by
// columns (warpgroup 0 columns 0-127, warpgroup 1 the rest). Each holds one 64 x HeadDim accumulator (HeadDim / 2
// registers), its 64 x 64 scores (32) and its share of dQ_i (64 or 32). Score modifiers (softcap, ALiBi) and dropout
// are warpgroup 0's alone: it forms P^T from the modified logits (and the producer's dropout flags) and hands over
// P^T times the softcap's derivative, negated where dropout drops the score.
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
#include "hopper/bwd_consumer.cuh"

namespace fa2 {

// This warpgroup's Cols columns of dQ_i = dS K from column col0 (all 64 keys: dS^T and K read MN-major as stored),
// Chunk columns at a time, each waited for, then staged into the fp32 tile for the producer's reduction once the
// producer has read the last one (dq_free, from step `it` >= 1 on).
template <class Tr, int Cols, int Chunk>
FA2_DEVICE void dq_wide(const HopperBwdSmem<Tr>& smem, int it, int col0, int w4, int lane) {
    using KVTile = typename Tr::KVTile;
    using DsTile = typename Tr::DsTile;
    static_assert(Cols % Chunk == 0, "whole chunks");
#pragma unroll
    for (int c = 0; c < Cols / Chunk; ++c) {
        float acc_dq[1][Chunk / 8][4];
        wgmma_fence();  // (its own: in a branch of its own, ptxas otherwise injects one, C7519)
#pragma unroll
        for (int kk = 0; kk < Tr::kBlockN / 16; ++kk)
            Wgmma<typename Tr::Elem, Chunk>::ss_mn(
                acc_dq, smem_desc_sw128(DsTile::at(smem.ds, kk * 16, 0), DsTile::kSlabBytes),
                smem_desc_sw128(KVTile::at(smem.k, kk * 16, col0 + c * Chunk), KVTile::kSlabBytes), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(acc_dq);
        if (c == 0 && it >= 1) mbar_wait(smem.dq_free(0), (it - 1) & 1);
#pragma unroll
        for (int nt = 0; nt < Chunk / 8; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = 16 * w4 + (lane >> 2) + 8 * half, col = col0 + c * Chunk + nt * 8 + (lane & 3) * 2;
                st_shared_v2_f32(smem.dq + (row * Tr::kDqPitch + col) * 4, acc_dq[0][nt][2 * half],
                                 acc_dq[0][nt][2 * half + 1]);
            }
    }
}

// Warpgroup 0's P^T with score modifiers (ScoreMods of the step's query head; with_step_case's switches). P^T =
// exp(logit - L) (for_each_step_score, as in scores_to_ds_mods_of) stays in `st` (dV's operand), and P^T o dlogit /
// d(scale s) goes to warpgroup 1 at `px` (its dS^T = that o (dP^T - D)), so the softcap's derivative needs no
// registers of warpgroup 1. Drop: dropout (the step's keep flags `drop`), `st` the dropped P^T o Z / (1 - p), and
// what goes to warpgroup 1 negated where the score is dropped (P^T >= 0: the sign is free), so that it finds Z
// without the flags (dS^T = |x| o (Z o dP^T - D)).
template <class Tr, bool Cap, bool Drop, bool Mods, class Masked>
FA2_DEVICE void wide_p_mods(float (&st)[1][Tr::kBlockM / 8][4], float4* px, const float* lse_s, const Masked& masked,
                            int key_lo, int key_offset, int lane, int wtid, const ScoreMods& mods, int m0,
                            const DropBits<Tr>& drop, float keep_scale) {
    float pd[4][4];  // [query member][e] of the 32-query block at hand
    for_each_step_score<Tr, Cap, Drop, Mods>(
        st, lse_s, masked, key_lo, key_offset, lane, mods, m0, drop, keep_scale,
        [&](int nt, int e, int, int a, float p, float dcap, float z) {
            pd[a][e] = p * dcap;
            if constexpr (Drop) {
                if (z == 0.f) pd[a][e] = -pd[a][e];
                p *= z;
            }
            st[0][nt][e] = p;
        },
        [&](int qb) {
#pragma unroll
            for (int a = 0; a < 4; ++a)
                px[(4 * qb + a) * 128 + wtid] = make_float4(pd[a][0], pd[a][1], pd[a][2], pd[a][3]);
        });
}

template <class Tr, class BlockSteps>
FA2_DEVICE void consume_dkdv_wide(const HopperBwdSmem<Tr>& smem, const HopperBwdArgs& args,
                                  const WindowMask<Tr::kMask>& mask, const BlockSteps& block_steps,
                                  const int& kv_head, const int& batch, const int& key0, const int& q_start,
                                  const int& k_start, const int& warp, const int& lane) {
    using KVTile = typename Tr::KVTile;
    using QTile = typename Tr::QTile;
    using DsTile = typename Tr::DsTile;
    using Elem = typename Tr::Elem;
    using Steps = HopperBwdSteps<Tr::kBlockM>;
    constexpr int kM = Tr::kBlockM, kS = Tr::kStages, kThreads = Tr::kConsumerThreads;
    constexpr int kKSteps = Tr::kScoreKSteps, kVKSteps = Tr::kVKSteps, kDT = Tr::kHeadDim / 8, kQT = kM / 8;
    // (S^T's k16 steps; dP^T's, fewer where v is narrower)
    static_assert(kM == 64 && Tr::kBlockN == 64, "64 keys by 64 query rows");
    // At head dim 256 dV or dK is waited for before dQ_i is issued: with P^T or dS^T (16 registers) held across
    // dQ_i beside the 128 of the accumulator and the 64 of dQ_i, the consumers spilled 56 bytes at 240 registers.
    constexpr bool kWaitBeforeDq = Tr::kHeadDim == 256;
    // dQ_i's columns a wgmma at a time: all of a warpgroup's, but 64 at head dim 256 with varlen, whose consumers
    // work in 224 registers (HopperBwdTraits: the producer's cp.async path needs more than 24).
    constexpr int kDqChunk = Tr::kHeadDim == 256 && Tr::kVarlen ? 64 : 128;
    // Warp w4 of each warpgroup holds keys 16 w4 .. 16 w4 + 15 of the tile: the same scores in both warpgroups,
    // so thread wtid of warpgroup 1 reads the P^T that thread wtid of warpgroup 0 stored.
    const int wg = warp_uniform(warp >> 2), w4 = warp & 3, ctid = threadIdx.x, wtid = ctid - 128 * wg;
    float4* const px = reinterpret_cast<float4*>(smem.stats) - Tr::kPxBytes / 16;  // (just below the statistics)
    // S^T from K and Q (warpgroup 0) or dP^T from V and dO (warpgroup 1): the same instructions on other operands.
    const u32 rows_a = wg == 0 ? smem.k : smem.v;
    float acc[1][kDT][4];  // dV (warpgroup 0) or dK (warpgroup 1)
    zero_fragments(acc);
    const int key_lo = key0 + 16 * w4 + (lane >> 2);  // this thread's keys: key_lo, key_lo + 8
    const int key_offset = key_lo - (lane & 3) * 2;  // its first score's key minus query offset (query m0 + 0)
    mbar_wait(smem.kv_full, 0);
    if (ctid == 0) bwd_mark(1);  // K and V in
    const Steps steps = block_steps();
    const int m_first = steps.m_begin * kM, m_last = (steps.m_begin + steps.m_count - 1) * kM;
    for (int it = 0, m0 = steps.first_m0(); it < steps.count; ++it, m0 = m0 == m_last ? m_first : m0 + kM) {
        const int s = kS == 1 ? 0 : it % kS;
        const u32 q_s = smem.q + s * QTile::kBytes, do_s = smem.dout + s * QTile::kBytes;
        // S^T's B (Q) and dV's B (dO) for warpgroup 0, dP^T's (dO) and dK's (Q) for warpgroup 1.
        const u32 b_first = wg == 0 ? q_s : do_s, b_second = wg == 0 ? do_s : q_s;
        mbar_wait(smem.full(s), (it / kS) & 1);
        if (ctid == 0 && it == 0) bwd_mark(2);  // the first step's Q, dO, lse and D in

        float st[1][kQT][4];
        const auto scores = [&](auto k_steps) {
            wgmma_fence();  // (in each branch: ptxas otherwise injects one, C7519)
#pragma unroll
            for (int kk = 0; kk < decltype(k_steps)::value; ++kk) {
                const u32 step = (kk >> 2) * KVTile::kSlabBytes + (kk & 3) * 32;
                const u32 q_step = (kk >> 2) * QTile::kSlabBytes + (kk & 3) * 32;
                Wgmma<Elem, kM>::ss(st, smem_desc_sw128(rows_a + step, 16), smem_desc_sw128(b_first + q_step, 16),
                                    kk > 0);
            }
            wgmma_commit();
        };
        if (kVKSteps == kKSteps || wg == 0)  // (dP^T's k16 steps stop at v's head dim)
            scores(Const<kKSteps>{});
        else
            scores(Const<kVKSteps>{});
        wgmma_wait<0>();
        pin_registers(st);

        u32 a[kQT / 2][4];  // P^T (warpgroup 0) or dS^T (warpgroup 1) as A operands, k16 steps over the queries
        if (wg == 0 && Tr::kMods) {
            // P^T with the score modifiers and dropout (wide_p_mods), switched once per step (with_step_case).
            const float* lse_s = smem.stats + s * kM;
            const int band_hi = m0 + mask.diag() + mask.right(), band_lo = m0 + mask.diag() - mask.left();
            const auto masked = [&](int offset, int key) {  // offset: key - (query - m0)
                return key >= args.seqlen_k || (Tr::kMask != kMaskNone && offset > band_hi) ||
                       (Tr::kMask == kMaskWindow && offset < band_lo);
            };
            const int head = kv_head * args.heads_per_kv + it / steps.m_count;  // the step's query head
            const ScoreMods mods = make_score_mods(args.scale, args.softcap,
                                                   alibi_slope(args.alibi_slopes, args.alibi_batch_stride, batch, head),
                                                   args.seqlen_q, args.seqlen_k);
            const DropBits<Tr> drop(smem.drop + s * Tr::kDropSlotBytes, wtid);
            with_step_case<Tr>(mods, args.dropout_threshold != 0, [&](auto cap, auto dropping, auto modify) {
                wide_p_mods<Tr, decltype(cap)::value, decltype(dropping)::value, decltype(modify)::value>(
                    st, px, lse_s, masked, key_lo, key_offset, lane, wtid, mods, m0, drop, args.dropout_scale);
            });
            named_barrier_arrive<kBwdPReady, kThreads>();
        } else if (wg == 0) {
            // P^T = exp(S^T scale - L), masked scores 0 (as scores_to_ds), to warpgroup 1 in fp32.
            const float* lse_s = smem.stats + s * kM;
            const int band_hi = m0 + mask.diag() + mask.right(), band_lo = m0 + mask.diag() - mask.left();
#pragma unroll
            for (int nt = 0; nt < kQT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qc = nt * 8 + (lane & 3) * 2 + (e & 1), key = key_lo + (e >> 1) * 8;
                    const int offset = key_offset + (e >> 1) * 8 - nt * 8 - (e & 1);
                    float p = fast_exp2(st[0][nt][e] * args.scale_log2 - lse_s[qc]);
                    if (key >= args.seqlen_k || (Tr::kMask != kMaskNone && offset > band_hi) ||
                        (Tr::kMask == kMaskWindow && offset < band_lo))
                        p = 0.f;
                    st[0][nt][e] = p;
                }
                px[nt * 128 + wtid] = make_float4(st[0][nt][0], st[0][nt][1], st[0][nt][2], st[0][nt][3]);
            }
            named_barrier_arrive<kBwdPReady, kThreads>();
        } else {
            // dS^T = P^T o (dP^T - D), once warpgroup 0's P^T is in (and its reads of the last dS^T are over);
            // with score modifiers P^T o dlogit / d(scale s) is what came, with dropout negated where dropped
            // (wide_p_mods): dS^T = |x| o (Z o dP^T - D).
            const float* dsum_s = smem.stats + (kS + s) * kM;
            named_barrier_sync<kBwdPReady, kThreads>();
            if (Tr::kDropout && args.dropout_threshold != 0) {
                const float keep_scale = args.dropout_scale;
#pragma unroll
                for (int nt = 0; nt < kQT; ++nt) {
                    const float4 p = px[nt * 128 + wtid];
                    const float x[4] = {p.x, p.y, p.z, p.w};
                    const int qc = nt * 8 + (lane & 3) * 2;
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float z = x[e] < 0.f ? 0.f : keep_scale;
                        st[0][nt][e] = fabsf(x[e]) * (st[0][nt][e] * z - dsum_s[qc + (e & 1)]);
                    }
                }
            } else {
#pragma unroll
                for (int nt = 0; nt < kQT; ++nt) {
                    const float4 p = px[nt * 128 + wtid];
                    const int qc = nt * 8 + (lane & 3) * 2;
                    st[0][nt][0] = p.x * (st[0][nt][0] - dsum_s[qc]);
                    st[0][nt][1] = p.y * (st[0][nt][1] - dsum_s[qc + 1]);
                    st[0][nt][2] = p.z * (st[0][nt][2] - dsum_s[qc]);
                    st[0][nt][3] = p.w * (st[0][nt][3] - dsum_s[qc + 1]);
                }
            }
        }
#pragma unroll
        for (int kk = 0; kk < kQT / 2; ++kk) c_to_a<Elem>(a[kk], st[0][2 * kk], st[0][2 * kk + 1]);
        if (wg == 1) {  // dS^T into the dQ operand tile (stmatrix of the packed registers)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int group = 0; group < kQT / 4; ++group) {
                    u32 x[4];
#pragma unroll
                    for (int p = 0; p < 4; ++p) x[p] = a[2 * group + p / 2][(p % 2) * 2 + half];
                    stmatrix_x4(DsTile::at(smem.ds, 16 * w4 + 8 * half + (lane & 7), (4 * group + (lane >> 3)) * 8),
                                x);
                }
        }

        // dV += P^T dO (warpgroup 0) or dK += dS^T Q (warpgroup 1; the scale of S applied at the end).
        // (dV at N = kVDim: its first kVDim columns of the accumulator)
        const auto products = [&](auto n, auto& d) {
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kQT / 2; ++kk)
                Wgmma<Elem, decltype(n)::value>::rs_mn(
                    d, a[kk], smem_desc_sw128(QTile::at(b_second, kk * 16, 0), QTile::kSlabBytes), 1);
            wgmma_commit();
        };
        if (Tr::kVDim == Tr::kHeadDim || wg == 1)
            products(Const<Tr::kHeadDim>{}, acc);
        else
            products(Const<Tr::kVDim>{}, reinterpret_cast<float(&)[1][Tr::kVDim / 8][4]>(acc));

        // dQ_i = dS K once dS^T is in; the accumulator's and the operands' registers pinned across the wait.
        fence_proxy_async_smem();
        named_barrier_sync<kBwdConsumers, kThreads>();
        if constexpr (kWaitBeforeDq) {  // (P^T or dS^T free before dQ_i's accumulators are taken)
            wgmma_wait<0>();
            pin_registers(acc);
            pin_registers(a);
        }
        if (wg == 0)
            dq_wide<Tr, Tr::kDqCols, kDqChunk>(smem, it, 0, w4, lane);
        else
            dq_wide<Tr, Tr::kDqCols1, (Tr::kDqCols1 < kDqChunk ? Tr::kDqCols1 : kDqChunk)>(smem, it, Tr::kDqCols, w4,
                                                                                          lane);
        pin_registers(acc);
        pin_registers(a);
        mbar_arrive(smem.empty(s));  // Q, dO, lse and D of slot s are read
        fence_proxy_async_smem();  // dQ_i to the producer, which issues its reduction
        __syncwarp();
        if (lane == 0) mbar_arrive(smem.dq_staged(0));
        if (ctid == 0 && it == 0) bwd_mark(3);  // the first step done
    }
    if (ctid == 0) bwd_mark(4);  // the last step done

    // dV (warpgroup 0) and dK = scale dS^T Q (warpgroup 1), staged in the V and K tiles once both warpgroups are done
    // reading them, then out as in consume_dkdv.
    named_barrier_sync<kBwdConsumers, kThreads>();
    const float out_scale = wg == 0 ? 1.f : args.scale;
    const u32 out_tile = wg == 0 ? smem.v : smem.k;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int group = 0; group < kDT / 4; ++group) {
            if (wg == 0 && group >= Tr::kVDim / 32) break;  // (dV's columns)
            u32 x[4];
#pragma unroll
            for (int p = 0; p < 4; ++p)
                x[p] = Mma<Elem>::pack(acc[0][4 * group + p][2 * half] * out_scale,
                                       acc[0][4 * group + p][2 * half + 1] * out_scale);
            stmatrix_x4(KVTile::at(out_tile, 16 * w4 + 8 * half + (lane & 7), (4 * group + (lane >> 3)) * 8), x);
        }
    }
    named_barrier_sync<kBwdConsumers, kThreads>();
    write_out_dk_dv<Tr>(smem, args, wg, ctid, batch, kv_head, key0, k_start);
    if (ctid == 0) bwd_mark(5);  // dK and dV written (issued)
}

}  // namespace fa2
