// decode_attention's loads: each key tile's block_table entries (paged) and their checks, the tile's copies planned
// and issued into the warp's cp.async ring, and the Q rows' sources.
#pragma once
#include "common/types.cuh"
#include "common/errors.cuh"
#include "sm80/memory.cuh"
#include "decode/traits.cuh"

namespace fa2 {

// The block_table entries of the pages a key tile (from t) reaches in batch row b (0 past max_pages); `early`: read
// before wait_for_prior_grids, as guesses (relaxed, coherent at GPU scope: see ld_relaxed_gpu).
template <class Tr, int Pages>
FA2_DEVICE void read_tile_entries(const int* __restrict__ const& block_table, const int& max_pages,
                                  const int& page_size, int b, const DecodeTileStart& t, int (&entries)[Pages],
                                  bool early) {
    constexpr int kTilePages = Pages;

#pragma unroll
    for (int p = 0; p < kTilePages; ++p) {
        const int page_idx = t.page + p;
        const int* entry = block_table + (i64)b * max_pages + page_idx;
        const bool reached = page_idx < max_pages && (p == 0 || t.offset + Tr::kBlockN > p * page_size);
        entries[p] = !reached ? 0 : early ? ld_relaxed_gpu(entry) : *entry;
    }
}

// Paged: a tile's entries kept where the tile uses the page (else 0) and checked; true if one was out of range
// (reported unless `guessed`, and read as zeros).
template <class Tr, int Pages>
FA2_DEVICE bool check_tile_pages(const CacheIndex& index, int* const& error_claim, long long* const& error_host,
                                 const int& page_size, const int& max_pages, const DecodeItem& it,
                                 const DecodeTileStart& t, int (&pages)[Pages], bool guessed) {
    constexpr int kTilePages = Pages;

    bool bad_page = false;
#pragma unroll
    for (int p = 0; p < kTilePages; ++p) {
        const int page_idx = t.page + p;
        const bool used = p == 0 ? t.first < it.key_end
                                 : t.offset + Tr::kBlockN > p * page_size &&
                                       page_idx * page_size < it.key_end && page_idx < max_pages;
        if (!used) pages[p] = 0;
    }
#pragma unroll
    for (int p = 0; p < kTilePages; ++p) {
        if (!index.row_ok(pages[p])) {
            if (!bad_page && !guessed)
                report_bad_value(error_claim, error_host, kBadBlockTable, it.b, t.page + p, pages[p]);
            bad_page = true;
            pages[p] = 0;
        }
    }
    return bad_page;
}

// A key tile's copies planned where a warp covers whole rows per pass: lane's column, its row r0's address in each
// page the tile spans (the contiguous cache: one), and how many of the tile's rows hold keys.
template <class Tr, int Pages>
FA2_DEVICE DecodeKVPlan<Pages> plan_kv_tile(const int& lane, const int& page_size, const i64& k_batch_stride,
                                            const i64& v_batch_stride, const u16* __restrict__ const& k_cache,
                                            const u16* __restrict__ const& v_cache, const int& k_row_stride,
                                            const int& v_row_stride, const i64& k_head_stride,
                                            const i64& v_head_stride, const int& headdim,
                                            const int& headdim_v, const DecodeItem& it,
                                            const DecodeTileStart& t, const int (&pages)[Pages], bool bad_page) {
    constexpr int kDT = Tr::kHeadDim / 8, kTilePages = Pages;
    using KVPlan = DecodeKVPlan<Pages>;

    KVPlan plan;
    const int r0 = lane / kDT, c = (lane % kDT) * 8, first = t.first;
    plan.first_offset = t.offset;
#pragma unroll
    for (int p = 0; p < kTilePages; ++p) {
        // Row r0's slot in page p (paged: negative or past the page for rows of another page, never read
        // through page p), or in the contiguous cache row.
        const int slot0 = Tr::kPaged ? plan.first_offset + r0 - p * page_size : it.pad + first + r0;
        const i64 k_row = (Tr::kPaged ? pages[p] : it.cache_row) * k_batch_stride;
        const i64 v_row = (Tr::kPaged ? pages[p] : it.cache_row) * v_batch_stride;
        plan.k[p] = k_cache + k_row + (i64)slot0 * k_row_stride + it.kv_head * k_head_stride + c;
        plan.v[p] = v_cache + v_row + (i64)slot0 * v_row_stride + it.kv_head * v_head_stride + c;
    }
    const int rows = bad_page ? 0 : it.key_end - first;
    plan.rows_in = c < headdim ? rows : 0;
    plan.rows_in_v = c < headdim_v ? rows : 0;
    return plan;
}

// A planned tile's copies into ring slot `slot`: each lane walks down its column, kRowStep rows a copy, a pointer per
// page advanced by a fixed step. `whole` (Const<1>): every row of the tile has a key and the lane's column is inside
// k's and v's head dims (the guessed first tiles): no per-row check.
template <class Tr, int Pages, class CopyKV, class Whole>
FA2_DEVICE void issue_kv_tile(const u32& smem_k, const u32& smem_v, const int& lane, const int& k_row_stride,
                              const int& v_row_stride, const int& page_size, const CopyKV& copy_kv,
                              const u16* __restrict__ const& k_cache, const u16* __restrict__ const& v_cache,
                              DecodeKVPlan<Pages> plan, int slot, Whole whole) {
    using KVTile = typename Tr::KVTile;
    constexpr int kDT = Tr::kHeadDim / 8, kTilePages = Pages;
    constexpr bool kWalk = 32 % kDT == 0 && Tr::kHeadDim <= 128;
    constexpr int kRowStep = kWalk ? 32 / kDT : 1;

    const u32 k_dst = smem_k + slot * KVTile::kBytes, v_dst = smem_v + slot * KVTile::kBytes;
    const int r0 = lane / kDT, c = (lane % kDT) * 8;
    const int k_step = kRowStep * k_row_stride, v_step = kRowStep * v_row_stride;
#pragma unroll
    for (int i = 0; i < Tr::kBlockN / kRowStep; ++i) {
        const int r = r0 + i * kRowStep;
        const bool ok = decltype(whole)::value || r < plan.rows_in;
        const bool ok_v = decltype(whole)::value || r < plan.rows_in_v;
        const u16* k_at = plan.k[0];
        const u16* v_at = plan.v[0];
#pragma unroll
        for (int p = 1; p < kTilePages; ++p) {
            if (plan.first_offset + r >= p * page_size) {
                k_at = plan.k[p];
                v_at = plan.v[p];
            }
        }
        copy_kv(KVTile::at(k_dst, r, c), ok ? k_at : k_cache, ok);
        copy_kv(KVTile::at(v_dst, r, c), ok_v ? v_at : v_cache, ok_v);
#pragma unroll
        for (int p = 0; p < kTilePages; ++p) {
            plan.k[p] += k_step;
            plan.v[p] += v_step;
        }
    }
}

// This thread's chunk i of an item's Q rows: its source (null: zero-filled).
template <class Tr, class QueryHead>
FA2_DEVICE const u16* q_chunk_source(const QueryHead& query_head, const int& lane, const int& rows,
                                     const int& headdim, const u16* __restrict__ const& q, const i64& q_batch_stride,
                                     const int& q_row_stride, const i64& q_head_stride, const DecodeItem& it, int i) {
    constexpr bool solo = Tr::kWarpItems;
    constexpr int kDT = Tr::kHeadDim / 8, kQLoaders = solo ? 32 : Tr::kThreads, kQChunks = 16 * kDT;
    const int idx = (solo ? lane : threadIdx.x) + i * kQLoaders;
    const int r = idx / kDT, c = (idx % kDT) * 8, packed = it.row0 + r;
    const bool ok = (kQChunks % kQLoaders == 0 || idx < kQChunks) && packed < rows && c < headdim;
    int query, head;
    query_head(it.kv_head, packed, query, head);
    return ok ? q + it.b * q_batch_stride + (i64)query * q_row_stride + head * q_head_stride + c : nullptr;
}

}  // namespace fa2
