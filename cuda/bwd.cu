// FlashAttention-2 backward (Dao 2023, Algorithm 2) on mma.sync tensor cores.
//
//   bwd_preprocess  D = rowsum(dO * O) per query row (and zeroes the fp32 dQ accumulator when atomics are used)
//   bwd_dkdv        one block per (key tile, kv head, batch): K_j, V_j stay in shared memory while the block walks
//                   the query tiles of every query head of its group, recomputing P = exp(S - L) from the saved
//                   log-sum-exp; dK_j and dV_j accumulate in registers. dQ is added to an fp32 workspace with
//                   atomics (AtomicDq) or left to bwd_dq (deterministic mode).
//   bwd_dq          deterministic dQ: one block per query tile, looping over key tiles in a fixed order
//   bwd_convert_dq  fp32 accumulator -> dQ in the input dtype, times softmax_scale
//   bwd_zero_tail   varlen: zeroes the gradient rows past the last sequence (no sequence's rows)
//
// The main kernel computes transposed scores, S^T = K Q^T and dP^T = V dO^T, so keys are the mma row index
// throughout: P^T and dS^T are then A operands of dV += P^T dO and dK += dS^T Q, and every warp keeps the same
// key rows of dK and dV in registers for the whole walk over the query tiles.
#include "common/types.cuh"
#include "common/params.cuh"
#include "common/math.cuh"
#include "sm80/memory.cuh"
#include "sm80/mma.cuh"
#include "sm80/smem_tile.cuh"
#include "sm80/tile_mma.cuh"
#include "sm90/grid_dependencies.cuh"
#include "attention/masks.cuh"

