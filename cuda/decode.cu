// Decode-time attention (FA2 paper §4.2, "flash-decoding") over a KV cache.
//
//   kvcache_append    writes the new keys/values into the cache at each row's length, after checking every index
//                     value the host cannot see (cache_seqlens, cache_batch_idx, block_table, cache_leftpad): one
//                     bad value and nothing is written. With rotary embeddings it stores the keys rotated.
//   rotary_q          rotates q (rotary embeddings) into a temporary that the attention reads.
//   decode_attention  work items of (split of the keys, 16 packed query rows, kv head, batch row): one block per
//                     item, or, when there are more items than the GPU holds blocks, fewer blocks that walk them
//                     (each warp's ring runs on into the next item while the block merges the last). The rows are
//                     the (new token, query head) pairs that share one KV head (GQA packing), so each K/V byte is
//                     read once per KV head, on tensor cores. The warps of all the row's split blocks take its key
//                     tiles in turn, each through its own cp.async ring (more bytes in flight per SM), and merge in
//                     shared memory; the splits of a row (split-KV, so that small batches fill the GPU) write fp32
//                     partials, and the last split block to finish merges them: one launch per call. Its Extras
//                     variant adds the sliding window, softcap, ALiBi and left-padded caches.
//   merge_states      merges attention computed over disjoint key sets, (out_i, lse_i) -> (out, lse):
//                     fa2cupy.merge_attention_states for cascade / prefix-shared attention and context parallelism.
//
// A part whose lse is +inf or -inf saw no key (flash-attn writes +inf for such rows) and gets weight 0; a row that
// no part saw gets out = 0 and lse = +inf, the same convention as the forward.
//
// Bad index values are found on the device, where the values are: the first thread to find one claims the report
// (atomicExch on a device word) and writes it to pinned host memory that the host reads without synchronising
// (fa2cupy/device_errors.py); every output row computed while a report is pending is NaN, never a wrong number.
#include "common/types.cuh"
#include "common/params.cuh"
#include "common/fast_div.cuh"
#include "common/clock.cuh"
#include "common/hints.cuh"
#include "common/math.cuh"
#include "common/errors.cuh"
#include "sm80/memory.cuh"
#include "sm80/mma.cuh"
#include "sm80/smem_tile.cuh"
#include "sm80/tile_mma.cuh"
#include "sm90/grid_dependencies.cuh"
#include "attention/softmax.cuh"
#include "attention/masks.cuh"
#include "decode/traits.cuh"
#include "decode/merge.cuh"
#include "decode/items.cuh"
#include "decode/loads.cuh"
#include "decode/store.cuh"
#include "decode/ring.cuh"

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
    merge_states(const __grid_constant__ MergeParams kernel_params) {
    const MergeParams params = kernel_params;  // (read through a local copy: common/params.cuh)
    const void* __restrict__ parts = params.parts;
    const float* __restrict__ lses = params.lses;
    u16* __restrict__ out = params.out;
    float* __restrict__ lse_out = params.lse_out;
    const int n = params.n, headdim = params.headdim;
    const i64 rows = params.rows;
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= rows) return;
    const float lse = merged_lse(n, [&](int i) { return lses[i * rows + row]; });
    if (lane == 0) lse_out[row] = lse;
    for (int c = lane * 8; c < headdim; c += 32 * 8) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int i = 0; i < n; ++i) {
            const float w = part_weight(lses[i * rows + row], lse);
            if (w == 0.f) continue;
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
// Rotary embedding (RoPE) with flash-attn's conventions: position p rotates pair i of the first rotary_dim columns
// by the angle whose cosine and sine are cos[p, i] and sin[p, i] ((seqlen_ro, rotary_dim / 2) tables in the data
// type). Interleaved pairs are columns (2i, 2i + 1); GPT-NeoX pairs (not interleaved) are columns (i, i +
// rotary_dim / 2). Columns from rotary_dim on pass through. fp32 arithmetic, one rounding to the data type.
struct Rotary {
    const u16* cos;
    const u16* sin;
    int rotary_dim;  // 0: no rotary embedding
    int seqlen_ro;   // rows of cos / sin: positions must lie below
    bool interleaved;
};

template <class Elem>
FA2_DEVICE float to_float(u16 x) {
    return unpack2<Elem>(x).x;
}

// chunk: columns c..c+7 of the head vector that starts at `row` (global memory), already loaded; rotated in place
// for position pos. A NeoX partner column lives rotary_dim / 2 away, usually in another chunk: read from `row`.
template <class Elem>
FA2_DEVICE void rotate_chunk(u32 (&chunk)[4], const u16* row, int c, int pos, const Rotary& rot) {
    if (c >= rot.rotary_dim) return;
    const int half = rot.rotary_dim / 2;
    const u16* cos_row = rot.cos + (i64)pos * half;
    const u16* sin_row = rot.sin + (i64)pos * half;
    float x[8], y[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = unpack2<Elem>(chunk[i]);
        x[2 * i] = f.x;
        x[2 * i + 1] = f.y;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int col = c + e;
        y[e] = x[e];
        if (col >= rot.rotary_dim) continue;
        const int i = rot.interleaved ? col / 2 : (col < half ? col : col - half);
        const float cs = to_float<Elem>(cos_row[i]), sn = to_float<Elem>(sin_row[i]);
        if (rot.interleaved) {  // c is a multiple of 8, so both columns of a pair are in this chunk
            if (e & 1)
                y[e] = x[e - 1] * sn + x[e] * cs;
            else
                y[e] = x[e] * cs - x[e + 1] * sn;
        } else if (col < half) {
            y[e] = x[e] * cs - to_float<Elem>(row[col + half]) * sn;
        } else {
            y[e] = to_float<Elem>(row[i]) * sn + x[e] * cs;
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) chunk[i] = Mma<Elem>::pack(y[2 * i], y[2 * i + 1]);
}

// k_new/v_new: (batch, seqlen_new, nheads_kv, d); caches as in decode_attention. Every block first checks all the
// index values the call will use (cheap: O(batch + pages in use), from L2) and writes nothing if one is bad, so a
// rejected call leaves the caches untouched; then the blocks copy 16-byte chunks, grid-stride.
// Extras (rotary embedding and/or cache_leftpad; Elem is the data type, for the rotation's arithmetic): also checks
// each row's left pad (0 <= cache_leftpad[b] <= cache_seqlens[b]) and rotary positions, those of the new keys and
// the `q_span` positions the query rotation (rotary_q) will use from cache_seqlens[b] on, and rotates the new keys
// at their slots cache_seqlens[b] + t (flash-attn: the position is the slot, left pad included).
template <bool Paged, bool Extras = false, class Elem = f16>
__global__ void __launch_bounds__(256)
    kvcache_append(const __grid_constant__ DecodeParams kernel_params) {
    const DecodeParams params = kernel_params;  // (read through a local copy: common/params.cuh)
    const u16* __restrict__ k_new = params.k_new;
    const u16* __restrict__ v_new = params.v_new;
    u16* __restrict__ k_cache = params.k_cache;
    u16* __restrict__ v_cache = params.v_cache;
    const int* __restrict__ block_table = params.block_table;
    const int* __restrict__ cache_seqlens = params.cache_seqlens;
    const int* __restrict__ cache_batch_idx = params.cache_batch_idx;
    const int* __restrict__ cache_leftpad = params.cache_leftpad;
    wait_for_prior_grids();
    allow_next_grid();
    const CacheIndex index{block_table, cache_seqlens, cache_batch_idx, (int)params.fixed_seqlen, params.seqlen_new,
                           params.capacity,    params.cache_rows,    params.page_size,       params.max_pages};
    const bool reporter = blockIdx.x == 0;
    bool bad = false;
    for (int b = threadIdx.x; b < params.batch; b += blockDim.x) {
        const int len = index.cached(b);
        if (!index.seqlen_ok(len)) {
            bad = true;
            if (reporter) report_bad_value(params.error_claim, params.error_host, kBadCacheSeqlen, b, 0, len);
        }
        if (!Paged && !index.row_ok(index.cache_row(b))) {
            bad = true;
            if (reporter)
                report_bad_value(params.error_claim, params.error_host, kBadCacheBatchIdx, b, 0, index.cache_row(b));
        }
        if constexpr (Extras) {
            if (index.seqlen_ok(len)) {
                const int pad = cache_leftpad != nullptr ? cache_leftpad[b] : 0;
                if (pad < 0 || pad > len) {
                    bad = true;
                    if (reporter) report_bad_value(params.error_claim, params.error_host, kBadCacheLeftpad, b, 0, pad);
                }
                const int last = len + max(params.seqlen_new, params.q_span) - 1;
                if (params.rotary_dim > 0 && last >= params.seqlen_ro) {
                    bad = true;
                    if (reporter)
                        report_bad_value(params.error_claim, params.error_host, kBadRotaryPosition, b, 0, last);
                }
            }
        }
    }
    if (Paged) {  // every page a row reads or writes, not only the appended ones: the attention reads them all
        for (int b = 0; b < params.batch; ++b) {
            const int len = index.cached(b);
            if (!index.seqlen_ok(len)) continue;
            const int used = (len + params.seqlen_new + params.page_size - 1) / params.page_size;
            for (int p = threadIdx.x; p < used; p += blockDim.x) {
                const int page = block_table[(i64)b * params.max_pages + p];
                if (!index.row_ok(page)) {
                    bad = true;
                    if (reporter) report_bad_value(params.error_claim, params.error_host, kBadBlockTable, b, p, page);
                }
            }
        }
    }
    if (__syncthreads_or(bad)) return;

    const Rotary rot{params.rotary_cos, params.rotary_sin, params.rotary_dim, params.seqlen_ro,
                     params.rotary_interleaved != 0};
    const int chunks_per_row = params.headdim / 8;
    const i64 chunks = (i64)params.batch * params.seqlen_new * params.nheads_kv * chunks_per_row;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < chunks; i += (i64)gridDim.x * blockDim.x) {
        const int c = (int)(i % chunks_per_row) * 8;
        const int head = (int)(i / chunks_per_row % params.nheads_kv);
        const int t = (int)(i / ((i64)chunks_per_row * params.nheads_kv) % params.seqlen_new);
        const int b = (int)(i / ((i64)chunks_per_row * params.nheads_kv * params.seqlen_new));
        const int pos = index.cached(b) + t;
        i64 row_base;
        int slot;
        if (Paged) {
            row_base = block_table[(i64)b * params.max_pages + pos / params.page_size];
            slot = pos % params.page_size;
        } else {
            row_base = index.cache_row(b);
            slot = pos;
        }
        u32 chunk[4];
        const u16* k_row =
            k_new + b * params.k_new_batch_stride + (i64)t * params.k_new_row_stride + head * params.k_new_head_stride;
        ld_global_v4(k_row + c, chunk);
        if constexpr (Extras) rotate_chunk<Elem>(chunk, k_row, c, pos, rot);
        st_global_v4(k_cache + row_base * params.k_batch_stride + (i64)slot * params.k_row_stride +
                         head * params.k_head_stride + c,
                     chunk);
        ld_global_v4(v_new + b * params.v_new_batch_stride + (i64)t * params.v_new_row_stride +
                         head * params.v_new_head_stride + c,
                     chunk);
        st_global_v4(v_cache + row_base * params.v_batch_stride + (i64)slot * params.v_row_stride +
                         head * params.v_head_stride + c,
                     chunk);
    }
}

// q rotated into q_out, (batch, seqlen_q, nheads, d) contiguous, which the attention then reads: query t of batch
// row b is at position cache_seqlens[b] + t when `advance` (causal or local attention) and at cache_seqlens[b]
// otherwise, flash-attn's rule. The values it reads are checked as the attention checks them: a bad one is
// reported, its rows are written as zeros, and the attention kernel, launched after this one, returns NaN.
template <class Elem>
__global__ void __launch_bounds__(256)
    rotary_q(const __grid_constant__ DecodeParams kernel_params) {
    const DecodeParams params = kernel_params;  // (read through a local copy: common/params.cuh)
    const u16* __restrict__ q = params.q;
    u16* __restrict__ q_out = params.q_rotated;
    const int* __restrict__ cache_seqlens = params.cache_seqlens;
    wait_for_prior_grids();
    allow_next_grid();
    const CacheIndex index{nullptr,         cache_seqlens, nullptr, (int)params.fixed_seqlen, params.seqlen_new,
                           params.capacity, 0,             0,       0};
    const Rotary rot{params.rotary_cos, params.rotary_sin, params.rotary_dim, params.seqlen_ro,
                     params.rotary_interleaved != 0};
    const int chunks_per_row = params.headdim / 8;
    const i64 chunks = (i64)params.batch * params.seqlen_q * params.nheads * chunks_per_row;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < chunks; i += (i64)gridDim.x * blockDim.x) {
        const int c = (int)(i % chunks_per_row) * 8;
        const int head = (int)(i / chunks_per_row % params.nheads);
        const int t = (int)(i / ((i64)chunks_per_row * params.nheads) % params.seqlen_q);
        const int b = (int)(i / ((i64)chunks_per_row * params.nheads * params.seqlen_q));
        const int len = index.cached(b), pos = len + (params.rotary_advance ? t : 0);
        u32 chunk[4] = {0u, 0u, 0u, 0u};
        if (!index.seqlen_ok(len)) {
            report_bad_value(params.error_claim, params.error_host, kBadCacheSeqlen, b, 0, len);
        } else if (pos >= params.seqlen_ro) {
            report_bad_value(params.error_claim, params.error_host, kBadRotaryPosition, b, 0, pos);
        } else {
            const u16* row = q + b * params.q_batch_stride + (i64)t * params.q_row_stride + head * params.q_head_stride;
            ld_global_v4(row + c, chunk);
            rotate_chunk<Elem>(chunk, row, c, pos, rot);
        }
        st_global_v4(q_out + i * 8, chunk);
    }
}

