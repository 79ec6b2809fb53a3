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
#include "decode/call.cuh"
#include "decode/start.cuh"
#include "decode/ring.cuh"
#include "decode/score.cuh"
#include "decode/store.cuh"

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
    const int chunks_per_row = max(params.headdim, params.headdim_v) / 8;  // (k's and v's columns, the wider's)
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
        if (c < params.headdim) {
            const u16* k_row = k_new + b * params.k_new_batch_stride + (i64)t * params.k_new_row_stride +
                               head * params.k_new_head_stride;
            ld_global_v4(k_row + c, chunk);
            if constexpr (Extras) rotate_chunk<Elem>(chunk, k_row, c, pos, rot);
            st_global_v4(k_cache + row_base * params.k_batch_stride + (i64)slot * params.k_row_stride +
                             head * params.k_head_stride + c,
                         chunk);
        }
        if (c < params.headdim_v) {
            ld_global_v4(v_new + b * params.v_new_batch_stride + (i64)t * params.v_new_row_stride +
                             head * params.v_new_head_stride + c,
                         chunk);
            st_global_v4(v_cache + row_base * params.v_batch_stride + (i64)slot * params.v_row_stride +
                             head * params.v_head_stride + c,
                         chunk);
        }
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

// q: (batch, seqlen_q, nheads, d); k/v cache: (batch_cache, capacity, nheads_kv, d / d_v) or paged (pages,
// page_size, nheads_kv, d / d_v) with block_table (batch, max_pages), d = headdim and d_v = headdim_v, each at most
// the instantiation's (the tiles' columns past them are zeros); row b attends to its first cache_seqlens[b] +
// seqlen_new keys (the append kernel has written the new ones). out: (batch, seqlen_q, nheads, d_v) contiguous;
// lse_out: (batch, nheads, seqlen_q) or null. With more than one split: partial_out (splits, batch * seqlen_q *
// nheads, d_v) fp32, partial_lse (splits, batch * seqlen_q * nheads), arrivals (batch * groups) int32 zeroed before
// the launch.
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
    using KVTile = typename Tr::KVTile;
    constexpr int kNT = Tr::kBlockN / 8, kDT = Tr::kHeadDim / 8, kS = Tr::kStages;
    constexpr bool solo = Tr::kWarpItems, deep = Tr::kDeepRing;

    extern __shared__ __align__(128) unsigned char smem[];
    const DecodeCall<Tr> call(params, smem);
    const int lane = call.lane;
    int item = solo ? blockIdx.x * Tr::kWarps + call.warp : blockIdx.x;
    if (solo && item >= call.items) return;  // (warp items have no block barrier)
    DecodeItem cur;
    call.item_coords(item, cur);
    DecodeStart<Tr> start(call, cur);
    bool guess_bad_page = false;
    if (start.plan_early) start.plan(call, cur, guess_bad_page);

    decode_mark(0, blockIdx.x);
    // (launched early after the append or the previous call: every block is resident from the start, so the next
    // kernel may take the SMs as they empty)
    wait_for_prior_grids();
    decode_mark(22, blockIdx.x);
    allow_next_grid();
    // The error word, read first and looked at once the first item's loads are out (pending_report).
    const int error_word = *static_cast<volatile int*>(params.error_claim);
    call.item_loads(cur);
    start.after_wait(call, cur, guess_bad_page);
    start.issue(call, cur, guess_bad_page);
    call.item_check(cur);
    // A bad block_table entry in cur's tiles (this thread's loads).
    bool bad_page = start.finish(call, cur, guess_bad_page);
    // A report still pending (this call's append found a bad value) poisons every item's rows (NaN), but not its
    // loads: every index value they use is checked in item_check or per tile. So the error word, loaded first, is
    // looked at only now (where its use came first, every block's first loads waited for its round trip; that
    // measured level on the H100, whose first round of loads is bound by DRAM throughput, not latency).
    // Warp-uniform (lane 0's read), so the warps' loops never diverge.
    const bool pending_report = __shfl_sync(0xffffffffu, error_word, 0) != 0;
    DecodeRing ring;
    ring.buffer = 0;
    ring.slot_base = 0;
    ring.issued = deep ? kS : min(kS - 1, cur.my_tiles);
    for (bool first_item = true;; first_item = false) {
        if (first_item)
            cp_async_wait<DecodeStart<Tr>::kAhead>();  // the Q group (the oldest) has landed, for this thread
        else
            ring_next_item(call, cur, ring, bad_page);
        if constexpr (solo)
            __syncwarp();  // ... for every lane
        else
            __syncthreads();  // ... for every thread, and every warp is past the previous item's merge
        decode_mark(1, item);
        const i64 total_rows = (i64)params.batch * params.seqlen_q * params.nheads;
        // (block merge) Where each of the item's rows goes in out and lse_out, worked out now: the index arithmetic,
        // with its divisions, stays off the merge at the end, which every call waits for.
        __shared__ i64 block_row[16], block_lse_row[16];
        __shared__ float block_lse[16];
        __shared__ int last_to_arrive;
        if (!solo && threadIdx.x < 16) {
            block_row[threadIdx.x] = call.out_row(cur, cur.row0 + threadIdx.x);
            block_lse_row[threadIdx.x] = call.lse_index(cur, cur.row0 + threadIdx.x);
        }
        const int next_item = item + call.walkers;
        const bool has_next = next_item < call.items;
        DecodeNext next;
        begin_next(call, next, next_item, has_next);
        bool next_bad_page = false, next_checked = false;

        // Load, score, softmax, accumulate: the item's tiles, each warp its share.
        const u32 q_tile = call.smem_q + ring.buffer * Tr::QTile::kBytes;
        float acc_o[1][kDT][4];
        zero_fragments(acc_o);
        OnlineSoftmax<1, kNT> softmax;
        softmax.init();
        const WindowMask<kMaskWindow> window{params.seqlen_q, cur.seqlen_k, params.window_left, params.window_right};
        ScoreMods mods[2];
        if constexpr (Tr::kExtras) item_score_mods(call, cur, mods);
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
            if constexpr (!deep)  // into the slot of tile j - 1, consumed
                issue_ahead(call, cur, ring, bad_page, next, has_next, next_bad_page, next_checked, j + kS - 1);
            const int slot = (ring.slot_base + j) % kS;
            const u32 k_slot = call.smem_k + slot * KVTile::kBytes;
            const u32 v_slot = call.smem_v + slot * KVTile::kBytes;
            float s[1][kNT][4];
            score_tile(s, call, cur, q_tile, k_slot, j, window, mods);
            softmax.update(s, acc_o, Tr::kExtras ? kLog2e : params.scale_log2);
            mma_c_b<typename Tr::Elem, KVTile>(acc_o, s, v_slot, lane);
            if (j == 0)  // next's index values have arrived by now
                start_next(call, next, has_next, next_checked, ring.buffer);
            if constexpr (deep) {
                __syncwarp();  // every lane is done with tile j's slot before it is refilled
                issue_ahead(call, cur, ring, bad_page, next, has_next, next_bad_page, next_checked, j + kS);
            }
        }
        if (cur.my_tiles == 0) {
            start_next(call, next, has_next, next_checked, ring.buffer);
            if constexpr (deep) cp_async_commit();
        }
        if (!has_next) cp_async_wait<0>();  // (empty groups only; the merge may reuse the rings)
        decode_mark(12, item);
        float row_lse[2];
        softmax.finalize(acc_o, row_lse, Tr::kExtras ? 1.f : params.scale);

        // Store: the warp's own rows, or the block's warps merged (and, split, the splits by the last block).
        const bool poison = cur.poisoned || bad_page || pending_report;
        if constexpr (solo) {
            store_warp_rows(call, cur, acc_o, row_lse, poison, item);
        } else {
            merge_block(call, cur, acc_o, row_lse, poison, item, block_row, block_lse_row, block_lse, total_rows);
            if (params.num_splits > 1)
                merge_splits(call, cur, item, block_row, block_lse_row, last_to_arrive, total_rows);
        }
        if (!has_next) return;
        // On to the next item: its first tiles are in this warp's ring from cur's last slots on.
        item = next_item;
        ring.slot_base = (ring.slot_base + cur.my_tiles) % kS;
        ring.issued = next.issued;
        bad_page = next_bad_page;
        cur = next.it;
        ring.buffer ^= 1;
    }
}

}  // namespace fa2