namespace fa2 {

// One tile configuration of the main kernel. The 8 (or 4, 2) warps are laid out twice over the block's work:
//   phase 1 (S^T, dP^T: keys x queries): WarpsKeys warps along the keys times Warps/WarpsKeys along the queries,
//   phase 2 (dV, dK: keys x head dim):   WarpsKeys2 along the keys times Warps/WarpsKeys2 along the head dim.
// P^T and dS^T cross between the phases through shared memory, so each phase takes the split that makes its
// fragments go furthest: 32 keys per warp lets every Q/dO (phase 1) or dO/Q (phase 2) fragment feed two mma row
// tiles; at small head dims phase 2 prefers 16 keys x all columns, where each P^T/dS^T fragment feeds more. DSlices > 1 splits the head dim of dK/dV/dQ over that many blocks (each recomputes S and dP for its key
// tile over the full head dim), which keeps large head dims in registers.
template <int HeadDim, int BlockM, int BlockN, int Warps, int WarpsKeys, int WarpsKeys2, int Stages, int DSlices,
          class Elem_, int Mask, bool AtomicDq, bool Mods = false, bool Varlen = false>
struct BwdTraits {
    using Elem = Elem_;
    static constexpr int kHeadDim = HeadDim, kBlockM = BlockM, kBlockN = BlockN, kStages = Stages;
    static constexpr int kThreads = Warps * 32, kWarps = Warps, kDSlices = DSlices;
    static constexpr bool kAtomicDq = AtomicDq;
    static constexpr int kMask = Mask;  // a MaskKind (masks.cuh)
    static constexpr bool kMods = Mods;  // softcap / ALiBi (ScoreMods in masks.cuh) switched on at run time
    // cu_seqlens read (else ignored): padded calls keep the sequence bounds in the kernel parameters, with
    // exactly the code they had before varlen (the run-time choice cost this kernel 2.5%).
    static constexpr bool kVarlen = Varlen;
    static constexpr int kSliceD = HeadDim / DSlices;         // dK/dV/dQ columns per block
    static constexpr int kWarpsOther = Warps / WarpsKeys;     // phase 1: warps along the queries
    static constexpr int kKeyTiles = BlockN / WarpsKeys / 16; // phase 1: m16 key tiles per warp
    static constexpr int kQCols = BlockM / kWarpsOther;       // phase 1: queries per warp
    static constexpr int kWarpsOther2 = Warps / WarpsKeys2;   // phase 2: warps along the head dim
    static constexpr int kKeyTiles2 = BlockN / WarpsKeys2 / 16;
    static constexpr int kDCols = kSliceD / kWarpsOther2;     // phase 2: head-dim columns per warp
    // dQ = dS K splits the BlockM x kSliceD output over warps: kDqRowWarps groups of kDqMTiles m16 row tiles,
    // and within a group the 16-column units dealt round-robin to kDqColWarps warps (head dims like 160 give
    // uneven deals). Two row tiles per warp, where the tile allows, let each K fragment feed two mma.
    static constexpr int kDqMTiles =
        (BlockM % 32 == 0 && Warps % (BlockM / 32) == 0 && Warps / (BlockM / 32) <= kSliceD / 16) ? 2 : 1;
    static constexpr int kDqRowWarps = BlockM / (16 * kDqMTiles);
    static constexpr int kDqColWarps = Warps / kDqRowWarps;
    static constexpr int kDqUnits = kSliceD / 16;
    static constexpr int kDqUnitsPerWarp = (kDqUnits + kDqColWarps - 1) / kDqColWarps;
    // Each warp stages its fp32 dQ block (rows x contiguous units) in a private scratch before the atomic adds,
    // so a warp's red.v4 covers whole 128-byte row segments: 4x fewer L2 requests than adding the mma
    // fragments directly (8 rows x 32 bytes per instruction), which were queueing behind ldmatrix in the LSU.
    // The scratch holds one m16 row tile at a time.
    static constexpr int kDqCols = kDqUnitsPerWarp * 16, kDqPitch = kDqCols + 4;
    static constexpr int kDqScratchBytes = AtomicDq ? Warps * 16 * kDqPitch * 4 : 0;
    using KVTile = SmemTile<BlockN, HeadDim>;
    using QTile = SmemTile<BlockM, HeadDim>;
    using PTile = SmemTile<BlockN, BlockM>;  // P^T and dS^T, keys x queries
    static constexpr int kSmemBytes = 2 * KVTile::kBytes + 2 * Stages * QTile::kBytes + 2 * PTile::kBytes +
                                      2 * Stages * BlockM * 4 + kDqScratchBytes;
    static_assert(Warps % WarpsKeys == 0 && BlockN % (16 * WarpsKeys) == 0, "key rows must split over warps");
    static_assert(Warps % WarpsKeys2 == 0 && BlockN % (16 * WarpsKeys2) == 0, "key rows must split over warps");
    static_assert(kQCols % 16 == 0 && kDCols % 16 == 0, "per-warp query and head-dim spans are k16/n16 steps");
    static_assert(kSliceD % 16 == 0 && HeadDim % DSlices == 0, "head-dim slices must be multiples of 16");
    static_assert(Warps % kDqRowWarps == 0, "dQ row groups must divide the warps");
    static_assert(Stages == 1 || Stages == 2, "the Q/dO ring has one or two stages");
};

// The row statistics (lse, D) and the fp32 dQ accumulator share one layout: row `row` of (batch, head) is entry
// batch * stat_batch_stride + head * stat_head_stride + q_start + row ((batch, nheads, seqlen_q), or
// (nheads, total_q) for varlen); the accumulator has dq_pitch floats per entry, the first headdim of them used
// (bwd_dkdv: dq_pitch = headdim; bwd_dkdv_hopper pads its rows as its staging tile's, so that one bulk reduction
// adds a whole step).

// ---------------------------------------------------------------------------------------------------------------
// D = rowsum(dO * O) (FA2 Algorithm 2 line 4 hoisted out of the loop): `lanes` lanes per query row (a power of
// two, 8 or 16 for head dims 64 and 128: every lane reads 16-byte chunks, where a warp per row left half or three
// quarters of them idle), 256 / lanes rows per block. Also clears the row of the fp32 dQ accumulator (dq_pitch
// floats, a multiple of 4) when the main kernel adds into it.
template <class Elem>
__global__ void __launch_bounds__(256)
    bwd_preprocess(const __grid_constant__ BwdParams kernel_params) {
    allow_next_grid();  // (a programmatic dK/dV kernel: its blocks take SMs as these leave, and wait for D)
    const BwdParams params = kernel_params;  // (read through a local copy: common/params.cuh)
    const u16* __restrict__ dout = params.dout;
    const u16* __restrict__ out = params.out;
    float* __restrict__ dsum = params.dsum;
    float* __restrict__ dq_accum = params.dq_accum;
    int seqlen_q = params.max_seqlen_q, seqlen_k_unused = 0;
    const int head = blockIdx.y, batch = blockIdx.z;
    const SeqBounds seq(params.cu_seqlens_q, nullptr, batch, params.total_q, 0, params.error_claim, params.error_host,
                        seqlen_q, seqlen_k_unused);
    const int lanes = params.lanes;
    const int row = blockIdx.x * (256 / lanes) + threadIdx.x / lanes, sub = threadIdx.x & (lanes - 1);
    const bool valid = row < seqlen_q;  // (no return: the row's lanes meet in the shuffles below)
    const i64 row_g = seq.q_start + row;
    const u16* do_row =
        dout + batch * params.do_batch_stride + row_g * params.do_row_stride + head * params.do_head_stride;
    const u16* o_row = out + batch * params.o_batch_stride + row_g * params.o_row_stride + head * params.o_head_stride;
    const i64 stat = batch * params.stat_batch_stride + head * params.stat_head_stride + row_g;
    float acc = 0.f;
    for (int c = sub * 8; valid && c < params.headdim; c += lanes * 8) {
        u32 a[4], b[4];
        ld_global_v4(do_row + c, a);
        ld_global_v4(o_row + c, b);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 x = unpack2<Elem>(a[i]), y = unpack2<Elem>(b[i]);
            acc += x.x * y.x + x.y * y.y;
        }
    }
    // The accumulator row, all dq_pitch floats of it: its pad too (never read), as a 32-byte sector left partly
    // unwritten costs the L2 a read of it from DRAM before its write-back.
    for (int c = sub * 4; valid && dq_accum != nullptr && c < params.dq_pitch; c += lanes * 4) {
        const u32 zero[4] = {0u, 0u, 0u, 0u};
        st_global_v4(dq_accum + stat * params.dq_pitch + c, zero);
    }
    for (int offset = lanes / 2; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    if (valid && sub == 0) dsum[stat] = acc;
}

// ---------------------------------------------------------------------------------------------------------------
// Phase 1 of bwd_dkdv: S^T = K_j Q_i^T and dP^T = V_j dO_i^T (Algorithm 2 lines 9 and 12) for the warp's keys x
// queries, from the K/V tiles and the Q/dO ring slot at q_s, do_s.
template <class Tr>
FA2_DEVICE void bwd_dkdv_scores(float (&st)[Tr::kKeyTiles][Tr::kQCols / 8][4],
                                float (&dpt)[Tr::kKeyTiles][Tr::kQCols / 8][4], const u32& smem_k, const u32& smem_v,
                                const u32& q_s, const u32& do_s, const int& warp_key0, const int& warp_q0,
                                const int& lane) {
    using KVTile = typename Tr::KVTile;
    using QTile = typename Tr::QTile;
    zero_fragments(st);
    zero_fragments(dpt);
    mma_tiles_pair<typename Tr::Elem, Tr::kHeadDim / 16>(
        st, dpt,
        [&](u32(&ak)[4], u32(&av)[4], int kt, int kk) {
            KVTile::load_a(ak, smem_k, warp_key0 + kt * 16, kk * 16, lane);
            KVTile::load_a(av, smem_v, warp_key0 + kt * 16, kk * 16, lane);
        },
        [&](u32(&bq)[4], u32(&bdo)[4], int np, int kk) {
            QTile::load_b_nk(bq, q_s, warp_q0 + np * 16, kk * 16, lane);
            QTile::load_b_nk(bdo, do_s, warp_q0 + np * 16, kk * 16, lane);
        });
}

// Phase 2 of bwd_dkdv: dV_j += P^T dO_i (Algorithm 2 line 10) and dK_j += dS^T Q_i (line 16, unscaled) for the
// warp's keys x head-dim columns, from the P^T and dS^T tiles and the Q/dO ring slot at q_s, do_s.
template <class Tr>
FA2_DEVICE void bwd_dkdv_accumulate(float (&acc_dv)[Tr::kKeyTiles2][Tr::kDCols / 8][4],
                                    float (&acc_dk)[Tr::kKeyTiles2][Tr::kDCols / 8][4], const u32& smem_p,
                                    const u32& smem_ds, const u32& do_s, const u32& q_s, const int& warp_key2,
                                    const int& warp_d0, const int& lane) {
    using QTile = typename Tr::QTile;
    using PTile = typename Tr::PTile;
    mma_tiles_pair<typename Tr::Elem, Tr::kBlockM / 16>(
        acc_dv, acc_dk,
        [&](u32(&ap)[4], u32(&ads)[4], int kt, int kk) {
            PTile::load_a(ap, smem_p, warp_key2 + kt * 16, kk * 16, lane);
            PTile::load_a(ads, smem_ds, warp_key2 + kt * 16, kk * 16, lane);
        },
        [&](u32(&bdo)[4], u32(&bq)[4], int dp, int kk) {
            QTile::load_b_kn(bdo, do_s, kk * 16, warp_d0 + dp * 16, lane);
            QTile::load_b_kn(bq, q_s, kk * 16, warp_d0 + dp * 16, lane);
        });
}

// P^T and dS^T of the warp's key tile kt and query tile nt (this thread's two rows, two columns each) to the
// shared P^T and dS^T tiles.
template <class Tr>
FA2_DEVICE void bwd_dkdv_store_p_ds(const u32& smem_p, const u32& smem_ds, const int& warp_key0, const int& warp_q0,
                                    const int& lane, int kt, int nt, const float (&p)[4], const float (&ds)[4]) {
    using PTile = typename Tr::PTile;
    using Mma = fa2::Mma<typename Tr::Elem>;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = warp_key0 + kt * 16 + (lane >> 2) + half * 8;
        const int c = warp_q0 + nt * 8 + (lane & 3) * 2;
        st_shared_u32(PTile::at(smem_p, r, c), Mma::pack(p[2 * half], p[2 * half + 1]));
        st_shared_u32(PTile::at(smem_ds, r, c), Mma::pack(ds[2 * half], ds[2 * half + 1]));
    }
}

