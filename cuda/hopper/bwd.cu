// FlashAttention backward for Hopper (sm_90a): the dK/dV kernel (with dQ added atomically) on wgmma tensor cores.
//
// Same work split and arguments as bwd_dkdv (cuda/bwd.cu), plus the tensor maps of q, k, v and dO
// (fa2cupy/tensor_maps.py), and the same preprocess (D = rowsum(dO o O), the zeroed fp32 dQ accumulator) and dQ
// conversion kernels: one block per (128-key tile, kv head, batch) keeps K_j and V_j in shared memory and walks the
// query tiles (BlockM rows) of every query head of its group. A producer warpgroup streams each tile's Q, dO and row
// statistics into a ring (an mbarrier per slot; the tiles by TMA, a varlen sequence's ragged ones by cp.async); two
// consumer warpgroups own 64 of the keys each and, per query tile, compute on wgmma
//   S^T = K Q^T, dP^T = V dO^T                 (keys x queries, both operands from shared memory)
//   P^T = exp(S^T scale - L), dS^T = P^T o (dP^T - D)   in registers
//   dV += P^T dO, dK += dS^T Q                 (P^T and dS^T as register A operands)
//   dQ_i += dS K                               (dS^T through shared memory, read transposed)
// and add dQ_i to the fp32 accumulator with one bulk reduction per step (cp.reduce.async.bulk over the step's
// rows: no tensor map, no per-element atomics), which the producer issues, so the consumers neither issue it nor
// wait for its reads. dQ_i is split between the warpgroups by head-dim columns (head dim 128: each 64 of them over
// all 128 keys, after the two exchange dS^T) or by keys (head dim 64, where 32 columns would be half a swizzled
// slab: each its own 64 keys over all columns, the two partial sums added in shared memory). Padded and varlen
// calls without score modifiers, head dims 64 and 128; the rest runs bwd_dkdv.
#include "common/types.cuh"
#include "common/clock.cuh"
#include "common/math.cuh"
#include "common/warp.cuh"
#include "sm80/memory.cuh"
#include "sm80/mma.cuh"
#include "sm80/tile_mma.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/warpgroup.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"
#include "sm90/slabs.cuh"
#include "attention/masks.cuh"

