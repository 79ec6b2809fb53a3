// Decode-time attention (FA2 paper §4.2, "flash-decoding"): the pieces that exist so far.
//
//   decode_split   one warp per (split of the keys, 16 packed query rows, kv head, batch row): the rows are the
//                  (new token, query head) pairs that share one KV head (GQA packing), so each K/V byte is read
//                  once per KV head; the keys of a batch row are divided into `num_splits` ranges (split-KV) so
//                  that small batches still fill the GPU; K/V rows come from a contiguous or a paged cache.
//                  Writes fp32 partial (out, lse) per split.
//   merge_states   merges attention computed over disjoint key sets, (out_i, lse_i) -> (out, lse): the combine
//                  step of split-KV decoding, and fa2cupy.merge_attention_states for cascade / prefix-shared
//                  attention and context parallelism.
//
// A part whose lse is +inf or -inf saw no key (flash-attn writes +inf for such rows) and gets weight 0; a row that
// no part saw gets out = 0 and lse = +inf, the same convention as the forward.
#include "primitives.cuh"
#include "softmax.cuh"

namespace fa2 {

// Loads 8 consecutive elements as fp32 (16-bit types: one 16-byte load; fp32: two).
template <class E>
struct Load8 {
    static FA2_DEVICE void run(const void* ptr, float (&x)[8]) {
        u32 r[4];
        ld_global_v4(ptr, r);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = unpack2<E>(r[i]);
            x[2 * i] = f.x;
            x[2 * i + 1] = f.y;
        }
    }
};
template <>
struct Load8<f32> {
    static FA2_DEVICE void run(const void* ptr, float (&x)[8]) {
        u32 lo[4], hi[4];
        ld_global_v4(ptr, lo);
        ld_global_v4(static_cast<const float*>(ptr) + 4, hi);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            x[i] = __uint_as_float(lo[i]);
            x[4 + i] = __uint_as_float(hi[i]);
        }
    }
};

// parts: (n, rows, d) contiguous, element type In; lses: (n, rows) float32; out: (rows, d) contiguous in Out;
// lse_out: (rows,) float32. One warp per row; lanes cover the head dim 8 elements at a time. `rows` flattens
// whatever (batch, seqlen, heads) order the caller uses, identically for parts and lses.
template <class In, class Out>
__global__ void __launch_bounds__(256, 1)
    merge_states(const void* __restrict__ parts, const float* __restrict__ lses, u16* __restrict__ out,
                 float* __restrict__ lse_out, int n, i64 rows, int headdim) {
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= rows) return;
    float m = -pos_inf();
    for (int i = 0; i < n; ++i) {
        const float l = lses[i * rows + row];
        if (l != pos_inf() && l != -pos_inf()) m = fmaxf(m, l);  // +-inf: the part saw no key
    }
    float total = 0.f;
    for (int i = 0; i < n; ++i) {
        const float l = lses[i * rows + row];
        if (l != pos_inf() && l != -pos_inf()) total += __expf(l - m);
    }
    const bool empty = total == 0.f;  // NaN lse (a NaN input) propagates through total
    const float lse = empty ? pos_inf() : m + __logf(total);
    if (lane == 0) lse_out[row] = lse;
    for (int c = lane * 8; c < headdim; c += 32 * 8) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int i = 0; i < n; ++i) {
            const float l = lses[i * rows + row];
            if (empty || l == pos_inf() || l == -pos_inf()) continue;
            const float w = __expf(l - lse);
            float x[8];
            Load8<In>::run(static_cast<const char*>(parts) + ((i * rows + row) * headdim + c) * kElemBytes<In>,
                           x);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] += w * x[j];
        }
        u32 packed[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) packed[j] = Mma<Out>::pack(acc[2 * j], acc[2 * j + 1]);
        st_global_v4(out + row * headdim + c, packed);
    }
}


// ---------------------------------------------------------------------------------------------------------------
template <int HeadDim, int BlockN, int Stages, class Elem_, bool Causal, bool Paged>
struct DecodeTraits {
    using Elem = Elem_;
    static constexpr int kHeadDim = HeadDim, kBlockN = BlockN, kStages = Stages, kThreads = 32;
    static constexpr bool kCausal = Causal, kPaged = Paged;
    using QTile = SmemTile<16, HeadDim>;
    using KVTile = SmemTile<BlockN, HeadDim>;
    static constexpr int kSmemBytes = QTile::kBytes + 2 * Stages * KVTile::kBytes;
    static_assert(Stages >= 2, "the K/V ring needs at least two stages");
};