// The epilogue of bwd_dkdv: dK_j = scale * dS^T Q (the scale of S = scale * Q K^T, deferred to here) and dV_j,
// staged in the K and V tiles (free: every thread is past the barrier after their last read) so the global
// stores are 16-byte and row-contiguous.
template <class Tr, class Params, class SeqK, class KStart>
FA2_DEVICE void bwd_dkdv_store_dkdv(const Params& params, const float (&acc_dk)[Tr::kKeyTiles2][Tr::kDCols / 8][4],
                                    const float (&acc_dv)[Tr::kKeyTiles2][Tr::kDCols / 8][4], const u32& smem_k,
                                    const u32& smem_v, u16* __restrict__ const& dk, u16* __restrict__ const& dv,
                                    const int& batch, const int& kv_head, const int& key0, const int& col0,
                                    const int& warp_key2, const int& warp_d0, const int& tid, const int& lane,
                                    const SeqK& sk, const KStart& k_start) {
    using KVTile = typename Tr::KVTile;
    using Mma = fa2::Mma<typename Tr::Elem>;
#pragma unroll
    for (int kt = 0; kt < Tr::kKeyTiles2; ++kt)
#pragma unroll
        for (int dt = 0; dt < Tr::kDCols / 8; ++dt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = warp_key2 + kt * 16 + (lane >> 2) + half * 8, c = warp_d0 + dt * 8 + (lane & 3) * 2;
                st_shared_u32(KVTile::at(smem_k, r, c),
                              Mma::pack(acc_dk[kt][dt][2 * half] * params.scale,
                                        acc_dk[kt][dt][2 * half + 1] * params.scale));
                st_shared_u32(KVTile::at(smem_v, r, c),
                              Mma::pack(acc_dv[kt][dt][2 * half], acc_dv[kt][dt][2 * half + 1]));
            }
    __syncthreads();
    u16* dk_head = dk + batch * params.dk_batch_stride + (i64)k_start() * params.dk_row_stride +
                   kv_head * params.dk_head_stride;
    u16* dv_head = dv + batch * params.dv_batch_stride + (i64)k_start() * params.dv_row_stride +
                   kv_head * params.dv_head_stride;
    constexpr int kChunksPerRow = Tr::kSliceD / 8;
    for (int idx = tid; idx < Tr::kBlockN * kChunksPerRow; idx += Tr::kThreads) {
        const int r = idx / kChunksPerRow, c = col0 + (idx % kChunksPerRow) * 8;
        if (key0 + r < sk() && c < params.headdim) {
            u32 chunk[4];
            ld_shared_v4(KVTile::at(smem_k, r, c), chunk);
            st_global_v4(dk_head + (i64)(key0 + r) * params.dk_row_stride + c, chunk);
            ld_shared_v4(KVTile::at(smem_v, r, c), chunk);
            st_global_v4(dv_head + (i64)(key0 + r) * params.dv_row_stride + c, chunk);
        }
    }
}

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1) bwd_dkdv(const __grid_constant__ BwdParams kernel_params) {
    // Read in place, at d=256 through a local copy (common/params.cuh): in place, the d=256 backward ran 2% slower
    // than with separate kernel arguments on an H200, through a copy level with them.
    const typename ParamsView<BwdParams, Tr::kHeadDim == 256>::type params = kernel_params;
    const u16* __restrict__ q = params.q;
    const u16* __restrict__ k = params.k;
    const u16* __restrict__ v = params.v;
    const u16* __restrict__ dout = params.dout;
    const float* __restrict__ lse = params.lse;
    const float* __restrict__ dsum = params.dsum;
    float* __restrict__ dq_accum = params.dq_accum;
    u16* __restrict__ dk = params.dk;
    u16* __restrict__ dv = params.dv;
    const int* __restrict__ cu_seqlens_q = params.cu_seqlens_q;
    const int* __restrict__ cu_seqlens_k = params.cu_seqlens_k;
    const float* __restrict__ alibi_slopes = params.alibi_slopes;
    const u32* __restrict__ rng_state = params.rng_state;
    u32 seed_lo = (u32)params.seed, seed_hi = (u32)(params.seed >> 32);
    u32 offset_lo = (u32)params.offset, offset_hi = (u32)(params.offset >> 32);
    using KVTile = typename Tr::KVTile;
    using QTile = typename Tr::QTile;
    using PTile = typename Tr::PTile;
    using Mma = fa2::Mma<typename Tr::Elem>;
    constexpr int kKT = Tr::kKeyTiles, kQT = Tr::kQCols / 8;
    constexpr int kKT2 = Tr::kKeyTiles2, kDT = Tr::kDCols / 8;
    constexpr int kM = Tr::kBlockM;

    extern __shared__ __align__(128) unsigned char smem[];
    const u32 smem_k = smem_u32(smem);
    const u32 smem_v = smem_k + KVTile::kBytes;
    const u32 smem_q = smem_v + KVTile::kBytes;                 // Stages x Q tiles
    const u32 smem_do = smem_q + Tr::kStages * QTile::kBytes;   // Stages x dO tiles
    const u32 smem_p = smem_do + Tr::kStages * QTile::kBytes;   // P^T
    const u32 smem_ds = smem_p + PTile::kBytes;                 // dS^T
    float* smem_lse = reinterpret_cast<float*>(smem + 2 * KVTile::kBytes + 2 * Tr::kStages * QTile::kBytes +
                                               2 * PTile::kBytes);  // Stages x BlockM, log2 domain
    float* smem_dsum = smem_lse + Tr::kStages * kM;                 // Stages x BlockM
    float* smem_dq = smem_dsum + Tr::kStages * kM;                   // per-warp dQ scratch (AtomicDq)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n_block = blockIdx.x / Tr::kDSlices, slice = blockIdx.x % Tr::kDSlices;
    const int kv_head = blockIdx.y, batch = blockIdx.z;
    const int key0 = n_block * Tr::kBlockN;
    __shared__ int seq_info[4];  // this sequence's lengths and first rows, see share_seq_bounds
    if constexpr (Tr::kVarlen)
        share_seq_bounds(seq_info, cu_seqlens_q, cu_seqlens_k, batch, params.total_q, params.total_k,
                         params.error_claim, params.error_host, params.max_seqlen_q, params.max_seqlen_k);
    // Inside the loop: the kernel parameters for padded calls (no register, no load), shared memory for varlen.
    const auto sq = [&] { return Tr::kVarlen ? seq_info[0] : params.max_seqlen_q; };
    const auto sk = [&] { return Tr::kVarlen ? seq_info[1] : params.max_seqlen_k; };
    const auto q_start = [&] { return Tr::kVarlen ? seq_info[2] : 0; };
    const auto k_start = [&] { return Tr::kVarlen ? seq_info[3] : 0; };
    const int seqlen_q = sq(), seqlen_k = sk();
    if (key0 >= seqlen_k) return;  // varlen: past this sequence's keys (those rows belong to the next one)
    const int col0 = slice * Tr::kSliceD;  // first head-dim column this block accumulates
    const int warp_key0 = (warp / Tr::kWarpsOther) * kKT * 16;            // phase 1
    const int warp_q0 = (warp % Tr::kWarpsOther) * Tr::kQCols;            // phase 1
    const int warp_key2 = (warp / Tr::kWarpsOther2) * kKT2 * 16;          // phase 2 and the epilogue
    const int warp_d0 = col0 + (warp % Tr::kWarpsOther2) * Tr::kDCols;    // phase 2 and the epilogue

    // Only the query tiles with a row whose window reaches this key tile are visited.
    const WindowMask<Tr::kMask> mask{seqlen_q, seqlen_k, params.window_left, params.window_right};
    // ALiBi slopes differ per query head: the walk over the group's heads rebuilds the modifiers per head.
    if constexpr (Tr::kMods) load_rng_state(rng_state, seed_lo, seed_hi, offset_lo, offset_hi);
    auto mods_of = [&](int head) {
        return make_score_mods(params.scale, params.softcap,
                               alibi_slope(alibi_slopes, params.alibi_batch_stride, batch, head), sq(), sk());
    };
    int m_begin, m_count;
    mask.template query_tiles<kM>(key0, Tr::kBlockN, m_begin, m_count);
    const int n_iters = params.heads_per_kv * m_count;

    // K_j and V_j: loaded once (Algorithm 2 line 6).
    const i64 key0_g = k_start() + key0;
    KVTile::template load_async<Tr::kThreads>(smem_k, k + batch * params.k_batch_stride + key0_g * params.k_row_stride +
                                                          kv_head * params.k_head_stride,
                                              params.k_row_stride, seqlen_k - key0, params.headdim, tid);
    KVTile::template load_async<Tr::kThreads>(smem_v, v + batch * params.v_batch_stride + key0_g * params.v_row_stride +
                                                          kv_head * params.v_head_stride,
                                              params.v_row_stride, seqlen_k - key0, params.headdim, tid);

    auto m_start = [&](int it) { return (m_begin + it % m_count) * kM; };

    // Query tile `it` of the flattened (query head of the group, m block) loop into ring slot `slot`.
    auto load_q_tile = [&](int it, int slot) {
        const int head = kv_head * params.heads_per_kv + it / m_count;
        const int m0 = m_start(it);
        const i64 m0_g = q_start() + m0;
        QTile::template load_async<Tr::kThreads>(
            smem_q + slot * QTile::kBytes,
            q + batch * params.q_batch_stride + m0_g * params.q_row_stride + head * params.q_head_stride,
            params.q_row_stride, sq() - m0, params.headdim, tid);
        QTile::template load_async<Tr::kThreads>(
            smem_do + slot * QTile::kBytes,
            dout + batch * params.do_batch_stride + m0_g * params.do_row_stride + head * params.do_head_stride,
            params.do_row_stride, sq() - m0, params.headdim, tid);
        // The row statistics go through plain loads: rows past seqlen_q need lse = +inf (so P = 0), which a
        // zero-filling cp.async cannot produce. The slot is free (all threads passed the barrier after its
        // last use) and the next barrier publishes these stores.
        for (int r = tid; r < kM; r += Tr::kThreads) {
            const i64 stat = batch * params.stat_batch_stride + head * params.stat_head_stride + m0_g + r;
            const bool ok = m0 + r < sq();
            smem_lse[slot * kM + r] = ok ? lse[stat] * kLog2e : pos_inf();
            smem_dsum[slot * kM + r] = ok ? dsum[stat] : 0.f;
        }
    };

    float acc_dk[kKT2][kDT][4], acc_dv[kKT2][kDT][4];
    zero_fragments(acc_dk);
    zero_fragments(acc_dv);

    if (n_iters > 0) load_q_tile(0, 0);
    cp_async_commit();

    for (int it = 0; it < n_iters; ++it) {
        if (Tr::kStages == 1 && it > 0) {
            __syncthreads();  // every warp is done with the single slot
            load_q_tile(it, 0);
            cp_async_commit();
        }
        cp_async_wait<0>();
        __syncthreads();
        if (Tr::kStages == 2) {
            if (it + 1 < n_iters) load_q_tile(it + 1, (it + 1) & 1);
            cp_async_commit();
        }
        const int slot = Tr::kStages == 2 ? (it & 1) : 0;
        const u32 q_s = smem_q + slot * QTile::kBytes, do_s = smem_do + slot * QTile::kBytes;
        const float* lse_s = smem_lse + slot * kM;
        const float* dsum_s = smem_dsum + slot * kM;
        const int head = kv_head * params.heads_per_kv + it / m_count;
        const int m0 = m_start(it);
        const ScoreMods mods = Tr::kMods ? mods_of(head) : ScoreMods{};
        const Dropout dropout = Tr::kMods ? make_dropout(params.dropout_threshold, seed_lo, seed_hi, offset_lo,
                                                         offset_hi, batch, params.nheads, head, params.dropout_scale)
                                          : Dropout{};

        {  // Phase 1: S^T = K_j Q_i^T and dP^T = V_j dO_i^T (lines 9 and 12) for this warp's keys x queries.
            float st[kKT][kQT][4], dpt[kKT][kQT][4];
            bwd_dkdv_scores<Tr>(st, dpt, smem_k, smem_v, q_s, do_s, warp_key0, warp_q0, lane);
            // P^T = exp(S^T * scale - L) (line 11) and dS^T = P^T o (dP^T - D) (line 13), to shared memory.
            // mask.tile_needs_mask(m0, kM, key0, Tr::kBlockN) spelled out on the kernel parameters: ptxas can
            // reload those, while the mask's copies stay live; at d=64 causal that is 12 registers and 5% of the
            // backward's speed.
            const WindowMask<Tr::kMask> mask_it{sq(), sk(), params.window_left, params.window_right};
            const bool need_mask =
                key0 + Tr::kBlockN > mask_it.seqlen_k ||
                (Tr::kMask != kMaskNone && key0 + Tr::kBlockN - 1 > m0 + mask_it.diag() + mask_it.right()) ||
                (Tr::kMask == kMaskWindow && key0 < m0 + kM - 1 + mask_it.diag() - mask_it.left());
            // The modifier variant: one version of the element-wise step per (modifiers, dropout) pair, chosen once
            // per query tile, so a call does no modifier or dropout work it does not need.
            const auto elementwise = [&](auto modify, auto drop) {
                constexpr bool kModify = decltype(modify)::value, kDrop = decltype(drop)::value;
                // Dropout: this thread's keys (rows of S^T) are key member b = 2 (kt % 2) + half of the key block
                // of kt / 2 (kKT even), or of the warp's 16 keys, at bytes ((key0 + warp_key0) >> 3 & 2) + half;
                // its queries are query member a = nt % 4 of the 32-query block of nt / 4 (when the warp's queries
                // span a multiple of 32), or of a 16-query span that starts at word ((m0 + warp_q0) >> 3) & 2.
                constexpr bool kKeyBlocks = kKT % 2 == 0, kQueryBlocks = Tr::kQCols % 32 == 0 && kM % 32 == 0;
                static_assert(kKeyBlocks || kKT == 1, "a warp's keys span 16 or a multiple of 32");
                static_assert(kQueryBlocks || kQT == 2, "a warp's queries span 16 or a multiple of 32");
                const int key_base = (key0 + warp_key0) & ~31, q_base = (m0 + warp_q0) & ~31;
                const u32 key_byte0 = kKeyBlocks ? 0u : (u32)(key0 + warp_key0) >> 3 & 2u;
                const bool q_upper = !kQueryBlocks && ((m0 + warp_q0) & 16);
                Dropout::Fixed keys[kKeyBlocks ? kKT / 2 : 1];
                if constexpr (kDrop) {
#pragma unroll
                    for (int kb = 0; kb < (kKeyBlocks ? kKT / 2 : 1); ++kb)
                        keys[kb] = dropout.fix_key(Dropout::group(key_base + kb * 32, lane >> 2));
                }
                const float keep_scale = dropout.scale;
                // P^T and dS^T of key tile kt (rows of S^T) and query tile nt; `flags` (dropout) holds the drop
                // flags of nt's query member in the byte of the key member.
                const auto step = [&](int kt, int nt, const u32 (&flags)[2], u32 byte0) {
                    const int key_lo = key0 + warp_key0 + kt * 16 + (lane >> 2);  // this thread's keys: key_lo, +8
                    float p[4], ds[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = key_lo + (e >> 1) * 8;
                        const int qc = warp_q0 + nt * 8 + (lane & 3) * 2 + (e & 1);
                        float dcap = 1.f;  // d logit / d(scale * s): the softcap's 1 - tanh^2
                        if constexpr (kModify)
                            p[e] = fast_exp2(mods.logit(st[kt][nt][e], m0 + qc, key, dcap) * kLog2e - lse_s[qc]);
                        else
                            p[e] = fast_exp2(st[kt][nt][e] * params.scale_log2 - lse_s[qc]);
                        if (need_mask && !mask_it.visible(m0 + qc, key)) p[e] = 0.f;
                        if constexpr (kDrop) {
                            // dV takes the dropped P; dS = P o (Z o dP / (1 - p) - D) (dP of the dropped output):
                            // z = 1 / (1 - p) where kept, 0 where dropped.
                            const float z = __uint_as_float(__float_as_uint(keep_scale) &
                                                            ~Dropout::drop_mask(flags[e & 1], byte0 + (e >> 1)));
                            ds[e] = p[e] * (dpt[kt][nt][e] * z - dsum_s[qc]);
                            p[e] *= z;
                        } else {
                            ds[e] = p[e] * (dpt[kt][nt][e] - dsum_s[qc]);
                        }
                        if constexpr (kModify) ds[e] *= dcap;
                    }
                    bwd_dkdv_store_p_ds<Tr>(smem_p, smem_ds, warp_key0, warp_q0, lane, kt, nt, p, ds);
                };
                if constexpr (kDrop) {  // by blocks of one call's 32 keys x 32 queries (or the 16 the warp spans)
                    constexpr int kKeyTilesPer = kKeyBlocks ? 2 : 1, kQueryTilesPer = kQueryBlocks ? 4 : 2;
#pragma unroll
                    for (int kb = 0; kb < kKT / kKeyTilesPer; ++kb)
#pragma unroll
                        for (int qb = 0; qb < kQT / kQueryTilesPer; ++qb) {
                            u32 flags[kQueryTilesPer][2];  // [query member][query parity]
#pragma unroll
                            for (int e1 = 0; e1 < 2; ++e1) {
                                u32 w[4];
                                dropout.words_fixed_key(w, keys[kb],
                                                        Dropout::group(q_base + qb * 32, (lane & 3) * 2 + e1));
#pragma unroll
                                for (int a = 0; a < kQueryTilesPer; ++a)
                                    flags[a][e1] = dropout.drop_flags(kQueryBlocks || !q_upper ? w[a] : w[2 + a]);
                            }
#pragma unroll
                            for (int k2 = 0; k2 < kKeyTilesPer; ++k2)
#pragma unroll
                                for (int q2 = 0; q2 < kQueryTilesPer; ++q2)
                                    step(kb * kKeyTilesPer + k2, qb * kQueryTilesPer + q2, flags[q2],
                                         kKeyBlocks ? 2 * k2 : key_byte0);
                        }
                } else {
                    const u32 none[2] = {0u, 0u};
#pragma unroll
                    for (int kt = 0; kt < kKT; ++kt)
#pragma unroll
                        for (int nt = 0; nt < kQT; ++nt) step(kt, nt, none, 0u);
                }
            };
            if constexpr (Tr::kMods) {
                with_modifiers(mods.on(), dropout.on(), elementwise);
            } else {
                // The plain kernels' loop (not `elementwise`: through it ptxas allocates the registers otherwise),
                // one copy for the tiles that need masking and one for those that do not (the compiler split it so
                // on its own when the bounds were kernel arguments; a loop for both held more registers, up to
                // spills at d=160).
                const auto plain = [&](auto masked) {
#pragma unroll
                    for (int kt = 0; kt < kKT; ++kt) {
                        const int key_lo = key0 + warp_key0 + kt * 16 + (lane >> 2);  // this thread's keys: +0, +8
#pragma unroll
                        for (int nt = 0; nt < kQT; ++nt) {
                            float p[4], ds[4];
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int key = key_lo + (e >> 1) * 8;
                                const int qc = warp_q0 + nt * 8 + (lane & 3) * 2 + (e & 1);
                                p[e] = fast_exp2(st[kt][nt][e] * params.scale_log2 - lse_s[qc]);
                                if (decltype(masked)::value && !mask_it.visible(m0 + qc, key)) p[e] = 0.f;
                                ds[e] = p[e] * (dpt[kt][nt][e] - dsum_s[qc]);
                            }
                            bwd_dkdv_store_p_ds<Tr>(smem_p, smem_ds, warp_key0, warp_q0, lane, kt, nt, p, ds);
                        }
                    }
                };
                if (need_mask)
                    plain(Bool<true>{});
                else
                    plain(Bool<false>{});
            }
        }
        __syncthreads();  // P^T and dS^T complete

        // Phase 2: dV_j += P^T dO_i (line 10) and dK_j += dS^T Q_i (line 16; scale applied at the end) for this
        // warp's keys x head-dim columns.
        bwd_dkdv_accumulate<Tr>(acc_dv, acc_dk, smem_p, smem_ds, do_s, q_s, warp_key2, warp_d0, lane);
        if (Tr::kAtomicDq) {
            // Phase 3: dQ_i += dS K_j (line 15) for this block's columns, added to the fp32 workspace. dS^T is
            // stored [key][query]; ldmatrix.trans turns it into A fragments with queries as rows.
            constexpr int kU = Tr::kDqUnitsPerWarp, kDqMT = Tr::kDqMTiles;
            const int row_w = warp % Tr::kDqRowWarps, col_w = warp / Tr::kDqRowWarps;
            float acc_dq[kDqMT][kU][2][4];
#pragma unroll
            for (int mt = 0; mt < kDqMT; ++mt)
#pragma unroll
                for (int u = 0; u < kU; ++u)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_dq[mt][u][0][e] = acc_dq[mt][u][1][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
                u32 a[kDqMT][4];
#pragma unroll
                for (int mt = 0; mt < kDqMT; ++mt)
                    PTile::load_a_trans(a[mt], smem_ds, (row_w * kDqMT + mt) * 16, kk * 16, lane);
#pragma unroll
                for (int u = 0; u < kU; ++u) {
                    const int unit = col_w * kU + u;  // a warp's units are contiguous columns
                    if (kU * Tr::kDqColWarps == Tr::kDqUnits || unit < Tr::kDqUnits) {
                        u32 b[4];
                        KVTile::load_b_kn(b, smem_k, kk * 16, col0 + unit * 16, lane);
#pragma unroll
                        for (int mt = 0; mt < kDqMT; ++mt) {
                            Mma::run(acc_dq[mt][u][0], a[mt], b[0], b[1]);
                            Mma::run(acc_dq[mt][u][1], a[mt], b[2], b[3]);
                        }
                    }
                }
            }
            float* scratch = smem_dq + warp * 16 * Tr::kDqPitch;
            const i64 dq_row0 = batch * params.stat_batch_stride + head * params.stat_head_stride + q_start();
            float* dq_head = dq_accum + dq_row0 * params.headdim;
            const int col0_w = col0 + col_w * Tr::kDqCols;
#pragma unroll
            for (int mt = 0; mt < kDqMT; ++mt) {
#pragma unroll
                for (int half = 0; half < 2; ++half)
#pragma unroll
                    for (int u = 0; u < kU; ++u)
#pragma unroll
                        for (int j = 0; j < 2; ++j) {
                            const int r = (lane >> 2) + half * 8, c = u * 16 + j * 8 + (lane & 3) * 2;
                            *reinterpret_cast<float2*>(scratch + r * Tr::kDqPitch + c) =
                                make_float2(acc_dq[mt][u][j][2 * half], acc_dq[mt][u][j][2 * half + 1]);
                        }
                __syncwarp();
                const int row0_w = m0 + (row_w * kDqMT + mt) * 16;
                constexpr int kChunks = 16 * Tr::kDqCols / 4;
#pragma unroll 1  // keeps the flush's addresses out of the registers that hold dK and dV
                for (int i = 0; i < (kChunks + 31) / 32; ++i) {
                    const int idx = lane + i * 32;
                    const int r = idx / (Tr::kDqCols / 4), c = (idx % (Tr::kDqCols / 4)) * 4;
                    if ((kChunks % 32 == 0 || idx < kChunks) && row0_w + r < sq() &&
                        col0_w + c < col0 + Tr::kSliceD && col0_w + c < params.headdim) {
                        u32 v4[4];
                        ld_shared_v4(smem_u32(scratch + r * Tr::kDqPitch + c), v4);
                        red_add_f32x4(dq_head + (i64)(row0_w + r) * params.headdim + col0_w + c, v4);
                    }
                }
                __syncwarp();  // the scratch is rewritten by the next row tile
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // K/V tiles are reused below as staging for the outputs

    bwd_dkdv_store_dkdv<Tr>(params, acc_dk, acc_dv, smem_k, smem_v, dk, dv, batch, kv_head, key0, col0, warp_key2,
                            warp_d0, tid, lane, sk, k_start);
}

// ---------------------------------------------------------------------------------------------------------------
// Deterministic dQ: one block per (query tile, head, batch), the forward's structure (warps own query rows),
// keys visited in a fixed order, dQ accumulated in registers: no atomics, bit-identical run to run. It recomputes
// S and dP (two extra matmuls), the documented cost of deterministic=True.
template <int HeadDim, int BlockM, int BlockN, int Warps, class Elem_, int Mask, bool Mods = false>
struct BwdDqTraits {
    using Elem = Elem_;
    static constexpr int kHeadDim = HeadDim, kBlockM = BlockM, kBlockN = BlockN, kThreads = Warps * 32;
    static constexpr int kMask = Mask;  // a MaskKind (masks.cuh)
    static constexpr bool kMods = Mods;
    static constexpr int kMTiles = BlockM / (16 * Warps);
    using QTile = SmemTile<BlockM, HeadDim>;
    using KVTile = SmemTile<BlockN, HeadDim>;
    static constexpr int kSmemBytes = 2 * QTile::kBytes + 4 * KVTile::kBytes;  // Q, dO, 2 x (K, V)
    static_assert(kMTiles >= 1 && BlockM % (16 * Warps) == 0, "BlockM must be a multiple of 16 x warps");
};

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    bwd_dq(const __grid_constant__ BwdParams kernel_params) {
    const BwdParams params = kernel_params;  // (read through a local copy: common/params.cuh)
    const u16* __restrict__ q = params.q;
    const u16* __restrict__ k = params.k;
    const u16* __restrict__ v = params.v;
    const u16* __restrict__ dout = params.dout;
    const float* __restrict__ lse = params.lse;
    const float* __restrict__ dsum = params.dsum;
    u16* __restrict__ dq = params.dq;
    const int* __restrict__ cu_seqlens_q = params.cu_seqlens_q;
    const int* __restrict__ cu_seqlens_k = params.cu_seqlens_k;
    const float* __restrict__ alibi_slopes = params.alibi_slopes;
    const u32* __restrict__ rng_state = params.rng_state;
    u32 seed_lo = (u32)params.seed, seed_hi = (u32)(params.seed >> 32);
    u32 offset_lo = (u32)params.offset, offset_hi = (u32)(params.offset >> 32);
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    using Mma = fa2::Mma<typename Tr::Elem>;
    constexpr int kMT = Tr::kMTiles, kNT = Tr::kBlockN / 8, kDT = Tr::kHeadDim / 8, kKSteps = Tr::kHeadDim / 16;

    extern __shared__ __align__(128) unsigned char smem[];
    const u32 smem_q = smem_u32(smem);
    const u32 smem_do = smem_q + QTile::kBytes;
    const u32 smem_k = smem_do + QTile::kBytes;  // 2 stages
    const u32 smem_v = smem_k + 2 * KVTile::kBytes;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int head = blockIdx.y, batch = blockIdx.z, kv_head = head / params.heads_per_kv;
    const int row0 = m_block * Tr::kBlockM, warp_row0 = warp * kMT * 16;
    __shared__ int seq_info[4];  // this sequence's lengths and first rows, see share_seq_bounds
    if (cu_seqlens_q != nullptr)  // padded calls read the kernel parameters (see the accessors below)
        share_seq_bounds(seq_info, cu_seqlens_q, cu_seqlens_k, batch, params.total_q, params.total_k,
                         params.error_claim, params.error_host, params.max_seqlen_q, params.max_seqlen_k);
    // Inside the loop: the kernel parameters for padded calls (no register, no load), shared memory for varlen.
    const auto sq = [&] { return cu_seqlens_q != nullptr ? seq_info[0] : params.max_seqlen_q; };
    const auto sk = [&] { return cu_seqlens_q != nullptr ? seq_info[1] : params.max_seqlen_k; };
    const auto q_start = [&] { return cu_seqlens_q != nullptr ? seq_info[2] : 0; };
    const auto k_start = [&] { return cu_seqlens_q != nullptr ? seq_info[3] : 0; };
    const int seqlen_q = sq(), seqlen_k = sk();
    if (row0 >= seqlen_q) return;  // varlen: past this sequence's queries
    const u16* k_head = k + batch * params.k_batch_stride + (i64)k_start() * params.k_row_stride +
                        kv_head * params.k_head_stride;
    const u16* v_head = v + batch * params.v_batch_stride + (i64)k_start() * params.v_row_stride +
                        kv_head * params.v_head_stride;
    const i64 row0_g = q_start() + row0;

    const WindowMask<Tr::kMask> mask{seqlen_q, seqlen_k, params.window_left, params.window_right};
    // The score modifiers, rebuilt where they are used from the kernel parameters and the slope (one register
    // across the loop, not five).
    const float slope = Tr::kMods ? alibi_slope(alibi_slopes, params.alibi_batch_stride, batch, head) : 0.f;
    const auto mods_now = [&] { return make_score_mods(params.scale, params.softcap, slope, sq(), sk()); };
    if constexpr (Tr::kMods) load_rng_state(rng_state, seed_lo, seed_hi, offset_lo, offset_hi);
    const Dropout dropout = Tr::kMods ? make_dropout(params.dropout_threshold, seed_lo, seed_hi, offset_lo, offset_hi,
                                                     batch, params.nheads, head, params.dropout_scale)
                                      : Dropout{};
    const bool modify = Tr::kMods && mods_now().on();  // (else the scale stays folded into the exponent)
    const auto drop_rows = dropout.template fix_rows<kMT>(row0 + warp_row0, lane);  // (unused without dropout)
    int n_first, n_blocks;
    mask.template key_tiles<Tr::kBlockN>(row0, Tr::kBlockM, n_first, n_blocks);

    auto load_kv = [&](int n_block, int slot) {  // n_block counts from n_first
        const i64 first = (i64)(n_first + n_block) * Tr::kBlockN;
        const int rows = sk() - (int)first;
        KVTile::template load_async<Tr::kThreads>(smem_k + slot * KVTile::kBytes, k_head + first * params.k_row_stride,
                                                  params.k_row_stride, rows, params.headdim, tid);
        KVTile::template load_async<Tr::kThreads>(smem_v + slot * KVTile::kBytes, v_head + first * params.v_row_stride,
                                                  params.v_row_stride, rows, params.headdim, tid);
    };

    // Row statistics of this thread's rows (g and g+8 of each m16 tile), log2 domain for the exponent.
    float row_lse[kMT * 2], row_dsum[kMT * 2];
#pragma unroll
    for (int r = 0; r < kMT * 2; ++r) {
        const int row = row0 + warp_row0 + (r / 2) * 16 + (lane >> 2) + (r % 2) * 8;
        const i64 stat = batch * params.stat_batch_stride + head * params.stat_head_stride + q_start() + row;
        row_lse[r] = row < seqlen_q ? lse[stat] * kLog2e : pos_inf();
        row_dsum[r] = row < seqlen_q ? dsum[stat] : 0.f;
    }

    float acc_dq[kMT][kDT][4];
    zero_fragments(acc_dq);

    if (n_blocks > 0) {
        QTile::template load_async<Tr::kThreads>(
            smem_q, q + batch * params.q_batch_stride + row0_g * params.q_row_stride + head * params.q_head_stride,
            params.q_row_stride, seqlen_q - row0, params.headdim, tid);
        QTile::template load_async<Tr::kThreads>(
            smem_do,
            dout + batch * params.do_batch_stride + row0_g * params.do_row_stride + head * params.do_head_stride,
            params.do_row_stride, seqlen_q - row0, params.headdim, tid);
        load_kv(0, 0);
        cp_async_commit();
        for (int n_block = 0; n_block < n_blocks; ++n_block) {
            cp_async_wait<0>();
            __syncthreads();
            if (n_block + 1 < n_blocks) load_kv(n_block + 1, (n_block + 1) & 1);
            cp_async_commit();
            const u32 k_slot = smem_k + (n_block & 1) * KVTile::kBytes;
            const u32 v_slot = smem_v + (n_block & 1) * KVTile::kBytes;

            float s[kMT][kNT][4], dp[kMT][kNT][4];
            zero_fragments(s);
            zero_fragments(dp);
            mma_tiles_pair<typename Tr::Elem, kKSteps>(
                s, dp,
                [&](u32(&aq)[4], u32(&ado)[4], int mt, int kk) {
                    QTile::load_a(aq, smem_q, warp_row0 + mt * 16, kk * 16, lane);
                    QTile::load_a(ado, smem_do, warp_row0 + mt * 16, kk * 16, lane);
                },
                [&](u32(&bk)[4], u32(&bv)[4], int np, int kk) {
                    KVTile::load_b_nk(bk, k_slot, np * 16, kk * 16, lane);
                    KVTile::load_b_nk(bv, v_slot, np * 16, kk * 16, lane);
                });
            const int col0 = (n_first + n_block) * Tr::kBlockN;
            const WindowMask<Tr::kMask> mask_it{sq(), sk(), params.window_left, params.window_right};
            const bool need_mask = mask_it.tile_needs_mask(row0, Tr::kBlockM, col0, Tr::kBlockN);
            // One version of the element-wise step per (modifiers, dropout) pair, chosen once per key tile.
            // `check`: Const<0> no tile mask, <1> every element's, <2> where need_mask (see bwd_dkdv's plain loop).
            const auto elementwise = [&](auto modify, auto drop, auto check) {
                constexpr bool kModify = decltype(modify)::value, kDrop = decltype(drop)::value;
                // dS of row tile mt, key tile nt; `flags` (dropout): row_flags()'s [mt] for nt's 32 keys, whose
                // byte `byte` holds nt's flags.
                const auto step = [&](int mt, int nt, const u32 (&flags)[2][2], u32 byte) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = mt * 2 + (e >> 1);
                        const int row = row0 + warp_row0 + mt * 16 + (lane >> 2) + (e >> 1) * 8;
                        const int key = col0 + nt * 8 + (lane & 3) * 2 + (e & 1);
                        float dcap = 1.f, p;
                        if constexpr (kModify)
                            p = fast_exp2(mods_now().logit(s[mt][nt][e], row, key, dcap) * kLog2e - row_lse[r]);
                        else
                            p = fast_exp2(s[mt][nt][e] * params.scale_log2 - row_lse[r]);
                        constexpr int kCheck = decltype(check)::value;
                        if ((kCheck == 1 || (kCheck == 2 && need_mask)) && !mask_it.visible(row, key)) p = 0.f;
                        float dpv = dp[mt][nt][e];
                        if constexpr (kDrop)  // Z o dP / (1 - p), the dP of the dropped output
                            dpv *= __uint_as_float(__float_as_uint(dropout.scale) &
                                                   ~Dropout::drop_mask(flags[e >> 1][e & 1], byte));
                        dp[mt][nt][e] = p * (dpv - row_dsum[r]) * dcap;  // dS
                    }
                };
                if constexpr (kDrop) {  // by 32-key blocks (or the 16 keys of a tile, half of one)
                    constexpr int kBlocks = kNT % 4 == 0 ? kNT / 4 : 1, kTilesPer = kNT % 4 == 0 ? 4 : kNT;
                    static_assert(kNT % 4 == 0 || kNT == 2, "dropout takes key tiles of 16 or multiples of 32");
#pragma unroll
                    for (int kb = 0; kb < kBlocks; ++kb) {
                        u32 flags[kMT][2][2];
                        dropout.row_flags(flags, drop_rows, row0 + warp_row0, (col0 & ~31) + kb * 32, lane);
#pragma unroll
                        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                            for (int n2 = 0; n2 < kTilesPer; ++n2)
                                step(mt, kb * kTilesPer + n2, flags[mt], kNT % 4 == 0 ? n2 : ((col0 >> 3) & 2) + n2);
                    }
                } else {
                    const u32 none[2][2] = {{0u, 0u}, {0u, 0u}};
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                        for (int nt = 0; nt < kNT; ++nt) step(mt, nt, none, 0u);
                }
            };
            if constexpr (Tr::kMods)
                with_modifiers(modify, dropout.on(), [&](auto m, auto d) { elementwise(m, d, Const<2>{}); });
            else if (need_mask)
                elementwise(Bool<false>{}, Bool<false>{}, Const<1>{});
            else
                elementwise(Bool<false>{}, Bool<false>{}, Const<0>{});
            // dQ += dS K_j, dS straight from the accumulators as A fragments.
            mma_c_b<typename Tr::Elem, KVTile>(acc_dq, dp, k_slot, lane);
        }
        cp_async_wait<0>();
    }
    // dQ = scale * dS K through this warp's own Q rows (only this warp read them).
    QTile::template store_warp_rows<typename Tr::Elem>(
        smem_q, acc_dq, params.scale, warp_row0,
        dq + batch * params.dq_batch_stride + head * params.dq_head_stride +
            (q_start() + row0 + warp_row0) * params.dq_row_stride,
        params.dq_row_stride, sq() - row0 - warp_row0, params.headdim, lane);
}

