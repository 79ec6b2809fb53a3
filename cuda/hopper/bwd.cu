// FlashAttention backward for Hopper (sm_90a): the dK/dV kernel (with dQ added atomically) on wgmma tensor cores.
//
// BwdHopperParams (common/params.cuh): the work split and parameters of bwd_dkdv (cuda/bwd.cu), plus the tensor
// maps of q, k, v and dO
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
// calls without score modifiers, head dims 64 and 128, and 192 and 256 on 64-key blocks (hopper/bwd_consumer_wide.cuh:
// the warpgroups split the products by role, dV on one and dK on the other); softcap and ALiBi at head dims 64 and
// 128 (128 padded only) on the modifier rows (HopperBwdTraits' Mods); the rest runs bwd_dkdv.
//
// The kernel assembles its parts: the traits and shared-memory layout (hopper/bwd_traits.cuh), the producer
// (hopper/bwd_producer.cuh) and the consumers (hopper/bwd_consumer.cuh).
#include "common/types.cuh"
#include "common/params.cuh"
#include "common/warp.cuh"
#include "sm90/warpgroup.cuh"
#include "attention/masks.cuh"
#include "hopper/bwd_traits.cuh"
#include "hopper/bwd_producer.cuh"
#include "hopper/bwd_consumer.cuh"
#include "hopper/bwd_consumer_wide.cuh"