namespace fa2 {

// Named barrier ids of the Hopper backward (0 is __syncthreads'): the consumer warpgroups meet at kBwdConsumers (with
// dQ_i split by keys each warpgroup alone, at kBwdConsumers + its index), and at kBwdDqHandoff once warpgroup 0's
// part of a staged dQ_i is in, for warpgroup 1 to add its own.
enum HopperBwdBarrier : int { kBwdConsumers = 1, kBwdDqHandoff = 3 };

template <int HeadDim, int BlockM, int Stages, bool DqByKeys, class Elem_, int Mask, bool Varlen = false>
struct HopperBwdTraits {
    using Elem = Elem_;
    static constexpr int kHeadDim = HeadDim, kBlockM = BlockM, kBlockN = 128, kStages = Stages, kMask = Mask;
    // dQ_i split by keys (each warpgroup all columns over its 64 keys) or by columns (half of them over all keys).
    static constexpr bool kDqByKeys = DqByKeys;
    // Varlen: sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q/dO/lse/dQ and cu_seqlens_k[b] .. of
    // k/v/dK/dV; seqlen_q/seqlen_k are the maxima, and key blocks past a sequence's end return at once.
    static constexpr bool kVarlen = Varlen;
    // Padded calls move K, V, Q and dO with the tensor memory accelerator (tensor maps, one producer thread issuing
    // the copies; rows past the sequence read as zeros). Varlen calls move whole tiles of a sequence so too, and a
    // sequence's last, ragged tile with every producer thread's cp.async, whose zeros past its rows keep another
    // sequence's rows (which may hold anything) out of the products.
    static constexpr bool kTma = !Varlen;
    // Two consumer warpgroups and a producer warpgroup, whose registers go to the consumers (setmaxnreg): a
    // consumer holds dK and dV (64 keys x the head dim each) and S^T, dP^T (64 x BlockM) at once.
    static constexpr int kConsumerWarps = 8, kConsumerThreads = 256, kProducerThreads = 128, kThreads = 384;
    // Arrivals a tile's copies make on its barrier: the first producer thread's (TMA), or every producer thread's
    // (varlen: their cp.async, or the first thread's for all with a whole tile's TMA copies).
    static constexpr int kCopyArrivals = kTma ? 1 : kProducerThreads;
    // (By keys, with 128 query rows a step, the consumers need 232: the producer then works in 40.)
    static constexpr int kProducerRegisters = DqByKeys ? 40 : 56, kConsumerRegisters = DqByKeys ? 232 : 224;
    static_assert(kProducerRegisters + 2 * kConsumerRegisters <= 3 * 168, "the register file of one block");
    using KVTile = SwizzledSlabs<kBlockN, HeadDim>;
    using QTile = SwizzledSlabs<kBlockM, HeadDim>;   // Q and dO
    using DsTile = SwizzledSlabs<kBlockN, kBlockM>;  // dS^T, keys x queries: dQ's A operand read MN-major
    // Each warpgroup's share of dQ_i: its columns and keys. By columns, with HeadDim 128, one 64-column slab of K.
    static constexpr int kDqCols = DqByKeys ? HeadDim : HeadDim / 2, kDqKeys = DqByKeys ? kBlockN / 2 : kBlockN;
    // The fp32 dQ tile staged for the bulk reduction, one row per query, padded against bank conflicts; the
    // accumulator's rows have the same pitch (kDqPitch floats, the pad never read), so that one operation adds the
    // whole step. By keys a pair, by the step's parity, so that warpgroup 0 stores the next step's part while this
    // one's is reduced (by columns one tile, which both warpgroups wait for: a second does not fit beside the rest
    // at head dim 128).
    static constexpr int kDqPitch = HeadDim + 4, kDqBytes = kBlockM * kDqPitch * 4, kDqTiles = DqByKeys ? 2 : 1;
    // dS^T: by columns double-buffered, so a warpgroup writes the next one while the other may still read this
    // one; by keys each warpgroup reads only its own rows, after its own wait.
    static constexpr int kDsTiles = DqByKeys ? 1 : 2;
    // kv_full, then full[] and empty[] per ring slot, then dq_staged[] and dq_free[] per staging tile (the
    // consumers hand the staged dQ_i to the producer, which issues its reduction and hands the tile back once
    // it has read it; a pair by keys, as a tile's barriers may then not run a phase ahead of the other's).
    static constexpr int kBarriers = 1 + 2 * Stages + 2 * kDqTiles;
    // 1 KB of slack: the swizzled slabs start on 1024-byte boundaries.
    static constexpr int kSmemBytes = 1024 + 2 * KVTile::kBytes + 2 * Stages * QTile::kBytes +
                                      kDsTiles * DsTile::kBytes + kDqTiles * kDqBytes + 2 * Stages * kBlockM * 4 +
                                      8 * kBarriers;
    static_assert(kDqCols % 64 == 0, "each warpgroup's dQ columns are whole 64-column slabs");
    // 128 query rows per step (dQ_i in two wgmma row halves) only by keys: by columns the accumulators do not fit.
    static_assert(BlockM == 64 || (BlockM == 128 && DqByKeys), "64 query rows per step, or 128 with dQ by keys");
    static_assert(Stages >= 2, "a ring of at least two query tiles");
};

// Diagnostics for bench/bwd_trace.py: built with FA2_BWD_TRACE, thread 0 of the block, of the consumers and of the
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

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    bwd_dkdv_hopper(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                    const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
                    float* __restrict__ dq_accum, u16* __restrict__ dk, u16* __restrict__ dv,
                    const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
                    const float* __restrict__,
                    const u32* __restrict__, i64 q_batch_stride, int q_row_stride, i64 q_head_stride,
                    i64 k_batch_stride, int k_row_stride, i64 k_head_stride, i64 v_batch_stride, int v_row_stride,
                    i64 v_head_stride, i64 do_batch_stride, int do_row_stride, i64 do_head_stride,
                    i64 dk_batch_stride, int dk_row_stride, i64 dk_head_stride, i64 dv_batch_stride,
                    int dv_row_stride, i64 dv_head_stride, i64 stat_batch_stride, i64 stat_head_stride,
                    int seqlen_q, int seqlen_k, int, int heads_per_kv, int, int window_left, int window_right,
                    float scale, float scale_log2, float, int, u32, u32, u32, u32, u32, float, int total_q,
                    int total_k, int* error_claim, long long* error_host, const __grid_constant__ TensorMap tmap_q,
                    const __grid_constant__ TensorMap tmap_k, const __grid_constant__ TensorMap tmap_v,
                    const __grid_constant__ TensorMap tmap_do) {
    using KVTile = typename Tr::KVTile;
    using QTile = typename Tr::QTile;
    using DsTile = typename Tr::DsTile;
    using Elem = typename Tr::Elem;
    constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kS = Tr::kStages;
    constexpr int kKSteps = Tr::kHeadDim / 16, kDT = Tr::kHeadDim / 8, kQT = kM / 8;

    extern __shared__ unsigned char smem_raw[];
    const u32 smem_k = (smem_u32(smem_raw) + 1023) & ~1023u;
    const u32 smem_v = smem_k + KVTile::kBytes;
    const u32 smem_q = smem_v + KVTile::kBytes;             // kS tiles
    const u32 smem_do = smem_q + kS * QTile::kBytes;         // kS tiles
    const u32 smem_ds = smem_do + kS * QTile::kBytes;        // kDsTiles tiles
    const u32 smem_dq = smem_ds + Tr::kDsTiles * DsTile::kBytes;  // fp32 staging, kDqTiles tiles
    const u32 smem_stats = smem_dq + Tr::kDqTiles * Tr::kDqBytes;  // lse (log2 domain) [kS][kM], then D [kS][kM]
    const u32 bars = smem_stats + 2 * kS * kM * 4;
    float* const stats = reinterpret_cast<float*>(smem_raw + (smem_stats - smem_u32(smem_raw)));
    // kv_full: K and V landed (128 cp.async arrivals, or with TMA the first thread's arrival, for all 128 in
    // varlen, and the copies' bytes); full[s]: Q and dO landed in slot s (likewise) and its lse and D are stored
    // (kM arrivals); empty[s]: the 256 consumer threads are done with slot
    // s (each arrives for its own reads of lse and D: one arrival per warp after __syncwarp left racecheck a
    // hazard between the other lanes' reads and the producer's next stores).
    const u32 kv_full = bars;
    const auto full = [&](int s) { return bars + 8 * (1 + s); };
    const auto empty = [&](int s) { return bars + 8 * (1 + kS + s); };
    // dq_staged[t]: the warps that store the last of dQ_i (by keys warpgroup 1's, adding to warpgroup 0's part)
    // are done with staging tile t; dq_free[t]: the producer's reduction has read it.
    const auto dq_staged = [&](int t) { return bars + 8 * (1 + 2 * kS + t); };
    const auto dq_free = [&](int t) { return bars + 8 * (1 + 2 * kS + Tr::kDqTiles + t); };
    if (threadIdx.x == 0) {
        bwd_mark(0);  // the block's start
        mbar_init(kv_full, Tr::kCopyArrivals);
        for (int s = 0; s < kS; ++s) {
            mbar_init(full(s), Tr::kCopyArrivals + kM);
            mbar_init(empty(s), Tr::kConsumerThreads);
        }
        for (int t = 0; t < Tr::kDqTiles; ++t) {
            mbar_init(dq_staged(t), Tr::kDqByKeys ? Tr::kConsumerWarps / 2 : Tr::kConsumerWarps);
            mbar_init(dq_free(t), 1);
        }
    }
    __syncthreads();

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kv_head = blockIdx.y, batch = blockIdx.z, key0 = blockIdx.x * kN;
    int q_start = 0, k_start = 0;  // the sequence's first rows (varlen)
    if constexpr (Tr::kVarlen) {
        const SeqBounds seq(cu_seqlens_q, cu_seqlens_k, batch, total_q, total_k, error_claim, error_host, seqlen_q,
                            seqlen_k);
        // (uniform: the loops over the sequence's tiles and what they count stay off vector registers)
        seqlen_q = warp_uniform(seqlen_q), seqlen_k = warp_uniform(seqlen_k);
        q_start = warp_uniform(seq.q_start), k_start = warp_uniform(seq.k_start);
        if (key0 >= seqlen_k) return;  // past this sequence's keys (those rows belong to the next one)
    }
    // The steps: every query head of the group in turn, each over the query tiles with a row that sees one of
    // this block's keys (m_count of them from tile m_begin). Each warp role works them out after its setmaxnreg:
    // worked out before it, they were live across it and spilled at head dim 64.
    const WindowMask<Tr::kMask> mask{seqlen_q, seqlen_k, window_left, window_right};
    struct Steps {
        int m_begin, m_count, count;
        // Step j's first query row (the producer's loads walk them in order instead, a division per step fewer).
        FA2_DEVICE int m0(int j) const { return (m_begin + j % m_count) * kM; }
    };
    const auto block_steps = [&] {
        Steps steps;
        mask.template query_tiles<kM>(key0, kN, steps.m_begin, steps.m_count);
        steps.count = heads_per_kv * steps.m_count;
        return steps;
    };

    if (warp >= Tr::kConsumerWarps) {
        warpgroup_release_registers<Tr::kProducerRegisters>();
        // Producer: tiles into swizzled slabs (zeros from row `valid` on), each thread its chunks (SlabLoader).
        const int ptid = threadIdx.x - Tr::kConsumerThreads;
        const SlabLoader<Tr::kProducerThreads, Tr::kHeadDim> loader(ptid);
        const auto load_tile = [&](auto tile, u32 dst, const u16* src, int row_stride, int valid) {
            loader.template load<decltype(tile)>(dst, src, row_stride, valid);
        };
        const int map_batch = Tr::kVarlen ? 0 : batch;  // (varlen: the maps span the packed arrays' rows)
        if (Tr::kTma || seqlen_k - key0 >= kN) {  // (varlen: the first thread arrives for all)
            if (ptid == 0) {
                mbar_arrive_expect_tx<Tr::kCopyArrivals>(kv_full, 2 * KVTile::kBytes);
                tma_load_tile<KVTile>(smem_k, tmap_k, kv_head, k_start + key0, map_batch, kv_full);
                tma_load_tile<KVTile>(smem_v, tmap_v, kv_head, k_start + key0, map_batch, kv_full);
            }
        } else {
            load_tile(KVTile{}, smem_k,
                      k + batch * k_batch_stride + (i64)(k_start + key0) * k_row_stride + kv_head * k_head_stride,
                      k_row_stride, seqlen_k - key0);
            load_tile(KVTile{}, smem_v,
                      v + batch * v_batch_stride + (i64)(k_start + key0) * v_row_stride + kv_head * v_head_stride,
                      v_row_stride, seqlen_k - key0);
            cp_async_fenced_arrive(kv_full);  // (fenced: the consumers read it unfenced)
        }
        const Steps steps = block_steps();
        // Step j's dQ_j, once staged, goes out in one bulk reduction of its rows before seqlen_q, from its first
        // query row's accumulator row on (the first thread), and the staging tile back to the consumers once read.
        // Taken two steps late, after the load that the consumers' release of step j's slot let through, so the
        // consumers never wait for it. The step's rows are worked out here (carried from its load, they spilled at
        // head dim 64 beside the statistics loaded a step ahead); the accumulator row is an int, as rows of 272
        // bytes or more fit in device memory.
        const auto reduce_step = [&](int j) {
            if (ptid != 0) return;
            const int head = kv_head * heads_per_kv + j / steps.m_count, m0 = steps.m0(j);
            const int row = int(batch * stat_batch_stride + head * stat_head_stride + q_start + m0);
            const int t = j % Tr::kDqTiles;
            mbar_wait(dq_staged(t), (j / Tr::kDqTiles) & 1);
            bulk_reduce_add_f32(dq_accum + (i64)row * Tr::kDqPitch, smem_dq + t * Tr::kDqBytes,
                                min(kM, seqlen_q - m0) * Tr::kDqPitch * 4);
            bulk_commit();
            bulk_wait_read<0>();
            mbar_arrive(dq_free(t));
        };
        // Thread ptid < kM's row statistics of a step, lse (+inf past seqlen_q, so that P = 0: plain loads, which a
        // zero-filling copy cannot give) and D, loaded a step ahead: their wait falls under the wait for the slot,
        // not on the way to the step's full barrier (nothing reads them before the step's stores).
        float lse_next = 0.f, dsum_next = 0.f;
        const auto load_stats = [&](int head, int m0) {
            if (ptid >= kM) return;
            lse_next = pos_inf(), dsum_next = 0.f;
            if (m0 + ptid < seqlen_q) {
                const int row = int(batch * stat_batch_stride + head * stat_head_stride + q_start + m0 + ptid);
                lse_next = lse[row], dsum_next = dsum[row];
            }
        };
        load_stats(kv_head * heads_per_kv, steps.m_begin * kM);
        for (int it = 0, head = kv_head * heads_per_kv, m0 = steps.m_begin * kM; it < steps.count; ++it) {
            const int s = it % kS;
            mbar_wait(empty(s), ((it / kS) & 1) ^ 1);
            if (Tr::kTma || seqlen_q - m0 >= kM) {  // (varlen: the first thread arrives for all)
                if (ptid == 0) {
                    mbar_arrive_expect_tx<Tr::kCopyArrivals>(full(s), 2 * QTile::kBytes);
                    tma_load_tile<QTile>(smem_q + s * QTile::kBytes, tmap_q, head, q_start + m0, map_batch, full(s));
                    tma_load_tile<QTile>(smem_do + s * QTile::kBytes, tmap_do, head, q_start + m0, map_batch, full(s));
                }
            } else {
                load_tile(QTile{}, smem_q + s * QTile::kBytes,
                          q + batch * q_batch_stride + (i64)(q_start + m0) * q_row_stride + head * q_head_stride,
                          q_row_stride, seqlen_q - m0);
                load_tile(QTile{}, smem_do + s * QTile::kBytes,
                          dout + batch * do_batch_stride + (i64)(q_start + m0) * do_row_stride + head * do_head_stride,
                          do_row_stride, seqlen_q - m0);
                cp_async_fenced_arrive(full(s));
            }
            if (ptid < kM) {
                stats[s * kM + ptid] = lse_next * kLog2e;
                stats[(kS + s) * kM + ptid] = dsum_next;
                mbar_arrive(full(s));  // (release: the stores above)
            }
            if (it >= 2) reduce_step(it - 2);
            m0 += kM;  // step it + 1's query head and first row
            if (m0 == (steps.m_begin + steps.m_count) * kM) m0 = steps.m_begin * kM, ++head;
            if (it + 1 < steps.count) load_stats(head, m0);
        }
        if (steps.count >= 2) reduce_step(steps.count - 2);
        if (steps.count >= 1) reduce_step(steps.count - 1);
        bulk_wait<0>();
        if (ptid == 0) bwd_mark(6);  // the producer's end
        cp_async_wait_all();  // leave nothing in flight into shared memory
        return;
    }

    warpgroup_claim_registers<Tr::kConsumerRegisters>();
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
    const u32 k_rows = KVTile::at(smem_k, 64 * wg, 0), v_rows = KVTile::at(smem_v, 64 * wg, 0);
    float acc_dk[1][kDT][4], acc_dv[1][kDT][4];
    zero_fragments(acc_dk);
    zero_fragments(acc_dv);
    const int key_lo = key0 + 64 * wg + 16 * w4 + (lane >> 2);  // this thread's keys: key_lo, key_lo + 8
    const int key_offset = key_lo - (lane & 3) * 2;  // its first score's key minus query offset (query m0 + 0)
    mbar_wait(kv_full, 0);
    if (ctid == 0) bwd_mark(1);  // K and V in
    const Steps steps = block_steps();
    // Step it's first query row, walked as the producer does (steps.m0 takes a run-time division a step).
    const int m_first = steps.m_begin * kM, m_last = (steps.m_begin + steps.m_count - 1) * kM;
    for (int it = 0, m0 = m_first; it < steps.count; ++it, m0 = m0 == m_last ? m_first : m0 + kM) {
        const int s = it % kS;
        const u32 q_s = smem_q + s * QTile::kBytes, do_s = smem_do + s * QTile::kBytes;
        mbar_wait(full(s), (it / kS) & 1);
        if (ctid == 0 && it == 0) bwd_mark(2);  // the first step's Q, dO, lse and D in

        float st[1][kQT][4], dpt[1][kQT][4];
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
            Wgmma<Elem, kM>::ss(dpt, smem_desc_sw128(v_rows + step, 16), smem_desc_sw128(do_s + q_step, 16),
                                kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(st);
        pin_registers(dpt);

        // P^T = exp(S^T scale - L) and dS^T = P^T o (dP^T - D), in place.
        const float* lse_s = stats + s * kM;
        const float* dsum_s = stats + (kS + s) * kM;
        // Which scores are masked: the test itself on every score, key < seqlen_k and, for a mask, the score's
        // key - query offset against the step's band (uniform). With a per-tile branch around it
        // (tile_needs_mask) or through visible(), ptxas kept more registers live and serialised the wgmma (C7512)
        // or spilled at 128 query rows; at 64 the visible() form measured 5% slower causal (bench/NOTES.md).
        const int band_hi = m0 + mask.diag() + mask.right(), band_lo = m0 + mask.diag() - mask.left();
        const auto masked = [&](int offset, int key) {  // offset: key - (query - m0)
            return key >= seqlen_k || (Tr::kMask != kMaskNone && offset > band_hi) ||
                   (Tr::kMask == kMaskWindow && offset < band_lo);
        };
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
        u32 pa[kQT / 2][4], dsa[kQT / 2][4];  // P^T and dS^T as A operands, k16 steps over the queries
#pragma unroll
        for (int kk = 0; kk < kQT / 2; ++kk) {
            c_to_a<Elem>(pa[kk], st[0][2 * kk], st[0][2 * kk + 1]);
            c_to_a<Elem>(dsa[kk], dpt[0][2 * kk], dpt[0][2 * kk + 1]);
        }
        // dS^T into this iteration's dQ operand buffer (stmatrix of the same packed registers).
        const u32 ds_buf = smem_ds + (it % Tr::kDsTiles) * DsTile::kBytes;
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int group = 0; group < kQT / 4; ++group) {
                u32 x[4];
#pragma unroll
                for (int p = 0; p < 4; ++p) x[p] = dsa[2 * group + p / 2][(p % 2) * 2 + half];
                stmatrix_x4(DsTile::at(ds_buf, 64 * wg + 16 * w4 + 8 * half + (lane & 7), (4 * group + (lane >> 3)) * 8),
                            x);
            }

        // dV += P^T dO, dK += dS^T Q (the scale of S applied to dK at the end).
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kQT / 2; ++kk)
            Wgmma<Elem, Tr::kHeadDim>::rs_mn(acc_dv, pa[kk], smem_desc_sw128(QTile::at(do_s, kk * 16, 0),
                                                                              QTile::kSlabBytes), 1);
#pragma unroll
        for (int kk = 0; kk < kQT / 2; ++kk)
            Wgmma<Elem, Tr::kHeadDim>::rs_mn(acc_dk, dsa[kk], smem_desc_sw128(QTile::at(q_s, kk * 16, 0),
                                                                               QTile::kSlabBytes), 1);
        wgmma_commit();

        // dQ_i = dS K over this warpgroup's keys, so their dS^T must be in (by columns: both warpgroups').
        fence_proxy_async_smem();
        consumers_sync();
        // With 128 query rows, dQ_i in its two 64-row halves one after the other (wgmma's M is 64): the second
        // half's accumulators take the registers P^T and dS^T leave once the first wait is over.
        constexpr int kDqHalves = kM / 64;
        const int dq_t = it % Tr::kDqTiles;
        const u32 dq_tile = smem_dq + dq_t * Tr::kDqBytes;
        const bool adds = Tr::kDqByKeys && wg == 1;  // (by keys: warpgroup 1 adds to warpgroup 0's part)
#pragma unroll
        for (int mh = 0; mh < kDqHalves; ++mh) {
            float acc_dq[1][Tr::kDqCols / 8][4];
            if (mh > 0) wgmma_fence();  // (the first half's registers were just read by the staging stores)
#pragma unroll
            for (int kk = 0; kk < Tr::kDqKeys / 16; ++kk)
                Wgmma<Elem, Tr::kDqCols>::ss_mn(
                    acc_dq, smem_desc_sw128(DsTile::at(ds_buf, dq_key0 + kk * 16, 64 * mh), DsTile::kSlabBytes),
                    smem_desc_sw128(KVTile::at(smem_k, dq_key0 + kk * 16, dq_col0), KVTile::kSlabBytes), kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            pin_registers(acc_dv);
            pin_registers(acc_dk);
            pin_registers(acc_dq);
            if (mh == 0) {
                pin_registers(pa);
                pin_registers(dsa);
                mbar_arrive(empty(s));  // Q, dO, lse and D of slot s are read
                // The producer's reduction has read this tile's last dQ (kDqTiles steps back).
                if (!adds && it >= Tr::kDqTiles) mbar_wait(dq_free(dq_t), ((it / Tr::kDqTiles) - 1) & 1);
            }
            if (adds) named_barrier_sync(kBwdDqHandoff, Tr::kConsumerThreads);  // warpgroup 0's part is in

            // dQ_i into the staging tile, for the producer's bulk reduction (one per step).
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
            if (Tr::kDqByKeys && !adds) named_barrier_sync(kBwdDqHandoff, Tr::kConsumerThreads);  // (stored)
        }
        if (Tr::kDqByKeys && !adds) continue;  // (by keys warpgroup 1 stores the sums)
        fence_proxy_async_smem();  // dQ_i to the producer, which issues its reduction
        __syncwarp();
        if (lane == 0) mbar_arrive(dq_staged(dq_t));
        if (ctid == 0 && it == 0) bwd_mark(3);  // the first step done
    }
    if (ctid == 0) bwd_mark(4);  // the last step done

    // dK = scale dS^T Q and dV, staged in the K and V tiles (once the warpgroups that read these rows are done
    // with them) so that the global stores are 16-byte and row-contiguous. (stmatrix written out as in
    // fwd_hopper.cu's row write, not through a shared helper: that changed both kernels' code, bench/NOTES.md.)
    consumers_sync();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int group = 0; group < kDT / 4; ++group) {
            u32 xk[4], xv[4];
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                xk[p] = Mma<Elem>::pack(acc_dk[0][4 * group + p][2 * half] * scale,
                                        acc_dk[0][4 * group + p][2 * half + 1] * scale);
                xv[p] = Mma<Elem>::pack(acc_dv[0][4 * group + p][2 * half], acc_dv[0][4 * group + p][2 * half + 1]);
            }
            const int row = 64 * wg + 16 * w4 + 8 * half + (lane & 7), col = (4 * group + (lane >> 3)) * 8;
            stmatrix_x4(KVTile::at(smem_k, row, col), xk);
            stmatrix_x4(KVTile::at(smem_v, row, col), xv);
        }
    }
    consumers_sync();
    u16* dk_rows = dk + batch * dk_batch_stride + kv_head * dk_head_stride;
    u16* dv_rows = dv + batch * dv_batch_stride + kv_head * dv_head_stride;
    constexpr int kChunksPerRow = Tr::kHeadDim / 8;
    constexpr int kSyncRows = kN * kSyncThreads / Tr::kConsumerThreads;  // the rows these threads staged
    const int row0 = Tr::kDqByKeys ? 64 * wg : 0;
    for (int idx = sync_tid; idx < kSyncRows * kChunksPerRow; idx += kSyncThreads) {
        const int r = row0 + idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
        if (key0 + r < seqlen_k) {
            u32 chunk[4];
            ld_shared_v4(KVTile::at(smem_k, r, c), chunk);
            st_global_v4(dk_rows + (i64)(k_start + key0 + r) * dk_row_stride + c, chunk);
            ld_shared_v4(KVTile::at(smem_v, r, c), chunk);
            st_global_v4(dv_rows + (i64)(k_start + key0 + r) * dv_row_stride + c, chunk);
        }
    }
    if (ctid == 0) bwd_mark(5);  // dK and dV written (issued)
}

}  // namespace fa2