// q: (batch, seqlen_q, nheads, d); k/v cache: (batch_cache, capacity, nheads_kv, d) or paged (pages, page_size,
// nheads_kv, d) with block_table (batch, max_pages); row b attends to its first cache_seqlens[b] + seqlen_new keys
// (the append kernel has written the new ones). out: (batch, seqlen_q, nheads, d) contiguous; lse_out: (batch,
// nheads, seqlen_q) or null. With more than one split: partial_out (splits, batch * seqlen_q * nheads, d) fp32,
// partial_lse (splits, batch * seqlen_q * nheads), arrivals (batch * groups) int32 zeroed before the launch.
// Tr::kExtras: alibi_slopes float32 (batch, nheads) with batch stride alibi_batch_stride (0 for (nheads,)) or null;
// cache_leftpad (batch,) or null (contiguous caches only): row b's keys are slots [cache_leftpad[b], cache_seqlens[b]
// + seqlen_new); window_left / window_right (kUnlimitedWindow for no limit); softcap (0 for none). The scores become
// final logits (ScoreMods) and the softmax runs with scale 1.
// Work items: num_splits x groups (nheads_kv x blocks of 16 packed rows) x batch, the split fastest. A 1-D grid of
// one block per item, or fewer blocks (with kPersistentSmemBytes of shared memory) that walk the items in grid
// strides: each warp's ring then runs on into the next item, whose first tiles load while the block merges.
// Tr::kWarpItems (one split): warp w of block x takes items x * warps + w, + gridDim.x * warps, ... alone (the warps
// of a block read neighbouring kv heads of the same tokens).
template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    decode_attention(const __grid_constant__ DecodeParams kernel_params) {
    const DecodeParams params = kernel_params;  // (read through a local copy: common/params.cuh)
    const u16* __restrict__ q = params.q;
    const u16* __restrict__ k_cache = params.k_cache;
    const u16* __restrict__ v_cache = params.v_cache;
    const int* __restrict__ block_table = params.block_table;
    const int* __restrict__ cache_seqlens = params.cache_seqlens;
    const int* __restrict__ cache_batch_idx = params.cache_batch_idx;
    const int* __restrict__ cache_leftpad = params.cache_leftpad;
    const float* __restrict__ alibi_slopes = params.alibi_slopes;
    u16* __restrict__ out = params.out;
    float* __restrict__ lse_out = params.lse_out;
    float* __restrict__ partial_out = params.partial_out;
    float* __restrict__ partial_lse = params.partial_lse;
    int* __restrict__ arrivals = params.arrivals;
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    using Mma = fa2::Mma<typename Tr::Elem>;
    constexpr int kNT = Tr::kBlockN / 8, kDT = Tr::kHeadDim / 8, kKSteps = Tr::kHeadDim / 16, kW = Tr::kWarps;
    constexpr int kS = Tr::kStages;
    // Warp items: a warp's tiles are all of its item's; otherwise the block's warps take the item's tiles in turn.
    constexpr bool solo = Tr::kWarpItems;
    constexpr int kTileStride = solo ? 1 : kW;
    const int tile_stride = params.num_splits * kTileStride;  // between a warp's tiles of an item

    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tile_warp = solo ? 0 : warp;  // the warp's first tile of an item
    // Q tiles of items 0, 2, 4, ... of this block (warp items: of this warp), then 1, 3, 5, ...; then each warp's
    // ring (warp items: each warp's Q tiles and ring together).
    constexpr int kWarpBytes = solo ? Tr::kQBytes + Tr::kRingBytes : Tr::kRingBytes;
    const u32 smem_q = smem_u32(smem) + (solo ? warp * kWarpBytes : 0);
    const u32 smem_k = smem_q + Tr::kQBytes + (solo ? 0 : warp * kWarpBytes);
    const u32 smem_v = smem_k + kS * KVTile::kBytes;

    // Run-time divisors of the index arithmetic, as multiplications (the launch's start waits on them).
    const FastDiv by_heads_per_kv{params.heads_per_kv_magic, params.heads_per_kv_shift};
    const FastDiv by_page_size{params.page_size_magic, params.page_size_shift};
    const int nheads_kv = by_heads_per_kv.div(params.nheads);
    const int rows = params.seqlen_q * params.heads_per_kv;  // packed rows r = query * heads_per_kv + head-in-group
    const int groups = nheads_kv * ((rows + 15) / 16);
    const FastDiv by_splits{params.splits_magic, params.splits_shift};
    const FastDiv by_groups{params.groups_magic, params.groups_shift};
    const FastDiv by_heads_kv{params.heads_kv_magic, params.heads_kv_shift};
    const int items = params.num_splits * groups * params.batch;
    const unsigned walkers = solo ? gridDim.x * kW : gridDim.x;  // blocks, or warps, that take items
    const bool persistent = (int)walkers < items;
    unsigned char* merge_area = smem + Tr::kQAreaBytes + (persistent ? kW * Tr::kRingBytes : 0);
    const CacheIndex index{block_table, cache_seqlens, cache_batch_idx, (int)params.fixed_seqlen, params.seqlen_new,
                           params.capacity,    params.cache_rows,    params.page_size,       params.max_pages};
    // An item's place in the grid (index arithmetic only: no memory access, so also before the wait).
    auto item_coords = [&](int item, DecodeItem& it) {
        const int split_major = by_splits.div(item);
        it.split = item - split_major * params.num_splits;
        it.b = by_groups.div(split_major);
        it.group = split_major - it.b * groups;
        const int row_block = by_heads_kv.div(it.group);
        it.kv_head = it.group - row_block * nheads_kv;
        it.row0 = row_block * 16;
    };
    // An item's index values are loaded first (their latency hides behind other work) and checked later.
    auto item_loads = [&](DecodeItem& it) {
        it.cached = index.cached(it.b);
        it.cache_row = index.cache_row(it.b);
        it.pad = Tr::kExtras && cache_leftpad != nullptr ? cache_leftpad[it.b] : 0;
    };
    auto item_values = [&](int item, DecodeItem& it) {
        item_coords(item, it);
        item_loads(it);
    };
    // Values the host could not check. A bad one poisons the item: it writes NaN. Then the row's keys that some row
    // of the block sees (under the causal mask, none past the last row's limit), in BlockN tiles, and this warp's
    // share of them (warp items: the warp takes them all).
    auto item_check = [&](DecodeItem& it) {
        check_item<Tr>(it, index, lane, params.error_claim, params.error_host, params.seqlen_new, params.seqlen_q, rows,
                       by_heads_per_kv, by_splits, params.window_left, params.window_right, tile_warp, tile_stride);
    };
    // First key of the warp's j-th tile of an item.
    auto tile_first = [&](const DecodeItem& it, int j) {
        return it.key_begin + (it.first_tile + j * tile_stride) * Tr::kBlockN;
    };

    // Packed row `packed` of an item of kv head `kv_head`: its query (new token) and its query head.
    auto query_head = [&](int kv_head, int packed, int& query, int& head) {
        query = by_heads_per_kv.div(packed);
        head = kv_head * params.heads_per_kv + packed - query * params.heads_per_kv;
    };

    // Paged: a tile starts on a multiple of 16 keys and pages hold multiples of 16, so it spans at most BlockN / 16
    // pages. A tile's first key and (paged) the index of its first page and the key's slot there, worked out once.
    constexpr int kTilePages = Tr::kPaged ? Tr::kBlockN / 16 : 1;
    using TileStart = DecodeTileStart;
    auto tile_start = [&](int first) {
        TileStart t{first, 0, 0};
        if constexpr (Tr::kPaged) {
            t.page = by_page_size.div(first);
            t.offset = first - t.page * params.page_size;
        }
        return t;
    };
    // The block_table entries of the pages the tile reaches in batch row b (0 past max_pages); `early`: read before
    // wait_for_prior_grids, as guesses.
    auto tile_entries = [&](int b, const TileStart& t, int (&entries)[kTilePages], bool early) {
        read_tile_entries<Tr>(block_table, params.max_pages, params.page_size, b, t, entries, early);
    };
    // Paged: a tile's entries kept where the tile uses the page (else 0) and checked; true if one was out of range
    // (reported unless `guessed`, and read as zeros).
    auto check_pages = [&](const DecodeItem& it, const TileStart& t, int (&pages)[kTilePages], bool guessed) -> bool {
        return check_tile_pages<Tr>(index, params.error_claim, params.error_host, params.page_size, params.max_pages,
                                    it, t, pages, guessed);
    };

    // A key tile's copies, worked out apart from issuing them (the first item's are worked out before the wait):
    // where a warp covers whole rows per pass (kWalk), each lane keeps one column and walks down the tile's rows
    // 32 / kDT at a time, a pointer per page the tile spans (a contiguous cache is one page) advanced by a fixed
    // step, instead of 64-bit index arithmetic per copy (~11 instructions a copy; a call's first two tiles are 64
    // copies a lane, and its first loads had gone out ~500 instructions after the wait, its last ~1400).
    // (Head dims up to 128: the larger ones' kernels sit at the register cap, where the walk's pointers spilled.)
    constexpr bool kWalk = 32 % kDT == 0 && Tr::kHeadDim <= 128;
    constexpr int kRowStep = kWalk ? 32 / kDT : 1;
    using KVPlan = DecodeKVPlan<kTilePages>;
    auto plan_kv = [&](const DecodeItem& it, const TileStart& t, const int (&pages)[kTilePages], bool bad_page) {
        return plan_kv_tile<Tr>(lane, params.page_size, params.k_batch_stride, params.v_batch_stride, k_cache, v_cache,
                                params.k_row_stride, params.v_row_stride, params.k_head_stride, params.v_head_stride,
                                params.headdim, it, t, pages, bad_page);
    };
    // A call whose K/V are larger than L2 streams them under evict-first: they cannot stay in L2 anyway, and so
    // they do not push out what can (1 x 16k: the queued call 28.0 -> 27.55 us, docs/design.md). Other calls
    // copy under evict-unchanged, as if with no policy.
    const u64 stream_policy = params.stream_larger_than_l2 ? l2_evict_first() : l2_evict_unchanged();
    auto copy_kv = [&](u32 dst, const u16* src, bool ok) {
        if constexpr (Tr::kL2Prefetch)
            cp_async_16_prefetch256(dst, src, ok, stream_policy);
        else
            cp_async_16(dst, src, ok);
    };
    // `whole` (Const<1>): every row of the tile has a key and the lane's column is inside the head dim (the guessed
    // first tiles): no per-row check.
    auto issue_kv = [&](KVPlan plan, int slot, auto whole) {
        issue_kv_tile<Tr>(smem_k, smem_v, lane, params.k_row_stride, params.v_row_stride, params.page_size, copy_kv,
                          k_cache, v_cache, plan, slot, whole);
    };
    // Keeps a plan's values computed where this stands (before the wait: see keep_here).
    auto keep_plan_here = [&](KVPlan& plan) {
#pragma unroll
        for (int p = 0; p < kTilePages; ++p) {
            keep_here(plan.k[p]);
            keep_here(plan.v[p]);
        }
        keep_here(plan.rows_in);
    };

    // K/V of the warp's j-th tile of an item into ring slot `slot`; true if a block_table entry was out of range
    // (reported unless `guessed`, and read as zeros). Paged: with `use_given`, the tile's entries are `given`, read
    // already (else they are read here: all at once, then checked, once per tile, not once per row; this path runs
    // between a tile's landing and the next tile's copies, so short matters).
    auto load_kv_given = [&](const DecodeItem& it, int j, int slot, bool guessed, bool use_given,
                             const int (&given)[kTilePages]) -> bool {
        bool bad_page = false;
        const TileStart t = tile_start(tile_first(it, j));
        const int first = t.first, first_offset = t.offset;
        int pages[kTilePages];
        if constexpr (Tr::kPaged) {
            if (use_given) {
#pragma unroll
                for (int p = 0; p < kTilePages; ++p) pages[p] = given[p];
            } else {
                tile_entries(it.b, t, pages, false);
            }
            bad_page = check_pages(it, t, pages, guessed);
        }
        // (Paged tiles keep the per-copy arithmetic after the first ones: inside the loop the walk's pointers for
        // two pages spilled at the register cap.)
        if constexpr (kWalk && !Tr::kPaged) {
            issue_kv(plan_kv(it, t, pages, bad_page), slot, Const<0>{});
        } else {
            i64 k_page_off[kTilePages], v_page_off[kTilePages];  // (paged) where each page's rows start
            if constexpr (Tr::kPaged) {
#pragma unroll
                for (int p = 0; p < kTilePages; ++p) {
                    k_page_off[p] = pages[p] * params.k_batch_stride;
                    v_page_off[p] = pages[p] * params.v_batch_stride;
                }
            }
            constexpr int kChunks = Tr::kBlockN * kDT;
#pragma unroll 4
            for (int i = 0; i < kChunks / 32; ++i) {
                const int idx = lane + i * 32, r = idx / kDT, c = (idx % kDT) * 8;
                const bool ok = first + r < it.key_end && c < params.headdim && !bad_page;
                i64 k_off, v_off;
                if constexpr (Tr::kPaged) {
                    int offset = first_offset + r;
                    k_off = k_page_off[0];
                    v_off = v_page_off[0];
#pragma unroll
                    for (int p = 1; p < kTilePages; ++p) {
                        if (offset >= params.page_size) {
                            offset -= params.page_size;
                            k_off = k_page_off[p];
                            v_off = v_page_off[p];
                        }
                    }
                    k_off += (i64)offset * params.k_row_stride;
                    v_off += (i64)offset * params.v_row_stride;
                } else {
                    const int key = ok ? it.pad + first + r : 0;
                    k_off = it.cache_row * params.k_batch_stride + (i64)key * params.k_row_stride;
                    v_off = it.cache_row * params.v_batch_stride + (i64)key * params.v_row_stride;
                }
                const u32 k_dst = smem_k + slot * KVTile::kBytes, v_dst = smem_v + slot * KVTile::kBytes;
                copy_kv(KVTile::at(k_dst, r, c), k_cache + k_off + it.kv_head * params.k_head_stride + c, ok);
                copy_kv(KVTile::at(v_dst, r, c), v_cache + v_off + it.kv_head * params.v_head_stride + c, ok);
            }
        }
        return bad_page;
    };
    int no_entries[kTilePages] = {};
    auto load_kv = [&](const DecodeItem& it, int j, int slot, bool guessed = false) -> bool {
        return load_kv_given(it, j, slot, guessed, false, no_entries);
    };
    // Q rows of an item by (query, head), all threads together (warp items: the warp), into Q buffer `buffer`:
    // planned (each thread's chunk addresses, null where it zero-fills) apart from issued, as the K/V tiles.
    constexpr int kQLoaders = solo ? 32 : Tr::kThreads, kQChunks = 16 * kDT;
    constexpr int kQPerThread = (kQChunks + kQLoaders - 1) / kQLoaders;
    // (Where a thread copies more than two Q chunks, their addresses are worked out one at a time, as they are
    // copied: all held at once, they spilled.)
    constexpr bool kPlanQ = kQPerThread <= 2;
    // This thread's chunk i of an item's Q rows: its source (null: zero-filled) and where it lands.
    auto q_src = [&](const DecodeItem& it, int i) -> const u16* {
        return q_chunk_source<Tr>(query_head, lane, rows, params.headdim, q, params.q_batch_stride,
                                  params.q_row_stride, params.q_head_stride, it, i);
    };
    auto copy_q = [&](int i, const u16* src, int buffer) {
        const int idx = (solo ? lane : threadIdx.x) + i * kQLoaders;
        if (kQChunks % kQLoaders != 0 && idx >= kQChunks) return;
        cp_async_16(QTile::at(smem_q + buffer * QTile::kBytes, idx / kDT, (idx % kDT) * 8), src ? src : q,
                    src != nullptr);
    };
    using QPlan = DecodeQPlan<kQPerThread>;
    auto plan_q = [&](const DecodeItem& it) {
        QPlan plan;
#pragma unroll
        for (int i = 0; i < kQPerThread; ++i) plan.src[i] = q_src(it, i);
        return plan;
    };
    auto issue_q = [&](const QPlan& plan, int buffer) {
#pragma unroll
        for (int i = 0; i < kQPerThread; ++i) copy_q(i, plan.src[i], buffer);
    };
    auto load_q = [&](const DecodeItem& it, int buffer) {
        if constexpr (kPlanQ) {
            issue_q(plan_q(it), buffer);
        } else {
#pragma unroll 1
            for (int i = 0; i < kQPerThread; ++i) copy_q(i, q_src(it, i), buffer);
        }
    };

    int item = solo ? blockIdx.x * kW + warp : blockIdx.x;
    if (solo && item >= items) return;  // (warp items have no block barrier)
    // The ring: each warp keeps kS - 1 tiles in flight while it waits for the next one, refilling a slot before
    // the math on the next tile; deep (Tr::kDeepRing), kS tiles, refilling each slot right after its tile's math.
    // Each position issued is one commit group, empty past the item's tiles.
    constexpr bool deep = Tr::kDeepRing;
    constexpr int kAhead = kS - 1 + deep;  // ring positions issued before the first tile's math
    DecodeItem cur;
    item_coords(item, cur);
    // Without cache_batch_idx or Extras, row b's keys start at slot 0 of cache row b (paged: of the pages its
    // block_table row lists) whatever its length, so the warp's first tiles are loaded before cache_seqlens arrives
    // (a round trip at every block's start), as if the row covered them whole: kept if it does, else landed and
    // loaded again. A guessed page entry out of range is not read and not reported (the row may not use it), and
    // its tiles are loaded again the checked way. (Speculative reads stay inside the cache; a key past the row's
    // length never reaches the math.)
    DecodeItem guess;
    guess.b = guess.cache_row = cur.b;
    guess.kv_head = cur.kv_head;
    guess.pad = guess.key_begin = 0;
    guess.key_end = params.capacity;
    guess.first_tile = cur.split * kTileStride + tile_warp;
    const bool speculate = !Tr::kExtras && cache_seqlens != nullptr && cache_batch_idx == nullptr &&
                           (Tr::kPaged || cur.b < params.cache_rows) &&
                           tile_first(guess, kAhead - 1) + Tr::kBlockN <= params.capacity;
    // Launched programmatically (`programmatic`, sm_90), a block waits at wait_for_prior_grids for the kernel
    // before to finish, often for microseconds: the first item's copies are worked out before the wait (Q's and the
    // guessed tiles' addresses; paged, the guessed tiles' block_table entries are read for them), so that after it
    // the copies are all that is left to issue (ptxas had put nearly all the index arithmetic after the wait, and a
    // call's first copies went out ~500 instructions after it). Launched plainly, working out first only delayed
    // the index loads (8 x 1k +8% on the H100): there the loads go first.
    constexpr bool kPlanEarly = FA2_GRID_DEPENDENCIES != 0;  // (older GPUs: never launched programmatically)
    const bool plan_early = kPlanEarly && params.programmatic != 0;
    // Paged, early: the kernel before may still be writing block_table, so the entries read before the wait are
    // guesses, read again after it; if any differs, the copies land and the tiles load again.
    TileStart guess_starts[kAhead];  // (worked out once, for the reads before and after the wait and the plans)
#pragma unroll
    for (int t = 0; t < kAhead; ++t) guess_starts[t] = tile_start(tile_first(guess, t));
    int early_entries[kAhead][kTilePages], entries_after_wait[kAhead][kTilePages];
    if (plan_early && Tr::kPaged && speculate) {
#pragma unroll
        for (int t = 0; t < kAhead; ++t) tile_entries(guess.b, guess_starts[t], early_entries[t], true);
    }
    QPlan first_q;
    KVPlan guess_plans[kAhead];
    bool guess_bad_page = false;
    auto plan_first = [&] {
        if constexpr (kPlanQ) {
            first_q = plan_q(cur);
#pragma unroll
            for (int i = 0; i < kQPerThread; ++i) keep_here(first_q.src[i]);
        }
        if constexpr (kWalk) {
            if (speculate) {
#pragma unroll
                for (int t = 0; t < kAhead; ++t) {
                    const TileStart& start = guess_starts[t];
                    int pages[kTilePages];
                    bool bad = false;
                    if constexpr (Tr::kPaged) {
                        if (plan_early) {
#pragma unroll
                            for (int p = 0; p < kTilePages; ++p) pages[p] = early_entries[t][p];
                        } else {
                            tile_entries(guess.b, start, pages, false);
                        }
                        bad = check_pages(guess, start, pages, true);
                    }
                    guess_bad_page |= bad;
                    guess_plans[t] = plan_kv(guess, start, pages, bad);
                    keep_plan_here(guess_plans[t]);
                }
            }
        }
    };
    if (plan_early) plan_first();

    decode_mark(0, blockIdx.x);
    // (launched early after the append or the previous call: every block is resident from the start, so the next
    // kernel may take the SMs as they empty)
    wait_for_prior_grids();
    decode_mark(22, blockIdx.x);
    allow_next_grid();
    // The error word, read first and looked at once the first item's loads are out (pending_report).
    const int error_word = *static_cast<volatile int*>(params.error_claim);
    item_loads(cur);
    if (plan_early) {
        if (Tr::kPaged && speculate) {
#pragma unroll
            for (int t = 0; t < kAhead; ++t)
                tile_entries(guess.b, guess_starts[t], entries_after_wait[t], false);
        }
    } else {
        plan_first();
    }
    // The first item: Q (its addresses need no index value, so it loads while they arrive), then each warp's ring
    // prologue, one group per position (empty past the warp's tiles).
    if constexpr (kPlanQ)
        issue_q(first_q, 0);
    else
        load_q(cur, 0);
    cp_async_commit();
    if (speculate) {
#pragma unroll
        for (int t = 0; t < kAhead; ++t) {
            if constexpr (kWalk) {
                if (guess_plans[t].rows_in >= Tr::kBlockN)
                    issue_kv(guess_plans[t], t, Const<1>{});
                else
                    issue_kv(guess_plans[t], t, Const<0>{});
            } else {
                guess_bad_page |= load_kv_given(guess, t, t, true, plan_early, early_entries[t]);
            }
            cp_async_commit();
        }
    }
    item_check(cur);
    if (plan_early && Tr::kPaged && speculate) {
#pragma unroll
        for (int t = 0; t < kAhead; ++t)
#pragma unroll
            for (int p = 0; p < kTilePages; ++p) guess_bad_page |= early_entries[t][p] != entries_after_wait[t][p];
        // (lanes may have read different guesses while block_table was being written: they start again together)
        guess_bad_page = __any_sync(0xffffffffu, guess_bad_page);
    }
    bool bad_page = false;  // a bad block_table entry in cur's tiles (this thread's loads)
    if (!speculate || guess_bad_page || tile_first(cur, kAhead - 1) + Tr::kBlockN > cur.key_end) {
        if (speculate) cp_async_wait<0>();  // (a slot's copies land before it is filled again)
#pragma unroll
        for (int t = 0; t < kAhead; ++t) {
            if (t < cur.my_tiles) bad_page |= load_kv(cur, t, t);
            cp_async_commit();
        }
    }
    // A report still pending (this call's append found a bad value) poisons every item's rows (NaN), but not its
    // loads: every index value they use is checked in item_check or per tile. So the error word, loaded first, is
    // looked at only now (where its use came first, every block's first loads waited for its round trip; that
    // measured level on the H100, whose first round of loads is bound by DRAM throughput, not latency).
    // Warp-uniform (lane 0's read), so the warps' loops never diverge.
    const bool pending_report = __shfl_sync(0xffffffffu, error_word, 0) != 0;
    int buffer = 0;                                      // cur's Q buffer
    int slot_base = 0;                                   // ring slot of cur's first tile (of this warp), modulo kS
    int issued = deep ? kS : min(kS - 1, cur.my_tiles);  // cur's tiles (deep: ring positions) issued ahead
    for (bool first_item = true;; first_item = false) {
        if (first_item) {
            cp_async_wait<kAhead>();  // the Q group (the oldest) has landed, for this thread
        } else {
            ring_next_item<Tr>(load_kv, cur, issued, slot_base, bad_page);
        }
        if constexpr (solo)
            __syncwarp();  // ... for every lane
        else
            __syncthreads();  // ... for every thread, and every warp is past the previous item's merge
        decode_mark(1, item);
        const i64 total_rows = (i64)params.batch * params.seqlen_q * params.nheads;
        auto out_row = [&](int packed) {  // index of packed row `packed` in (batch, seqlen_q, nheads) order
            int query, head;
            query_head(cur.kv_head, packed, query, head);
            return ((i64)cur.b * params.seqlen_q + query) * params.nheads + head;
        };
        auto lse_index = [&](int packed) {  // ... and in lse_out's (batch, nheads, seqlen_q) order
            int query, head;
            query_head(cur.kv_head, packed, query, head);
            return ((i64)cur.b * params.nheads + head) * params.seqlen_q + query;
        };
        // (block merge) Where each of the item's rows goes in out and lse_out, worked out now: the index arithmetic,
        // with its divisions, stays off the merge at the end, which every call waits for.
        __shared__ i64 block_row[16], block_lse_row[16];
        if (!solo && threadIdx.x < 16) {
            block_row[threadIdx.x] = out_row(cur.row0 + threadIdx.x);
            block_lse_row[threadIdx.x] = lse_index(cur.row0 + threadIdx.x);
        }
        const int next_item = item + walkers;
        const bool has_next = next_item < items;
        DecodeItem next;
        next.my_tiles = 0;
        if (has_next) item_values(next_item, next);  // loads only: checked after the first tile's math
        int next_issued = 0;  // the next item's tiles (deep: ring positions) issued during this item
        bool next_bad_page = false, next_checked = false;
        auto start_next = [&] {  // check next (once) and load its Q into the other buffer
            if (!has_next) return;
            if (!next_checked) {
                item_check(next);
                next_checked = true;
            }
            load_q(next, buffer ^ 1);
            if constexpr (!deep) cp_async_commit();  // deep: it joins the iteration's group
        };

        // One commit group for this warp's ring position `ahead` of cur: its tile, or past cur's tiles the next
        // item's next position (the ring runs on into it; the slot's tile of cur has been consumed). The table's
        // ring issues the next item's first kS - 1 tiles here; the deep ring one position (a group, empty past the
        // next item's tiles) per call, the rest at the next item's start.
        auto issue_ahead = [&](int ahead) {
            if (ahead < cur.my_tiles) {
                bad_page |= load_kv(cur, ahead, (slot_base + ahead) % kS);
            } else if (has_next) {
                if (!next_checked) {
                    item_check(next);
                    next_checked = true;
                }
                if (next_issued < (deep ? next.my_tiles : min(kS - 1, next.my_tiles))) {
                    next_bad_page |= load_kv(next, next_issued, (slot_base + cur.my_tiles + next_issued) % kS);
                    if constexpr (!deep) ++next_issued;
                }
                if constexpr (deep) ++next_issued;
            }
            cp_async_commit();
        };

        const u32 q_tile = smem_q + buffer * QTile::kBytes;
        float acc_o[1][kDT][4];
        zero_fragments(acc_o);
        OnlineSoftmax<1, kNT> softmax;
        softmax.init();
        const WindowMask<kMaskWindow> window{params.seqlen_q, cur.seqlen_k, params.window_left, params.window_right};
        // Extras: each thread's two rows (packed row g and g + 8) belong to their own query heads, so each has its
        // own ALiBi slope and score modifiers.
        ScoreMods mods[2];
        if constexpr (Tr::kExtras) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int packed = cur.row0 + (lane >> 2) + half * 8;
                int query, head;
                query_head(cur.kv_head, packed, query, head);
                const float slope = alibi_slopes != nullptr && packed < rows
                                        ? alibi_slopes[cur.b * params.alibi_batch_stride + head]
                                        : 0.f;
                mods[half] = make_score_mods(params.scale, params.softcap, slope, params.seqlen_q, cur.seqlen_k);
            }
        }

        for (int j = 0; j < cur.my_tiles; ++j) {
            // The first item: tile j's group has kS - 2 groups after it (next's Q group, committed in iteration
            // 0, may be waited for early). Later items: tiles below kS - 1 landed before the item started; tile
            // j >= kS - 1 is the group of iteration j - kS + 1, with kS - 2 groups after it. Deep: kS - 1 groups
            // after it, the positions up to j + kS - 1 (next's Q joins iteration 0's).
            if constexpr (deep)
                cp_async_wait<kS - 1>();
            else if (first_item || j >= kS - 1)
                cp_async_wait<kS - 2>();
            __syncwarp();
            if (j % FA2_DECODE_TRACE_STRIDE == 0 && j / FA2_DECODE_TRACE_STRIDE < 10)
                decode_mark(2 + j / FA2_DECODE_TRACE_STRIDE, item);
            if constexpr (!deep) issue_ahead(j + kS - 1);  // into the slot of tile j - 1, consumed
            const int slot = (slot_base + j) % kS;
            const u32 k_slot = smem_k + slot * KVTile::kBytes;
            const u32 v_slot = smem_v + slot * KVTile::kBytes;
            float s[1][kNT][4];
            zero_fragments(s);
            mma_tiles<typename Tr::Elem, kKSteps>(
                s, [&](u32(&a)[4], int, int kk) { QTile::load_a(a, q_tile, 0, kk * 16, lane); },
                [&](u32(&b)[4], int np, int kk) { KVTile::load_b_nk(b, k_slot, np * 16, kk * 16, lane); });
            // Mask keys past this split's end and, under the causal mask, past each row's own query.
            const int first = tile_first(cur, j);
            if constexpr (Tr::kExtras) {
                // Final logits (softcap, ALiBi), then the window: a key's distance from the row's diagonal decides.
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int query = by_heads_per_kv.div(cur.row0 + (lane >> 2) + half * 8);
#pragma unroll
                    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int key = first + nt * 8 + (lane & 3) * 2 + e;
                            const int dist = key - query - window.diag();
                            float unused;
                            const float x = mods[half].logit(s[0][nt][2 * half + e], query, key, unused);
                            s[0][nt][2 * half + e] = key >= cur.key_end || dist > params.window_right ||
                                                             dist < -params.window_left
                                                         ? -pos_inf()
                                                         : x;
                        }
                    }
                }
            } else {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int query = by_heads_per_kv.div(cur.row0 + (lane >> 2) + half * 8);
                    const int limit =
                        Tr::kCausal ? min(cur.key_end, cur.seqlen_k - params.seqlen_q + query + 1) : cur.key_end;
#pragma unroll
                    for (int nt = 0; nt < kNT; ++nt) {
                        const int key = first + nt * 8 + (lane & 3) * 2;
                        if (key >= limit) s[0][nt][2 * half] = -pos_inf();
                        if (key + 1 >= limit) s[0][nt][2 * half + 1] = -pos_inf();
                    }
                }
            }
            softmax.update(s, acc_o, Tr::kExtras ? kLog2e : params.scale_log2);
            mma_c_b<typename Tr::Elem, KVTile>(acc_o, s, v_slot, lane);
            if (j == 0) start_next();  // next's index values have arrived by now
            if constexpr (deep) {
                __syncwarp();  // every lane is done with tile j's slot before it is refilled
                issue_ahead(j + kS);
            }
        }
        if (cur.my_tiles == 0) {
            start_next();
            if constexpr (deep) cp_async_commit();
        }
        if (!has_next) cp_async_wait<0>();  // (empty groups only; the merge may reuse the rings)
        decode_mark(12, item);
        float row_lse[2];
        softmax.finalize(acc_o, row_lse, Tr::kExtras ? 1.f : params.scale);
        if constexpr (solo) {
            // The warp's rows are final (one split): the warp writes them (store_warp_rows).
            const bool poisoned = __any_sync(0xffffffffu, cur.poisoned || bad_page || pending_report);
            store_warp_rows<Tr>(params, cur, acc_o, row_lse, poisoned, out, lse_out, lane, rows, out_row, lse_index);
            decode_mark(14, item);
        } else {
            // Every warp is done with the item's tiles and Q (the barrier).
            const bool poisoned = __syncthreads_or(cur.poisoned || bad_page || pending_report);
            decode_mark(13, item);

            float* merge_out = reinterpret_cast<float*>(merge_area);          // [warp][16][kMergePitch]
            float* merge_lse = merge_out + kW * 16 * Tr::kMergePitch;            // [warp][16]
            const int real_rows = min(16, rows - cur.row0);  // packed rows past the group's are padding
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
            __shared__ float block_lse[16];
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
                if (c >= params.headdim) continue;
                float lse = block_lse[r];
                float2 o = make_float2(0.f, 0.f);
#pragma unroll
                for (int w = 0; w < kW; ++w) {
                    const float weight = merge_lse[w * 16 + r];
                    const float2 part =
                        *reinterpret_cast<const float2*>(merge_out + (w * 16 + r) * Tr::kMergePitch + c);
                    o.x += weight * part.x;
                    o.y += weight * part.y;
                }
                if (poisoned) o.x = o.y = lse = quiet_nan();
                const i64 row = block_row[r];
                if (params.num_splits == 1) {
                    reinterpret_cast<u32*>(out + row * params.headdim)[c / 2] = Mma::pack(o.x, o.y);
                    if (c == 0 && lse_out != nullptr) lse_out[block_lse_row[r]] = lse;
                } else {
                    // Read back by the last block within microseconds: kept in L2 ahead of the K/V stream, which
                    // had pushed them out before the last block came (1 x 16k: 0.5-1 us a call, with where the
                    // workspace lies in memory).
                    const u64 keep = l2_evict_last();
                    st_global_f32x2(partial_out + (cur.split * total_rows + row) * params.headdim + c, o.x, o.y, keep);
                    if (c == 0) st_global_f32(partial_lse + cur.split * total_rows + row, lse, keep);
                }
            }
            decode_mark(14, item);

            if (params.num_splits > 1) {
                // Split-KV through global memory: the last of the item's split blocks to arrive merges every split's
                // partial. Release: the barrier puts the block's partial writes before thread 0's fence, which
                // publishes them with its arrival; acquire: the last arriver's fence after the atomic, then the
                // barrier, put every thread's reads of the other splits' partials after their writes.
                __shared__ int last_to_arrive;
                __syncthreads();
                if (threadIdx.x == 0) {
                    unsigned* counter = reinterpret_cast<unsigned*>(arrivals + (i64)cur.b * groups + cur.group);
                    fence_acq_rel_gpu();
                    // The last arrival wraps the counter back to 0 (left as it was found) in the same atomic: no
                    // store for the acquire fence below to wait for.
                    last_to_arrive = atomicInc(counter, params.num_splits - 1) == (unsigned)params.num_splits - 1;
                    if (last_to_arrive) fence_acq_rel_gpu();
                }
                __syncthreads();
                decode_mark(15, item);
                if (last_to_arrive) {
                    // One (row, 4 columns) unit per thread, merged online over chunks of 16 splits whose lse and
                    // partial loads are all in flight at once: one L2 round trip per chunk, no shared memory, no
                    // barrier. Every thread of a row computes the row's lse itself (the same few lse loads, L2 hits).
                    constexpr int kChunk = 16, kQuads = Tr::kHeadDim / 4;
                    for (int t = threadIdx.x; t < real_rows * kQuads; t += Tr::kThreads) {
                        const int r = t / kQuads, c = (t % kQuads) * 4;
                        if (c >= params.headdim) continue;
                        const i64 row = block_row[r];
                        float max_lse = -pos_inf(), sum = 0.f;
                        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
                        for (int first = 0; first < params.num_splits; first += kChunk) {
                            float l[kChunk];
                            float4 x[kChunk];
                            // Every split's lse and partial in flight at once (in program order: see
                            // ld_relaxed_gpu), before any of the math on them.
                            const float* lse_at = partial_lse + (i64)first * total_rows + row;
                            const float* out_at = partial_out + ((i64)first * total_rows + row) * params.headdim + c;
#pragma unroll
                            for (int k = 0; k < kChunk; ++k) {
                                x[k] = make_float4(0.f, 0.f, 0.f, 0.f);
                                l[k] = pos_inf();
                                if (first + k < params.num_splits) {
                                    x[k] = ld_relaxed_gpu_v4(out_at);
                                    l[k] = ld_relaxed_gpu(lse_at);
                                }
                                lse_at += total_rows;
                                out_at += total_rows * params.headdim;
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
                        u32* dst = reinterpret_cast<u32*>(out + row * params.headdim + c);
                        dst[0] = Mma::pack(o.x * inv, o.y * inv);
                        dst[1] = Mma::pack(o.z * inv, o.w * inv);
                        if (c == 0 && lse_out != nullptr)
                            lse_out[block_lse_row[r]] = sum == 0.f ? pos_inf() : max_lse + __logf(sum);
                    }
                    decode_mark(16, item);
                }
            }
        }
        if (!has_next) return;
        // On to the next item: its first tiles are in this warp's ring from cur's last slots on.
        item = next_item;
        slot_base = (slot_base + cur.my_tiles) % kS;
        issued = next_issued;
        bad_page = next_bad_page;
        cur = next;
        buffer ^= 1;
    }
}

}  // namespace fa2
