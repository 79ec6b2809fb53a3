// decode_attention's view of one call (DecodeCall): the values every stage uses (shared memory layout, run-time
// divisors, the index values), with the stages on work items (their place, index values and checks) and on loads
// (each key tile's copies into the warp's cp.async ring, and the Q rows').
#pragma once
#include "common/types.cuh"
#include "common/params.cuh"
#include "common/fast_div.cuh"
#include "common/hints.cuh"
#include "sm80/memory.cuh"
#include "decode/traits.cuh"
#include "decode/items.cuh"
#include "decode/loads.cuh"

namespace fa2 {

template <class Tr>
struct DecodeCall {
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    static constexpr int kDT = Tr::kHeadDim / 8, kW = Tr::kWarps, kS = Tr::kStages;
    // Warp items: a warp's tiles are all of its item's; otherwise the block's warps take the item's tiles in turn.
    static constexpr bool solo = Tr::kWarpItems;
    static constexpr int kTileStride = solo ? 1 : kW;
    // Q tiles of items 0, 2, 4, ... of this block (warp items: of this warp), then 1, 3, 5, ...; then each warp's
    // ring (warp items: each warp's Q tiles and ring together).
    static constexpr int kWarpBytes = solo ? Tr::kQBytes + Tr::kRingBytes : Tr::kRingBytes;
    // Paged: a tile starts on a multiple of 16 keys and pages hold multiples of 16, so it spans at most BlockN / 16
    // pages.
    static constexpr int kTilePages = Tr::kPaged ? Tr::kBlockN / 16 : 1;
    // A key tile's copies, worked out apart from issuing them (the first item's are worked out before the wait):
    // where a warp covers whole rows per pass (kWalk), each lane keeps one column and walks down the tile's rows
    // 32 / kDT at a time, a pointer per page the tile spans (a contiguous cache is one page) advanced by a fixed
    // step, instead of 64-bit index arithmetic per copy (~11 instructions a copy; a call's first two tiles are 64
    // copies a lane, and its first loads had gone out ~500 instructions after the wait, its last ~1400).
    // (Head dims up to 128: the larger ones' kernels sit at the register cap, where the walk's pointers spilled.)
    static constexpr bool kWalk = 32 % kDT == 0 && Tr::kHeadDim <= 128;
    // Q rows of an item by (query, head), all threads together (warp items: the warp), into Q buffer `buffer`:
    // planned (each thread's chunk addresses, null where it zero-fills) apart from issued, as the K/V tiles.
    static constexpr int kQLoaders = solo ? 32 : Tr::kThreads, kQChunks = 16 * kDT;
    static constexpr int kQPerThread = (kQChunks + kQLoaders - 1) / kQLoaders;
    // (Where a thread copies more than two Q chunks, their addresses are worked out one at a time, as they are
    // copied: all held at once, they spilled.)
    static constexpr bool kPlanQ = kQPerThread <= 2;
    using TileStart = DecodeTileStart;
    using KVPlan = DecodeKVPlan<kTilePages>;
    using QPlan = DecodeQPlan<kQPerThread>;

    const DecodeParams& params;
    const u16* __restrict__ q;
    const u16* __restrict__ k_cache;
    const u16* __restrict__ v_cache;
    const int* __restrict__ block_table;
    const int* __restrict__ cache_seqlens;
    const int* __restrict__ cache_batch_idx;
    const int* __restrict__ cache_leftpad;
    const float* __restrict__ alibi_slopes;
    u16* __restrict__ out;
    float* __restrict__ lse_out;
    float* __restrict__ partial_out;
    float* __restrict__ partial_lse;
    int* __restrict__ arrivals;
    int tile_stride;  // between a warp's tiles of an item
    int warp, lane;
    int tile_warp;  // the warp's first tile of an item
    u32 smem_q, smem_k, smem_v;
    // Run-time divisors of the index arithmetic, as multiplications (the launch's start waits on them).
    FastDiv by_heads_per_kv, by_page_size;
    int nheads_kv;
    int rows;  // packed rows r = query * heads_per_kv + head-in-group
    int groups;
    FastDiv by_splits, by_groups, by_heads_kv;
    int items;
    unsigned walkers;  // blocks, or warps, that take items
    bool persistent;
    unsigned char* merge_area;
    CacheIndex index;
    // A call whose K/V are larger than L2 streams them under evict-first: they cannot stay in L2 anyway, and so
    // they do not push out what can (1 x 16k queued: 27.55 us, against 28.0 without a policy; docs/design.md).
    // Other calls copy under evict-unchanged, as if with no policy.
    u64 stream_policy;