// q: (batch, seqlen_q, nheads, d); k/v cache: (batch_cache, capacity, nheads_kv, d) or paged (pages, page_size,
// nheads_kv, d) with block_table (batch, max_pages); seqlens_k: keys per batch row (after the append).
// out_partial: (num_splits, batch, seqlen_q, nheads, d) fp32; lse_partial: (num_splits, batch, seqlen_q, nheads).
template <class Tr>
__global__ void __launch_bounds__(32)
    decode_split(const u16* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
                 const int* __restrict__ block_table, const int* __restrict__ seqlens_k,
                 const int* __restrict__ cache_batch_idx, float* __restrict__ out_partial,
                 float* __restrict__ lse_partial, i64 q_batch_stride, int q_row_stride, i64 q_head_stride,
                 i64 k_batch_stride, int k_row_stride, i64 k_head_stride, i64 v_batch_stride, int v_row_stride,
                 i64 v_head_stride, int batch, int seqlen_q, int nheads, int heads_per_kv, int headdim,
                 int page_size, int max_pages, float scale, float scale_log2) {
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    using Mma = fa2::Mma<typename Tr::Elem>;
    constexpr int kNT = Tr::kBlockN / 8, kDT = Tr::kHeadDim / 8, kKSteps = Tr::kHeadDim / 16;

    extern __shared__ __align__(128) unsigned char smem[];
    const u32 smem_q = smem_u32(smem);
    const u32 smem_k = smem_q + QTile::kBytes;
    const u32 smem_v = smem_k + Tr::kStages * KVTile::kBytes;

    const int lane = threadIdx.x;
    const int split = blockIdx.x, num_splits = gridDim.x;
    const int nheads_kv = nheads / heads_per_kv;
    const int kv_head = blockIdx.y % nheads_kv, row_block = blockIdx.y / nheads_kv;
    const int b = blockIdx.z;
    const int rows = seqlen_q * heads_per_kv;  // packed rows r = query * heads_per_kv + head-in-group
    const int row0 = row_block * 16;
    const int seqlen_k = seqlens_k[b];
    const int cache_row = cache_batch_idx != nullptr ? cache_batch_idx[b] : b;

    // This split's keys, whole BlockN tiles except at the end; under the causal mask no row of the block sees
    // keys past the last row's limit.
    const int per_split = ((seqlen_k + num_splits - 1) / num_splits + Tr::kBlockN - 1) / Tr::kBlockN * Tr::kBlockN;
    const int key_begin = split * per_split;
    int key_end = min(seqlen_k, key_begin + per_split);
    if (Tr::kCausal) {
        const int last_query = min(seqlen_q - 1, (min(rows, row0 + 16) - 1) / heads_per_kv);
        key_end = min(key_end, seqlen_k - seqlen_q + last_query + 1);
    }
    const int n_tiles = key_end > key_begin ? (key_end - key_begin + Tr::kBlockN - 1) / Tr::kBlockN : 0;

    // Gathered loads: Q rows by (query, head), K/V rows by (page, offset) or (cache row, position).
    auto q_row = [&](int r) {
        const int packed = row0 + r, query = packed / heads_per_kv;
        const int head = kv_head * heads_per_kv + packed % heads_per_kv;
        return q + b * q_batch_stride + (i64)query * q_row_stride + head * q_head_stride;
    };
    auto kv_offset = [&](int key, i64 batch_stride, int row_stride, i64 head_stride) -> i64 {
        if (Tr::kPaged) {
            const int page = block_table[(i64)b * max_pages + key / page_size];
            return page * batch_stride + (i64)(key % page_size) * row_stride + kv_head * head_stride;
        }
        return cache_row * batch_stride + (i64)key * row_stride + kv_head * head_stride;
    };
    auto load_kv = [&](int tile, int slot) {
        const int first = key_begin + tile * Tr::kBlockN;
        constexpr int kChunks = Tr::kBlockN * kDT;
#pragma unroll 4
        for (int i = 0; i < kChunks / 32; ++i) {
            const int idx = lane + i * 32, r = idx / kDT, c = (idx % kDT) * 8;
            const int key = first + r;
            const bool ok = key < key_end && c < headdim;
            const int safe = ok ? key : key_begin;  // a valid row: cp.async reads nothing when !ok anyway
            cp_async_16(KVTile::at(smem_k + slot * KVTile::kBytes, r, c),
                        k_cache + kv_offset(safe, k_batch_stride, k_row_stride, k_head_stride) + c, ok);
            cp_async_16(KVTile::at(smem_v + slot * KVTile::kBytes, r, c),
                        v_cache + kv_offset(safe, v_batch_stride, v_row_stride, v_head_stride) + c, ok);
        }
    };

    float acc_o[1][kDT][4];
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
    OnlineSoftmax<1, kNT> softmax;
    softmax.init();

    if (n_tiles > 0) {
#pragma unroll
        for (int i = 0; i < 16 * kDT / 32; ++i) {
            const int idx = lane + i * 32, r = idx / kDT, c = (idx % kDT) * 8;
            const bool ok = row0 + r < rows && c < headdim;
            cp_async_16(QTile::at(smem_q, r, c), ok ? q_row(r) + c : q, ok);
        }
#pragma unroll
        for (int s = 0; s < Tr::kStages - 1; ++s) {
            if (s < n_tiles) load_kv(s, s);
            cp_async_commit();
        }
        for (int tile = 0; tile < n_tiles; ++tile) {
            cp_async_wait<Tr::kStages - 2>();
            __syncwarp();
            {
                const int ahead = tile + Tr::kStages - 1;
                if (ahead < n_tiles) load_kv(ahead, ahead % Tr::kStages);
                cp_async_commit();
            }
            const u32 k_slot = smem_k + (tile % Tr::kStages) * KVTile::kBytes;
            const u32 v_slot = smem_v + (tile % Tr::kStages) * KVTile::kBytes;
            float s[1][kNT][4];
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[0][nt][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < kKSteps; ++kk) {
                u32 a[4];
                QTile::load_a(a, smem_q, 0, kk * 16, lane);
#pragma unroll
                for (int np = 0; np < kNT / 2; ++np) {
                    u32 bk[4];
                    KVTile::load_b_nk(bk, k_slot, np * 16, kk * 16, lane);
                    Mma::run(s[0][2 * np], a, bk[0], bk[1]);
                    Mma::run(s[0][2 * np + 1], a, bk[2], bk[3]);
                }
            }
            // Mask keys past this split's end and, under the causal mask, past each row's own query.
            const int first = key_begin + tile * Tr::kBlockN;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int query = (row0 + (lane >> 2) + half * 8) / heads_per_kv;
                const int limit = Tr::kCausal ? min(key_end, seqlen_k - seqlen_q + query + 1) : key_end;
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) {
                    const int key = first + nt * 8 + (lane & 3) * 2;
                    if (key >= limit) s[0][nt][2 * half] = -pos_inf();
                    if (key + 1 >= limit) s[0][nt][2 * half + 1] = -pos_inf();
                }
            }
            softmax.update(s, acc_o, scale_log2);
#pragma unroll
            for (int kk = 0; kk < kNT / 2; ++kk) {
                u32 a[4];
                c_to_a<typename Tr::Elem>(a, s[0][2 * kk], s[0][2 * kk + 1]);
#pragma unroll
                for (int dp = 0; dp < kDT / 2; ++dp) {
                    u32 bv[4];
                    KVTile::load_b_kn(bv, v_slot, kk * 16, dp * 16, lane);
                    Mma::run(acc_o[0][2 * dp], a, bv[0], bv[1]);
                    Mma::run(acc_o[0][2 * dp + 1], a, bv[2], bv[3]);
                }
            }
        }
        cp_async_wait<0>();
    }
    float row_lse[2];
    softmax.finalize(acc_o, row_lse, scale);

    // Partial results in fp32, unpacked: row (query, head) of this split.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int packed = row0 + (lane >> 2) + half * 8;
        if (packed < rows) {
            const int query = packed / heads_per_kv, head = kv_head * heads_per_kv + packed % heads_per_kv;
            const i64 row = (((i64)split * batch + b) * seqlen_q + query) * nheads + head;
            float* dst = out_partial + row * headdim;
#pragma unroll
            for (int dt = 0; dt < kDT; ++dt) {
                const int c = dt * 8 + (lane & 3) * 2;
                if (c < headdim)
                    *reinterpret_cast<float2*>(dst + c) = make_float2(acc_o[0][dt][2 * half], acc_o[0][dt][2 * half + 1]);
            }
            if ((lane & 3) == 0) lse_partial[row] = row_lse[half];
        }
    }
}

}  // namespace fa2