// ---------------------------------------------------------------------------------------------------------------
// dQ = scale * dq_accum in the input dtype; one thread per 8 columns of one row. A row that sees no key is zero,
// its accumulator row not read. After the Hopper dK/dV kernel with arrival counts (dq_arrivals), launched
// programmatically while that kernel's last blocks still run: thread 0 waits for the count of each query tile of
// the block's rows to reach the key tiles that add to it (a tile whose rows see no key has none), and the block's
// barrier hands the additions on to every thread. Otherwise the whole kernel before it is waited for.
template <class Elem>
__global__ void __launch_bounds__(256)
    bwd_convert_dq(const __grid_constant__ BwdParams kernel_params) {
    const BwdParams params = kernel_params;  // (read through a local copy: common/params.cuh)
    const float* __restrict__ dq_accum = params.dq_accum;
    u16* __restrict__ dq = params.dq;
    int seqlen_q = params.max_seqlen_q, seqlen_k = params.max_seqlen_k;
    const int chunks = params.headdim / 8;
    const int idx = blockIdx.x * 256 + threadIdx.x;
    const int row = idx / chunks, c = (idx % chunks) * 8;
    const int head = blockIdx.y, batch = blockIdx.z;
    const SeqBounds seq(params.cu_seqlens_q, params.cu_seqlens_k, batch, params.total_q, params.total_k,
                        params.error_claim, params.error_host, seqlen_q, seqlen_k);
    // (the window form of every mask: the bounds of the none and causal ones are unlimited sides)
    const WindowMask<kMaskWindow> mask{seqlen_q, seqlen_k, params.window_left, params.window_right};
    if (params.dq_arrivals == nullptr) {
        wait_for_prior_grids();  // (launched programmatically after the Hopper dK/dV kernel: its additions)
    } else {
        if (threadIdx.x == 0) {
            const int bm = params.arrival_block_m, bn = params.arrival_block_n;
            // (signed: min of an unsigned blockIdx expression and seqlen_q - 1 = -1 would be the unsigned one)
            const int first_row = int(blockIdx.x) * 256 / chunks;
            const int last_row = min((int(blockIdx.x) * 256 + 255) / chunks, seqlen_q - 1);
            const int* counts =
                params.dq_arrivals + ((i64)batch * params.nheads + head) * ((params.max_seqlen_q + bm - 1) / bm);
            // (none past the sequence's last row: a varlen sequence without query rows has last_row -1, whose
            // tile, -1 / bm, is 0 in C)
            for (int t = first_row / bm; first_row <= last_row && t <= last_row / bm; ++t) {
                int first, count;
                mask.key_tiles(t * bm, min(bm, seqlen_q - t * bm), bn, first, count);
                if (count > 0) wait_for_count(counts + t, count);
            }
        }
        __syncthreads();
    }
    if (row >= seqlen_q) return;
    const i64 row_g = seq.q_start + row;
    u32 packed[4] = {0u, 0u, 0u, 0u};
    if (mask.key_end(row, 1) > mask.key_begin(row)) {
        const i64 stat = batch * params.stat_batch_stride + head * params.stat_head_stride + row_g;
        const float* src = dq_accum + stat * params.dq_pitch + c;
        const float scale = params.scale;
        // (from L2: with arrival counts, other blocks write the accumulator while this kernel runs)
        const float4 lo = ld_relaxed_gpu_v4(src), hi = ld_relaxed_gpu_v4(src + 4);
        packed[0] = Mma<Elem>::pack(lo.x * scale, lo.y * scale);
        packed[1] = Mma<Elem>::pack(lo.z * scale, lo.w * scale);
        packed[2] = Mma<Elem>::pack(hi.x * scale, hi.y * scale);
        packed[3] = Mma<Elem>::pack(hi.z * scale, hi.w * scale);
    }
    st_global_v4(dq + batch * params.dq_batch_stride + row_g * params.dq_row_stride + head * params.dq_head_stride + c,
                 packed);
}

