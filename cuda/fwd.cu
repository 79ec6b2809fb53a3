// FlashAttention-2 forward (Dao 2023, Algorithm 1) on mma.sync tensor cores.
//
// One thread block per (query tile, head, batch). The query tile is split across warps by rows, so every
// warp owns complete rows: the softmax statistics never need an inter-warp reduction (FA2 §3.3). K and V tiles
// stream through a ring of shared-memory stages filled by cp.async while the previous tile is computed.
#include "common/types.cuh"
#include "common/params.cuh"
#include "sm80/memory.cuh"
#include "sm80/mma.cuh"
#include "sm80/smem_tile.cuh"
#include "sm80/tile_mma.cuh"
#include "attention/softmax.cuh"
#include "attention/masks.cuh"

namespace fa2 {

// A tile configuration is a type. Every instantiation the library can launch comes from fa2cupy/configs.py.
template <int HeadDim, int BlockM, int BlockN, int Warps, int Stages, int MinBlocks, bool QInRegs, class Elem_,
          int Mask, bool Mods = false, bool Varlen = false, bool Paged = false>
struct FwdTraits {
    using Elem = Elem_;
    static constexpr int kHeadDim = HeadDim, kBlockM = BlockM, kBlockN = BlockN, kStages = Stages;
    static constexpr int kThreads = Warps * 32, kMinBlocks = MinBlocks;
    static constexpr bool kQInRegs = QInRegs;
    static constexpr int kMask = Mask;  // a MaskKind (masks.cuh)
    static constexpr bool kMods = Mods;  // softcap / ALiBi (ScoreMods in masks.cuh) switched on at run time
    // cu_seqlens read (else ignored): padded calls keep the sequence bounds in the kernel parameters, so their
    // code is what it was before varlen (the d=64 128x128 causal row spills 20 bytes with the run-time choice).
    static constexpr bool kVarlen = Varlen;
    // Varlen with paged K/V (block_table non-null): its own instantiation, as the page look-ups cost registers.
    static constexpr bool kPaged = Paged;
    // Paged rows looked up once per tile by the lanes and handed round (SmemTile::load_async_pair_rows), but for
    // the d=64 128 x 128 row, at the register cap, where that spilled 44 bytes: it looks each chunk's row up.
    static constexpr bool kPagedRowsByLanes = !(HeadDim == 64 && BlockN == 128);
    static constexpr int kMTiles = BlockM / (16 * Warps);  // m16 row tiles per warp
    static constexpr int kNTiles = BlockN / 8;             // n8 key tiles of S per row tile
    static constexpr int kDTiles = HeadDim / 8;            // n8 head-dim tiles of O per row tile
    using QTile = SmemTile<BlockM, HeadDim>;
    using KVTile = SmemTile<BlockN, HeadDim>;
    static constexpr int kSmemBytes = QTile::kBytes + 2 * Stages * KVTile::kBytes;
    static_assert(kMTiles >= 1 && BlockM % (16 * Warps) == 0, "BlockM must be a multiple of 16 x warps");
    static_assert(BlockN % 16 == 0 && HeadDim % 16 == 0, "tiles are built from m16n8k16 steps");
    static_assert(Stages >= 2, "the K/V ring needs at least two stages");
    static_assert(Varlen || !Paged, "paged K/V comes with varlen");
};

// FwdParams (common/params.cuh): q, o: (batch, seqlen_q, nheads, d) and k, v: (batch, seqlen_k, nheads_kv, d) with
// arbitrary strides in elements on the first three axes and a contiguous last axis; lse[batch * lse_batch_stride +
// head * lse_head_stride + row] float32. `headdim` is the real head dim (a multiple of 8, <= kHeadDim); the rest of
// the tile is zero-filled. Varlen (cu_seqlens_q non-null): sequence `batch` is rows cu_seqlens_q[batch] ..
// cu_seqlens_q[batch + 1] of q/o/lse (and likewise of k/v with cu_seqlens_k; total_q/total_k rows in all),
// max_seqlen_q/max_seqlen_k are the maxima the grid was sized for, and blocks past a sequence's end exit at once.
// Mods: softcap > 0 and alibi_slopes[batch * alibi_batch_stride + head] (non-null) modify the scores, and
// dropout_threshold != 0 drops entries of P (Dropout in masks.cuh), the kept ones scaled by dropout_scale, with the
// seed and offset from the parameters or, when rng_state is non-null, from device memory.
template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, Tr::kMinBlocks)
    flash_fwd(const __grid_constant__ FwdParams kernel_params) {
    const FwdParams params = kernel_params;  // (read through a local copy: common/params.cuh)
    const u16* __restrict__ q = params.q;
    const u16* __restrict__ k = params.k;
    const u16* __restrict__ v = params.v;
    u16* __restrict__ o = params.o;
    float* __restrict__ lse = params.lse;
    const int* __restrict__ cu_seqlens_q = params.cu_seqlens_q;
    const int* __restrict__ cu_seqlens_k = params.cu_seqlens_k;
    const float* __restrict__ alibi_slopes = params.alibi_slopes;
    const u32* __restrict__ rng_state = params.rng_state;
    const int* __restrict__ block_table = params.block_table;
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    using Mma = fa2::Mma<typename Tr::Elem>;
    constexpr int kMT = Tr::kMTiles, kNT = Tr::kNTiles, kDT = Tr::kDTiles, kKSteps = Tr::kHeadDim / 16;

    extern __shared__ __align__(128) unsigned char smem[];
    const u32 smem_q = smem_u32(smem);
    const u32 smem_k = smem_q + QTile::kBytes;
    const u32 smem_v = smem_k + Tr::kStages * KVTile::kBytes;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Blocks are issued last query tile first: under a causal mask those see the most keys, so the longest
    // blocks start earliest and the tail of the grid is short ones.
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int head = blockIdx.y, batch = blockIdx.z;
    const int kv_head = head / params.heads_per_kv;  // MQA/GQA by index: K/V are never replicated
    const int row0 = m_block * Tr::kBlockM;
    const int warp_row0 = warp * kMT * 16;  // first row of this warp within the tile

    __shared__ int seq_info[4];  // this sequence's lengths and first rows, see share_seq_bounds
    if constexpr (Tr::kVarlen)
        share_seq_bounds(seq_info, cu_seqlens_q, cu_seqlens_k, batch, params.total_q, params.total_k,
                         params.error_claim, params.error_host, params.max_seqlen_q, params.max_seqlen_k);
    // Inside the loop: the kernel parameters for padded calls (no register, no load), shared memory for varlen.
    const auto sq = [&] { return Tr::kVarlen ? seq_info[0] : params.max_seqlen_q; };
    const auto sk = [&] { return Tr::kVarlen ? seq_info[1] : params.max_seqlen_k; };
    const auto q_start = [&] { return Tr::kVarlen ? seq_info[2] : 0; };
    // Paged K/V (varlen only): k/v are (num_pages, page_size, nheads_kv, d) with page strides k/v_batch_stride,
    // and key j of sequence `batch` is row j % page_size of page block_table[batch][j / page_size].
    constexpr bool paged = Tr::kPaged;
    const int seqlen_q = sq(), seqlen_k = sk(), k_start = Tr::kVarlen && !paged ? seq_info[3] : 0;
    if (row0 >= seqlen_q) return;  // varlen: past this sequence's queries
    auto mask_now = [&] { return WindowMask<Tr::kMask>{sq(), sk(), params.window_left, params.window_right}; };
    const u16* q_tile =
        q + batch * params.q_batch_stride + (i64)(q_start() + row0) * params.q_row_stride + head * params.q_head_stride;
    const u16* k_head = k + (paged ? 0 : batch * params.k_batch_stride) + (i64)k_start * params.k_row_stride +
                        kv_head * params.k_head_stride;
    const u16* v_head = v + (paged ? 0 : batch * params.v_batch_stride) + (i64)k_start * params.v_row_stride +
                        kv_head * params.v_head_stride;

    // Only key tiles inside the window of some row of this tile are visited: invisible tiles are skipped.
    const WindowMask<Tr::kMask> mask{seqlen_q, seqlen_k, params.window_left, params.window_right};
    int n_first, n_blocks;
    mask.template key_tiles<Tr::kBlockN>(row0, Tr::kBlockM, n_first, n_blocks);

    auto load_kv = [&](int n_block, int slot) {  // n_block counts from n_first
        const i64 first = (i64)(n_first + n_block) * Tr::kBlockN;
        const int rows = mask_now().seqlen_k - (int)first;
        if constexpr (paged) {
            const PagedKeys keys{block_table + (i64)batch * params.max_pages, {params.page_magic, params.page_shift},
                                 params.page_size, params.num_pages};
            KVTile::template load_async_pair_rows<Tr::kThreads, Tr::kPagedRowsByLanes>(
                smem_k + slot * KVTile::kBytes, smem_v + slot * KVTile::kBytes, k_head, v_head, params.headdim, tid,
                [&](int r, int& page, int& slot) {  // (a bad entry is reported, and its rows read as zeros)
                    return r < rows &&
                           keys.locate((int)first + r, page, slot, batch, params.error_claim, params.error_host);
                },
                [&](int page, int slot, const u16*& k_row, const u16*& v_row) {
                    k_row = k_head + page * params.k_batch_stride + (i64)slot * params.k_row_stride;
                    v_row = v_head + page * params.v_batch_stride + (i64)slot * params.v_row_stride;
                });
            return;
        }
        KVTile::template load_async<Tr::kThreads>(smem_k + slot * KVTile::kBytes, k_head + first * params.k_row_stride,
                                                  params.k_row_stride, rows, params.headdim, tid);
        KVTile::template load_async<Tr::kThreads>(smem_v + slot * KVTile::kBytes, v_head + first * params.v_row_stride,
                                                  params.v_row_stride, rows, params.headdim, tid);
    };

    // The score modifiers, rebuilt where they are used from the kernel parameters and the slope: the loop then holds
    // one register for them, not five (the dropout path needs the others at the 255-register cap).
    const float slope = Tr::kMods ? alibi_slope(alibi_slopes, params.alibi_batch_stride, batch, head) : 0.f;
    const auto mods_now = [&] { return make_score_mods(params.scale, params.softcap, slope, sq(), sk()); };
    u32 seed_lo = (u32)params.seed, seed_hi = (u32)(params.seed >> 32);
    u32 offset_lo = (u32)params.offset, offset_hi = (u32)(params.offset >> 32);
    if constexpr (Tr::kMods) load_rng_state(rng_state, seed_lo, seed_hi, offset_lo, offset_hi);
    const Dropout dropout = Tr::kMods ? make_dropout(params.dropout_threshold, seed_lo, seed_hi, offset_lo, offset_hi,
                                                     batch, params.nheads, head, params.dropout_scale)
                                      : Dropout{};
    // Uniform over the launch: softcap or ALiBi turn the scores into final logits (else, dropout alone, the scale
    // stays folded into the exponent as in the plain kernels), and dropout drops entries of P.
    const bool modify = Tr::kMods && mods_now().on(), drop = Tr::kMods && dropout.on();
    static_assert(!Tr::kMods || Tr::kBlockN % 32 == 0, "dropout draws its numbers for 32 keys at a time");
    const auto drop_rows = dropout.template fix_rows<kMT>(row0 + warp_row0, lane);  // (unused without dropout)

    float acc_o[kMT][kDT][4];
    zero_fragments(acc_o);
    OnlineSoftmax<kMT, kNT> softmax;
    softmax.init();

    if (n_blocks > 0) {
        // Prologue: Q and the first Stages-1 K/V tiles in flight (Q rides in the first commit group).
        QTile::template load_async<Tr::kThreads>(smem_q, q_tile, params.q_row_stride, seqlen_q - row0, params.headdim,
                                                 tid);
#pragma unroll
        for (int s = 0; s < Tr::kStages - 1; ++s) {
            if (s < n_blocks) load_kv(s, s);
            cp_async_commit();
        }
        u32 q_frag[Tr::kQInRegs ? kMT : 1][Tr::kQInRegs ? kKSteps : 1][4];

        for (int n_block = 0; n_block < n_blocks; ++n_block) {
            // Tile n_block has landed, and every warp is done with the slot the next load overwrites.
            cp_async_wait<Tr::kStages - 2>();
            __syncthreads();
            {
                const int ahead = n_block + Tr::kStages - 1;
                if (ahead < n_blocks) load_kv(ahead, ahead % Tr::kStages);
                cp_async_commit();  // possibly empty: keeps the group count uniform for wait_group
            }
            if (Tr::kQInRegs && n_block == 0) {
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                    for (int kk = 0; kk < kKSteps; ++kk)
                        QTile::load_a(q_frag[Tr::kQInRegs ? mt : 0][Tr::kQInRegs ? kk : 0], smem_q,
                                      warp_row0 + mt * 16, kk * 16, lane);
            }
            const int col0 = (n_first + n_block) * Tr::kBlockN;
            if constexpr (Tr::kMask == kMaskWindow && !Tr::kMods) {
                // A tile at the edge of the block's window band may lie outside every window of this warp's rows:
                // the warp skips it (all its scores would be masked) and leaves the tensor cores to the others.
                // (Not in the modifier kernels: the d=224 one spills 16 bytes with it.)
                const WindowMask<Tr::kMask> m = mask_now();
                const int warp_first = row0 + warp_row0, warp_last = warp_first + kMT * 16 - 1;
                const bool invisible = col0 + Tr::kBlockN <= warp_first + m.diag() - m.left() ||
                                       col0 > warp_last + m.diag() + m.right();
                // The same for every lane; the vote tells ptxas so, which keeps the softmax shuffles free of
                // divergence handling (as a plain branch it duplicated them and the epilogue: +15% code).
                if (__all_sync(0xffffffffu, invisible)) continue;
            }
            const u32 k_slot = smem_k + (n_block % Tr::kStages) * KVTile::kBytes;
            const u32 v_slot = smem_v + (n_block % Tr::kStages) * KVTile::kBytes;

            // S = Q K_j^T (Algorithm 1 line 8). Each K fragment feeds all of the warp's row tiles.
            float s[kMT][kNT][4];
            zero_fragments(s);
            mma_tiles<typename Tr::Elem, kKSteps>(
                s,
                [&](u32(&a)[4], int mt, int kk) {
                    if constexpr (Tr::kQInRegs) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) a[i] = q_frag[mt][kk][i];
                    } else {
                        QTile::load_a(a, smem_q, warp_row0 + mt * 16, kk * 16, lane);
                    }
                },
                [&](u32(&b)[4], int np, int kk) { KVTile::load_b_nk(b, k_slot, np * 16, kk * 16, lane); });
            // Only tiles that straddle the diagonal or the end of the keys pay for masking.
            if (modify) mods_now().apply(s, row0 + warp_row0, col0, lane);
            if (mask_now().tile_needs_mask(row0, Tr::kBlockM, col0, Tr::kBlockN))
                mask_now().apply(s, row0 + warp_row0, col0, lane);

            // Lines 9-10: new row max, P = exp(S - m), rescale of the running output. Modified scores are already
            // final logits: scale 1.
            softmax.update(s, acc_o, modify ? kLog2e : params.scale_log2);

            // Line 10 (cont.): O += P V_j, P straight from the accumulators (c_to_a). Written out rather than
            // mma_c_b: at the 255-register cap of the d=64 128x128 row, ptxas spills 36 bytes with the call.
            const auto pv_step = [&](const u32 (&a)[kMT][4], int kk) {
#pragma unroll
                for (int dp = 0; dp < kDT / 2; ++dp) {
                    u32 b[4];
                    KVTile::load_b_kn(b, v_slot, kk * 16, dp * 16, lane);
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt) {
                        Mma::run(acc_o[mt][2 * dp], a[mt], b[0], b[1]);
                        Mma::run(acc_o[mt][2 * dp + 1], a[mt], b[2], b[3]);
                    }
                }
            };
            if constexpr (Tr::kMods) {
                // P packed first (half the registers of the fp32 scores) while dropout draws its numbers.
                u32 a[kNT / 2][kMT][4];
#pragma unroll
                for (int kk = 0; kk < kNT / 2; ++kk)
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt)
                        c_to_a<typename Tr::Elem>(a[kk][mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
                // Dropout after the row sums: the softmax normaliser counts every key, the output only the kept
                // ones. (A uniform branch: calls without dropout skip it.)
                if (drop) {
#pragma unroll
                    for (int kb = 0; kb < kNT / 4; ++kb) {
                        u32 flags[kMT][2][2];
                        dropout.row_flags(flags, drop_rows, row0 + warp_row0, col0 + kb * 32, lane);
                        Dropout::apply_a(a[2 * kb], flags, 0);
                        Dropout::apply_a(a[2 * kb + 1], flags, 1);
                    }
                }
#pragma unroll
                for (int kk = 0; kk < kNT / 2; ++kk) pv_step(a[kk], kk);
            } else {
#pragma unroll
                for (int kk = 0; kk < kNT / 2; ++kk) {
                    u32 a[kMT][4];
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt) c_to_a<typename Tr::Elem>(a[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
                    pv_step(a, kk);
                }
            }
        }
        cp_async_wait<0>();  // only empty groups remain, but leave nothing in flight into shared memory
    }

    // Line 12: O = diag(l)^-1 O and L = m + log(l), written once.
    float row_lse[kMT * 2];
    softmax.finalize(acc_o, row_lse, modify ? 1.f : params.scale);

    // Stage this warp's output rows through its own (no longer needed) Q rows so the global stores are
    // 16-byte and row-contiguous. Only this warp ever read these rows.
    QTile::template store_warp_rows<typename Tr::Elem>(
        smem_q, acc_o, drop ? dropout.scale : 1.f, warp_row0,
        o + batch * params.o_batch_stride + head * params.o_head_stride +
            (i64)(q_start() + row0 + warp_row0) * params.o_row_stride,
        params.o_row_stride, mask_now().seqlen_q - row0 - warp_row0, params.headdim, lane);
    if ((lane & 3) == 0) {
        float* lse_head = lse + batch * params.lse_batch_stride + head * params.lse_head_stride + q_start();
#pragma unroll
        for (int r = 0; r < kMT * 2; ++r) {
            const int row = row0 + warp_row0 + (r / 2) * 16 + (lane >> 2) + (r % 2) * 8;
            if (row < mask_now().seqlen_q) lse_head[row] = row_lse[r];
        }
    }
}

}  // namespace fa2

namespace fa2 {

// Dropout's keep mask as the attention kernels draw it (Dropout in masks.cuh): mask[bh][i][j] = 1 where score
// (i, j) of batch * nheads + head = bh is kept. For fa2cupy.dropout_mask (tests, return_attn_probs).
__global__ void __launch_bounds__(256) dropout_keep_mask(const __grid_constant__ DropoutMaskParams params) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x, i = blockIdx.y, bh = blockIdx.z;
    if (j >= params.seqlen_k) return;
    const Dropout dropout = make_dropout(params.threshold, (u32)params.seed, (u32)(params.seed >> 32),
                                         (u32)params.offset, (u32)(params.offset >> 32), bh / params.nheads,
                                         params.nheads, bh % params.nheads, 1.f);
    params.mask[((i64)bh * params.seqlen_q + i) * params.seqlen_k + j] = dropout.keep_one(i, j) ? 1 : 0;
}

}  // namespace fa2
