// decode_attention's output: a warp item's rows stored by the warp, or the block's warps merged in shared memory into
// final rows (one split) or fp32 partials, which the last of an item's split blocks merges into the final rows.
#pragma once
#include "common/types.cuh"
#include "common/params.cuh"
#include "sm80/memory.cuh"
#include "sm80/mma.cuh"
#include "decode/traits.cuh"
#include "decode/merge.cuh"
#include "decode/call.cuh"

namespace fa2 {

// Warp items: the warp's rows are final (one split): each lane holds rows lane / 4 and lane / 4 + 8, two columns
// of every 8-column tile. `poison`: this thread's reason to write NaN.
template <class Tr, int kDT>
FA2_DEVICE void store_warp_rows(const DecodeCall<Tr>& call, const DecodeItem& cur, const float (&acc_o)[1][kDT][4],
                                const float (&row_lse)[2], bool poison, int item) {
    using Mma = fa2::Mma<typename Tr::Elem>;
    const DecodeParams& params = call.params;
    const int lane = call.lane;
    const bool poisoned = __any_sync(0xffffffffu, poison);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int packed = cur.row0 + (lane >> 2) + half * 8;
        if (packed >= call.rows) continue;
        u32* dst = reinterpret_cast<u32*>(call.out + call.out_row(cur, packed) * params.headdim_v);
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
            const int c = dt * 8 + (lane & 3) * 2;
            if (c < params.headdim_v)
                dst[c / 2] = poisoned ? Mma::pack(quiet_nan(), quiet_nan())
                                      : Mma::pack(acc_o[0][dt][2 * half], acc_o[0][dt][2 * half + 1]);
        }
        if ((lane & 3) == 0 && call.lse_out != nullptr)
            call.lse_out[call.lse_index(cur, packed)] = poisoned ? quiet_nan() : row_lse[half];
    }
    decode_mark(14, item);
}

// The block's rows: every warp's rows merged through shared memory (merge_area), then final (one split) or an fp32
// partial for the last block (merge_splits). `block_row` / `block_lse_row`: each row's index in out and lse_out;
// `block_lse`: shared memory for the rows' lse. Returns whether the item is poisoned (block-wide).
template <class Tr, int kDT>
FA2_DEVICE bool merge_block(const DecodeCall<Tr>& call, const DecodeItem& cur, const float (&acc_o)[1][kDT][4],
                            const float (&row_lse)[2], bool poison, int item, const i64 (&block_row)[16],
                            const i64 (&block_lse_row)[16], float (&block_lse)[16], i64 total_rows) {
    using Mma = fa2::Mma<typename Tr::Elem>;
    constexpr int kW = Tr::kWarps;
    const DecodeParams& params = call.params;
    const int warp = call.warp, lane = call.lane;
    // Every warp is done with the item's tiles and Q (the barrier).
    const bool poisoned = __syncthreads_or(poison);
    decode_mark(13, item);

    float* merge_out = reinterpret_cast<float*>(call.merge_area);  // [warp][16][kMergePitch]
    float* merge_lse = merge_out + kW * 16 * Tr::kMergePitch;     // [warp][16]
    const int real_rows = min(16, call.rows - cur.row0);          // packed rows past the group's are padding
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = (lane >> 2) + half * 8;
        if (r >= real_rows) continue;
        float* dst = merge_out + (warp * 16 + r) * Tr::kMergePitch;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt)
            *reinterpret_cast<float2*>(dst + dt * 8 + (lane & 3) * 2) =
                make_float2(acc_o[0][dt][2 * half], acc_o[0][dt][2 * half + 1]);
        if ((lane & 3) == 0) merge_lse[warp * 16 + r] = row_lse[half];
    }
    __syncthreads();
    decode_mark(20, item);
    // Per row, once: the block's lse, and each warp's lse replaced by its weight.
    if (threadIdx.x < real_rows) {
        const int r = threadIdx.x;
        const float lse = merged_lse(kW, [&](int w) { return merge_lse[w * 16 + r]; });
        for (int w = 0; w < kW; ++w) merge_lse[w * 16 + r] = part_weight(merge_lse[w * 16 + r], lse);
        block_lse[r] = lse;
    }
    __syncthreads();
    decode_mark(21, item);

    // The block's rows: merged over its warps, then final (one split) or an fp32 partial for the last block.
    // Units of (row, 2 columns) by the instantiation's head dim, so the unit -> (row, column) split is a
    // shift; a smaller run-time head dim leaves the columns past it out.
    constexpr int kPairs = Tr::kHeadDim / 2;
    for (int idx = threadIdx.x; idx < real_rows * kPairs; idx += Tr::kThreads) {
        const int r = idx / kPairs, c = (idx % kPairs) * 2;
        if (c >= params.headdim_v) continue;
        float lse = block_lse[r];
        float2 o = make_float2(0.f, 0.f);
#pragma unroll
        for (int w = 0; w < kW; ++w) {
            const float weight = merge_lse[w * 16 + r];
            const float2 part = *reinterpret_cast<const float2*>(merge_out + (w * 16 + r) * Tr::kMergePitch + c);
            o.x += weight * part.x;
            o.y += weight * part.y;
        }
        if (poisoned) o.x = o.y = lse = quiet_nan();
        const i64 row = block_row[r];
        if (params.num_splits == 1) {
            reinterpret_cast<u32*>(call.out + row * params.headdim_v)[c / 2] = Mma::pack(o.x, o.y);
            if (c == 0 && call.lse_out != nullptr) call.lse_out[block_lse_row[r]] = lse;
        } else {
            // Read back by the last block within microseconds: kept in L2 ahead of the K/V stream, which
            // had pushed them out before the last block came (1 x 16k: 0.5-1 us a call, with where the
            // workspace lies in memory).
            const u64 keep = l2_evict_last();
            st_global_f32x2(call.partial_out + (cur.split * total_rows + row) * params.headdim_v + c, o.x, o.y, keep);
            if (c == 0) st_global_f32(call.partial_lse + cur.split * total_rows + row, lse, keep);
        }
    }
    decode_mark(14, item);
    return poisoned;
}