// Varlen: dq rows past cu_seqlens_q[batch] and dk/dv rows past cu_seqlens_k[batch] belong to no sequence, so no
// kernel above writes them; they are zeroed here so that the gradients are defined everywhere (autograd hands them
// on as they are). The bound is read on the device: no host synchronisation. blockIdx.y picks dq, dk or dv, each a
// contiguous (total, heads, d) array of row_elems[y] 16-bit elements per row (a multiple of 8); a grid-stride loop
// of 16-byte stores covers the tail, which is empty in the common case (the arrays hold exactly the sequences).
__global__ void __launch_bounds__(256)
    bwd_zero_tail(const __grid_constant__ BwdParams kernel_params) {
    const BwdParams params = kernel_params;  // (read through a local copy: common/params.cuh)
    const int which = blockIdx.y;
    u16* grad = which == 0 ? params.dq : which == 1 ? params.dk : params.dv;
    const int total = which == 0 ? params.total_q : params.total_k;
    const int row_elems = which == 0 ? params.q_row_elems : params.kv_row_elems;
    // (a bad value is reported by the other kernels)
    int end = (which == 0 ? params.cu_seqlens_q : params.cu_seqlens_k)[params.batch];
    end = end < 0 ? 0 : end > total ? total : end;
    const i64 chunk_end = (i64)total * row_elems / 8;
    const u32 zero[4] = {0u, 0u, 0u, 0u};
    for (i64 chunk = (i64)end * row_elems / 8 + blockIdx.x * 256 + threadIdx.x; chunk < chunk_end;
         chunk += (i64)gridDim.x * 256)
        st_global_v4(grad + chunk * 8, zero);
}

}  // namespace fa2
