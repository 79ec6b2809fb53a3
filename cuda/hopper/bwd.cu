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
//
// The kernel assembles its parts: the traits and shared-memory layout (hopper/bwd_traits.cuh), the producer
// (hopper/bwd_producer.cuh) and the consumers (hopper/bwd_consumer.cuh).
#include "common/types.cuh"
#include "common/warp.cuh"
#include "sm90/warpgroup.cuh"
#include "attention/masks.cuh"
#include "hopper/bwd_traits.cuh"
#include "hopper/bwd_producer.cuh"
#include "hopper/bwd_consumer.cuh"

namespace fa2 {

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
    constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN;
    extern __shared__ unsigned char smem_raw[];
    const HopperBwdSmem<Tr> smem(smem_raw);
    if (threadIdx.x == 0) {
        bwd_mark(0);  // the block's start
        smem.init_barriers();
    }
    __syncthreads();

    const HopperBwdArgs args{q, k, v, dout, lse, dsum, dq_accum, dk, dv, q_batch_stride, q_row_stride,
                             q_head_stride, k_batch_stride, k_row_stride, k_head_stride, v_batch_stride,
                             v_row_stride, v_head_stride, do_batch_stride, do_row_stride, do_head_stride,
                             dk_batch_stride, dk_row_stride, dk_head_stride, dv_batch_stride, dv_row_stride,
                             dv_head_stride, stat_batch_stride, stat_head_stride, seqlen_q, seqlen_k, heads_per_kv,
                             scale, scale_log2, tmap_q, tmap_k, tmap_v, tmap_do};
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
    // The steps (HopperBwdSteps). Each warp role works them out after its setmaxnreg: worked out before it, they
    // were live across it and spilled at head dim 64.
    const WindowMask<Tr::kMask> mask{seqlen_q, seqlen_k, window_left, window_right};
    const auto block_steps = [&] {
        HopperBwdSteps<kM> steps;
        mask.template query_tiles<kM>(key0, kN, steps.m_begin, steps.m_count);
        steps.count = heads_per_kv * steps.m_count;
        return steps;
    };
    // The roles, each called through a lambda over the kernel's state, as they were compiled when written in the
    // kernel (called directly, ptxas numbered a varlen sequence's bounds in other registers).
    if (warp >= Tr::kConsumerWarps) {
        warpgroup_release_registers<Tr::kProducerRegisters>();
        [&] { produce_dkdv<Tr>(smem, args, mask, block_steps, kv_head, batch, key0, q_start, k_start); }();
        return;
    }
    warpgroup_claim_registers<Tr::kConsumerRegisters>();
    [&] { consume_dkdv<Tr>(smem, args, mask, block_steps, kv_head, batch, key0, q_start, k_start, warp, lane); }();
}

}  // namespace fa2