// Split-KV through global memory: the last of the item's split blocks to arrive merges every split's partial.
// Release: the barrier puts the block's partial writes before thread 0's fence, which publishes them with its
// arrival; acquire: the last arriver's fence after the atomic, then the barrier, put every thread's reads of the
// other splits' partials after their writes. `last_to_arrive`: a shared word.
template <class Tr>
FA2_DEVICE void merge_splits(const DecodeCall<Tr>& call, const DecodeItem& cur, int item,
                             const i64 (&block_row)[16], const i64 (&block_lse_row)[16], int& last_to_arrive,
                             i64 total_rows) {
    using Mma = fa2::Mma<typename Tr::Elem>;
    const DecodeParams& params = call.params;
    const int real_rows = min(16, call.rows - cur.row0);  // packed rows past the group's are padding
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned* counter = reinterpret_cast<unsigned*>(call.arrivals + (i64)cur.b * call.groups + cur.group);
        fence_acq_rel_gpu();
        // The last arrival wraps the counter back to 0 (left as it was found) in the same atomic: no
        // store for the acquire fence below to wait for.
        last_to_arrive = atomicInc(counter, params.num_splits - 1) == (unsigned)params.num_splits - 1;
        if (last_to_arrive) fence_acq_rel_gpu();
    }
    __syncthreads();
    decode_mark(15, item);
    if (!last_to_arrive) return;
    // One (row, 4 columns) unit per thread, merged online over chunks of 16 splits whose lse and
    // partial loads are all in flight at once: one L2 round trip per chunk, no shared memory, no
    // barrier. Every thread of a row computes the row's lse itself (the same few lse loads, L2 hits).
    constexpr int kChunk = 16, kQuads = Tr::kHeadDim / 4;
    for (int t = threadIdx.x; t < real_rows * kQuads; t += Tr::kThreads) {
        const int r = t / kQuads, c = (t % kQuads) * 4;
        if (c >= params.headdim_v) continue;
        const i64 row = block_row[r];
        float max_lse = -pos_inf(), sum = 0.f;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int first = 0; first < params.num_splits; first += kChunk) {
            float l[kChunk];
            float4 x[kChunk];
            // Every split's lse and partial in flight at once (in program order: see
            // ld_relaxed_gpu), before any of the math on them.
            const float* lse_at = call.partial_lse + (i64)first * total_rows + row;
            const float* out_at = call.partial_out + ((i64)first * total_rows + row) * params.headdim_v + c;
#pragma unroll
            for (int k = 0; k < kChunk; ++k) {
                x[k] = make_float4(0.f, 0.f, 0.f, 0.f);
                l[k] = pos_inf();
                if (first + k < params.num_splits) {
                    x[k] = ld_relaxed_gpu_v4(out_at);
                    l[k] = ld_relaxed_gpu(lse_at);
                }
                lse_at += total_rows;
                out_at += total_rows * params.headdim_v;
            }
            // A part with lse +-inf saw no key and weighs 0; a NaN lse (a poisoned split) makes NaN.
            float chunk_max = max_lse;
#pragma unroll
            for (int k = 0; k < kChunk; ++k)
                if (!is_inf(l[k])) chunk_max = fmaxf(chunk_max, l[k]);
            const float rescale = chunk_max == max_lse ? 1.f : __expf(max_lse - chunk_max);
            sum *= rescale;
            o = make_float4(o.x * rescale, o.y * rescale, o.z * rescale, o.w * rescale);
#pragma unroll
            for (int k = 0; k < kChunk; ++k) {
                const float w = is_inf(l[k]) ? 0.f : __expf(l[k] - chunk_max);
                sum += w;
                o = make_float4(o.x + w * x[k].x, o.y + w * x[k].y, o.z + w * x[k].z, o.w + w * x[k].w);
            }
            max_lse = chunk_max;
        }
        const float inv = sum == 0.f ? 0.f : 1.f / sum;
        u32* dst = reinterpret_cast<u32*>(call.out + row * params.headdim_v + c);
        dst[0] = Mma::pack(o.x * inv, o.y * inv);
        dst[1] = Mma::pack(o.z * inv, o.w * inv);
        if (c == 0 && call.lse_out != nullptr)
            call.lse_out[block_lse_row[r]] = sum == 0.f ? pos_inf() : max_lse + __logf(sum);
    }
    decode_mark(16, item);
}

}  // namespace fa2