namespace fa2 {

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    bwd_dkdv_hopper(const __grid_constant__ BwdHopperParams kernel_params) {
    constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN;
    extern __shared__ unsigned char smem_raw[];
    const HopperBwdSmem<Tr> smem(smem_raw);
    if constexpr (Tr::kVarlen && SlabLoader<Tr::kProducerThreads, Tr::kHeadDim>::kPasses == 1) {
        // arrays narrower than the kernel: their columns past them in K, V, Q and dO zero (SlabLoader)
        if (kernel_params.bwd.headdim < Tr::kHeadDim)
            zero_shared(smem.k, 2 * Tr::KVTile::kBytes + 2 * Tr::kStages * Tr::QTile::kBytes);
    }
    // (a programmatic dQ conversion after this kernel may launch once every block has started: its blocks then take
    // the SMs of the last wave as they empty, and convert each query tile once its additions are counted)
    allow_next_grid();
    if (threadIdx.x == 0) {
        bwd_mark(0);  // the block's start
        smem.init_barriers(Tr::own_reducers(kernel_params.deterministic != 0, kernel_params.bwd.dropout_threshold));
    }
    __syncthreads();

    // The fields through a local copy (common/params.cuh); the tensor maps where they are, in the parameter space,
    // which the TMA copies name by address.
    const BwdParams params = kernel_params.bwd;
    int seqlen_q = params.max_seqlen_q, seqlen_k = params.max_seqlen_k;  // (varlen: the sequence's, below)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // The block's key tile and (kv head, batch) group. Blocks launch in chunks of group_chunk groups, and within a
    // chunk key tile by key tile: under a causal mask key tile j walks the query tiles from j on, so the longest
    // blocks of the chunk's groups start first and the short ones fill the tail (configs.HOPPER_BWD_CHUNK_BLOCKS:
    // causal GQA grids 7-20% faster than with each group's key tiles in turn). group_chunk 1 is the grid's order.
    // Deterministic: the key tiles that add to a query tile's dQ take turns from the last to the
    // first (hopper/bwd_producer.cuh), so they launch last first: the block a turn waits for started earlier.
    const bool deterministic = kernel_params.deterministic != 0;
    int kv_head, batch, key0;
    {
        const int tiles = gridDim.x, groups = gridDim.y * gridDim.z;
        const int linear = blockIdx.x + tiles * (blockIdx.y + gridDim.y * blockIdx.z);
        const int chunk = linear / (kernel_params.group_chunk * tiles), first = chunk * kernel_params.group_chunk;
        const int in_chunk = min(kernel_params.group_chunk, groups - first);
        const int r = linear - first * tiles, group = first + r % in_chunk;
        const int tile = r / in_chunk;
        kv_head = group % gridDim.y, batch = group / gridDim.y, key0 = (deterministic ? tiles - 1 - tile : tile) * kN;
    }
    const int sem_tiles = (params.max_seqlen_q + kM - 1) / kM;  // (the turn flags' or arrival counts' query tiles)
    const HopperBwdArgs args{params.q, params.k, params.v, params.dout, params.lse, params.dsum, params.dq_accum,
                             params.dk, params.dv, params.q_batch_stride, params.q_row_stride, params.q_head_stride,
                             params.k_batch_stride, params.k_row_stride, params.k_head_stride, params.v_batch_stride,
                             params.v_row_stride, params.v_head_stride, params.do_batch_stride, params.do_row_stride,
                             params.do_head_stride, params.dk_batch_stride, params.dk_row_stride,
                             params.dk_head_stride, params.dv_batch_stride, params.dv_row_stride,
                             params.dv_head_stride, params.stat_batch_stride, params.stat_head_stride, seqlen_q,
                             seqlen_k, params.heads_per_kv, params.scale, params.scale_log2, kernel_params.tmap_q,
                             kernel_params.tmap_k, kernel_params.tmap_v, kernel_params.tmap_do, kernel_params.tmap_dq,
                             kernel_params.dq_by_map != 0,
                             kernel_params.dq_semaphore != nullptr
                                 ? kernel_params.dq_semaphore + (i64)batch * params.nheads * sem_tiles
                                 : nullptr,
                             sem_tiles, deterministic, params.softcap, params.alibi_slopes, params.alibi_batch_stride,
                             params.headdim, params.headdim_v, params.rng_state, params.seed, params.offset,
                             params.dropout_threshold, params.dropout_scale, params.nheads};
    int q_start = 0, k_start = 0;  // the sequence's first rows (varlen)
    if constexpr (Tr::kVarlen) {
        const SeqBounds seq(params.cu_seqlens_q, params.cu_seqlens_k, batch, params.total_q, params.total_k,
                            params.error_claim, params.error_host, seqlen_q, seqlen_k);
        // (uniform: the loops over the sequence's tiles and what they count stay off vector registers)
        seqlen_q = warp_uniform(seqlen_q), seqlen_k = warp_uniform(seqlen_k);
        q_start = warp_uniform(seq.q_start), k_start = warp_uniform(seq.k_start);
        if (key0 >= seqlen_k) return;  // past this sequence's keys (those rows belong to the next one)
    }
    // The steps (HopperBwdSteps). Each warp role works them out after its setmaxnreg: worked out before it, they
    // were live across it and spilled at head dim 64.
    const WindowMask<Tr::kMask> mask{seqlen_q, seqlen_k, params.window_left, params.window_right};
    // Whether a block of m_count query tiles walks them rotated (rotated_start; deterministic, with the turns of
    // rotated_turn). Worked out where it is used: held across the producer's walk, the predicate spilled 4-12 bytes
    // in the 24-register wide modifier producers.
    const auto walks_rotated = [&](int m_count) {
        return Tr::kRotates && kernel_params.dq_rotate && m_count >= (seqlen_k + kN - 1) / kN;
    };
    const auto block_steps = [&] {
        HopperBwdSteps<kM> steps;
        mask.template query_tiles<kM>(key0, kN, steps.m_begin, steps.m_count);
        steps.count = params.heads_per_kv * steps.m_count;
        steps.m_shift = walks_rotated(steps.m_count) ? rotated_start(key0 / kN, (seqlen_k + kN - 1) / kN, steps.m_count)
                                                     : 0;
        return steps;
    };
    // The roles, each called through a lambda over the kernel's state, as they were compiled when written in the
    // kernel (called directly, ptxas numbered a varlen sequence's bounds in other registers).
    if (warp >= Tr::kConsumerWarps) {
        warpgroup_release_registers<Tr::kProducerRegisters>();
        [&] {
            produce_dkdv<Tr>(smem, args, mask, block_steps, walks_rotated, kv_head, batch, key0, q_start, k_start);
        }();
        return;
    }
    warpgroup_claim_registers<Tr::kConsumerRegisters>();
    if constexpr (Tr::kWide)
        [&] {
            consume_dkdv_wide<Tr>(smem, args, mask, block_steps, kv_head, batch, key0, q_start, k_start, warp, lane);
        }();
    else
        [&] { consume_dkdv<Tr>(smem, args, mask, block_steps, kv_head, batch, key0, q_start, k_start, warp, lane); }();
}

}  // namespace fa2