    FA2_DEVICE DecodeCall(const DecodeParams& params, unsigned char* smem)
        : params(params),
          q(params.q),
          k_cache(params.k_cache),
          v_cache(params.v_cache),
          block_table(params.block_table),
          cache_seqlens(params.cache_seqlens),
          cache_batch_idx(params.cache_batch_idx),
          cache_leftpad(params.cache_leftpad),
          alibi_slopes(params.alibi_slopes),
          out(params.out),
          lse_out(params.lse_out),
          partial_out(params.partial_out),
          partial_lse(params.partial_lse),
          arrivals(params.arrivals),
          tile_stride(params.num_splits * kTileStride),
          warp(threadIdx.x >> 5),
          lane(threadIdx.x & 31),
          tile_warp(solo ? 0 : warp),
          smem_q(smem_u32(smem) + (solo ? warp * kWarpBytes : 0)),
          smem_k(smem_q + Tr::kQBytes + (solo ? 0 : warp * kWarpBytes)),
          smem_v(smem_k + kS * KVTile::kBytes),
          by_heads_per_kv{params.heads_per_kv_magic, params.heads_per_kv_shift},
          by_page_size{params.page_size_magic, params.page_size_shift},
          nheads_kv(by_heads_per_kv.div(params.nheads)),
          rows(params.seqlen_q * params.heads_per_kv),
          groups(nheads_kv * ((rows + 15) / 16)),
          by_splits{params.splits_magic, params.splits_shift},
          by_groups{params.groups_magic, params.groups_shift},
          by_heads_kv{params.heads_kv_magic, params.heads_kv_shift},
          items(params.num_splits * groups * params.batch),
          walkers(solo ? gridDim.x * kW : gridDim.x),
          persistent((int)walkers < items),
          merge_area(smem + Tr::kQAreaBytes + (persistent ? kW * Tr::kRingBytes : 0)),
          index{block_table,     cache_seqlens,     cache_batch_idx, (int)params.fixed_seqlen, params.seqlen_new,
                params.capacity, params.cache_rows, params.page_size, params.max_pages},
          stream_policy(params.stream_larger_than_l2 ? l2_evict_first() : l2_evict_unchanged()) {}

    // An item's place in the grid (index arithmetic only: no memory access, so also before the wait).
    FA2_DEVICE void item_coords(int item, DecodeItem& it) const {
        const int split_major = by_splits.div(item);
        it.split = item - split_major * params.num_splits;
        it.b = by_groups.div(split_major);
        it.group = split_major - it.b * groups;
        const int row_block = by_heads_kv.div(it.group);
        it.kv_head = it.group - row_block * nheads_kv;
        it.row0 = row_block * 16;
    }
    // An item's index values are loaded first (their latency hides behind other work) and checked later.
    FA2_DEVICE void item_loads(DecodeItem& it) const {
        it.cached = index.cached(it.b);
        it.cache_row = index.cache_row(it.b);
        it.pad = Tr::kExtras && cache_leftpad != nullptr ? cache_leftpad[it.b] : 0;
    }
    FA2_DEVICE void item_values(int item, DecodeItem& it) const {
        item_coords(item, it);
        item_loads(it);
    }
    // Values the host could not check (check_item): a bad one poisons the item; then this warp's share of its tiles.
    FA2_DEVICE void item_check(DecodeItem& it) const {
        check_item<Tr>(it, index, lane, params.error_claim, params.error_host, params.seqlen_new, params.seqlen_q,
                       rows, by_heads_per_kv, by_splits, params.window_left, params.window_right, tile_warp,
                       tile_stride);
    }
    // First key of the warp's j-th tile of an item.
    FA2_DEVICE int tile_first(const DecodeItem& it, int j) const {
        return it.key_begin + (it.first_tile + j * tile_stride) * Tr::kBlockN;
    }
    // Packed row `packed` of an item of kv head `kv_head`: its query (new token) and its query head.
    FA2_DEVICE void query_head(int kv_head, int packed, int& query, int& head) const {
        query = by_heads_per_kv.div(packed);
        head = kv_head * params.heads_per_kv + packed - query * params.heads_per_kv;
    }
    // Index of packed row `packed` of `it` in (batch, seqlen_q, nheads) order.
    FA2_DEVICE i64 out_row(const DecodeItem& it, int packed) const {
        int query, head;
        query_head(it.kv_head, packed, query, head);
        return ((i64)it.b * params.seqlen_q + query) * params.nheads + head;
    }
    // ... and in lse_out's (batch, nheads, seqlen_q) order.
    FA2_DEVICE i64 lse_index(const DecodeItem& it, int packed) const {
        int query, head;
        query_head(it.kv_head, packed, query, head);
        return ((i64)it.b * params.nheads + head) * params.seqlen_q + query;
    }

    // A tile's first key and (paged) the index of its first page and the key's slot there, worked out once.
    FA2_DEVICE TileStart tile_start(int first) const {
        TileStart t{first, 0, 0};
        if constexpr (Tr::kPaged) {
            t.page = by_page_size.div(first);
            t.offset = first - t.page * params.page_size;
        }
        return t;
    }
    // The block_table entries of the pages the tile reaches in batch row b (0 past max_pages); `early`: read before
    // wait_for_prior_grids, as guesses.
    FA2_DEVICE void tile_entries(int b, const TileStart& t, int (&entries)[kTilePages], bool early) const {
        read_tile_entries<Tr>(block_table, params.max_pages, params.page_size, b, t, entries, early);
    }
    // Paged: a tile's entries kept where the tile uses the page (else 0) and checked; true if one was out of range
    // (reported unless `guessed`, and read as zeros).
    FA2_DEVICE bool check_pages(const DecodeItem& it, const TileStart& t, int (&pages)[kTilePages],
                                bool guessed) const {
        return check_tile_pages<Tr>(index, params.error_claim, params.error_host, params.page_size, params.max_pages,
                                    it, t, pages, guessed);
    }
    FA2_DEVICE KVPlan plan_kv(const DecodeItem& it, const TileStart& t, const int (&pages)[kTilePages],
                              bool bad_page) const {
        return plan_kv_tile<Tr>(lane, params.page_size, params.k_batch_stride, params.v_batch_stride, k_cache,
                                v_cache, params.k_row_stride, params.v_row_stride, params.k_head_stride,
                                params.v_head_stride, params.headdim, params.headdim_v, it, t, pages, bad_page);
    }
    FA2_DEVICE void operator()(u32 dst, const u16* src, bool ok) const { copy_kv(dst, src, ok); }
    FA2_DEVICE void copy_kv(u32 dst, const u16* src, bool ok) const {
        if constexpr (Tr::kL2Prefetch)
            cp_async_16_prefetch256(dst, src, ok, stream_policy);
        else
            cp_async_16(dst, src, ok);
    }
    // `whole` (Const<1>): every row of the tile has a key and the lane's column is inside k's and v's head dims (the
    // guessed first tiles): no per-row check.
    template <class Whole>
    FA2_DEVICE void issue_kv(KVPlan plan, int slot, Whole whole) const {
        issue_kv_tile<Tr>(smem_k, smem_v, lane, params.k_row_stride, params.v_row_stride, params.page_size, *this,
                          k_cache, v_cache, plan, slot, whole);
    }
    // Keeps a plan's values computed where this stands (before the wait: see keep_here).
    static FA2_DEVICE void keep_plan_here(KVPlan& plan) {
#pragma unroll
        for (int p = 0; p < kTilePages; ++p) {
            keep_here(plan.k[p]);
            keep_here(plan.v[p]);
        }
        keep_here(plan.rows_in);
        keep_here(plan.rows_in_v);
    }
    // K/V of the warp's j-th tile of an item into ring slot `slot`; true if a block_table entry was out of range
    // (reported unless `guessed`, and read as zeros). Paged: with `use_given`, the tile's entries are `given`, read
    // already (else they are read here: all at once, then checked, once per tile, not once per row; this path runs
    // between a tile's landing and the next tile's copies, so short matters).
    FA2_DEVICE bool load_kv_given(const DecodeItem& it, int j, int slot, bool guessed, bool use_given,
                                  const int (&given)[kTilePages]) const {
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
                const bool has_key = first + r < it.key_end && !bad_page;
                const bool ok = has_key && c < params.headdim, ok_v = has_key && c < params.headdim_v;
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
                    const int key = has_key ? it.pad + first + r : 0;
                    k_off = it.cache_row * params.k_batch_stride + (i64)key * params.k_row_stride;
                    v_off = it.cache_row * params.v_batch_stride + (i64)key * params.v_row_stride;
                }
                const u32 k_dst = smem_k + slot * KVTile::kBytes, v_dst = smem_v + slot * KVTile::kBytes;
                copy_kv(KVTile::at(k_dst, r, c), k_cache + k_off + it.kv_head * params.k_head_stride + c, ok);
                copy_kv(KVTile::at(v_dst, r, c), v_cache + v_off + it.kv_head * params.v_head_stride + c, ok_v);
            }
        }
        return bad_page;
    }
    FA2_DEVICE bool load_kv(const DecodeItem& it, int j, int slot, bool guessed = false) const {
        int no_entries[kTilePages] = {};
        return load_kv_given(it, j, slot, guessed, false, no_entries);
    }

    // This thread's chunk i of an item's Q rows: its source (null: zero-filled) and where it lands.
    FA2_DEVICE const u16* q_src(const DecodeItem& it, int i) const {
        const auto heads = [&](int kv_head, int packed, int& query, int& head) {
            query_head(kv_head, packed, query, head);
        };
        return q_chunk_source<Tr>(heads, lane, rows, params.headdim, q, params.q_batch_stride, params.q_row_stride,
                                  params.q_head_stride, it, i);
    }
    FA2_DEVICE void copy_q(int i, const u16* src, int buffer) const {
        const int idx = (solo ? lane : threadIdx.x) + i * kQLoaders;
        if (kQChunks % kQLoaders != 0 && idx >= kQChunks) return;
        cp_async_16(QTile::at(smem_q + buffer * QTile::kBytes, idx / kDT, (idx % kDT) * 8), src ? src : q,
                    src != nullptr);
    }
    FA2_DEVICE QPlan plan_q(const DecodeItem& it) const {
        QPlan plan;
#pragma unroll
        for (int i = 0; i < kQPerThread; ++i) plan.src[i] = q_src(it, i);
        return plan;
    }
    FA2_DEVICE void issue_q(const QPlan& plan, int buffer) const {
#pragma unroll
        for (int i = 0; i < kQPerThread; ++i) copy_q(i, plan.src[i], buffer);
    }
    FA2_DEVICE void load_q(const DecodeItem& it, int buffer) const {
        if constexpr (kPlanQ) {
            issue_q(plan_q(it), buffer);
        } else {
#pragma unroll 1
            for (int i = 0; i < kQPerThread; ++i) copy_q(i, q_src(it, i), buffer);
        }
    }
};

}  // namespace fa2
