// decode_attention's compile-time configuration (DecodeTraits), its work items and tile plans, the index values of
// one call (shared with the append kernel) and the diagnostics hook of bench/dev/decode_trace.py.
#pragma once
#include "common/types.cuh"
#include "common/clock.cuh"
#include "sm80/smem_tile.cuh"

namespace fa2 {

constexpr int cmax(int a, int b) { return a > b ? a : b; }

// The index values of one call, shared by the append and the attention kernels.
struct CacheIndex {
    const int* block_table;      // (batch, max_pages) or null (contiguous cache)
    const int* cache_seqlens;    // (batch,) or null: every row holds fixed_seqlen
    const int* cache_batch_idx;  // (batch,) or null: batch row b uses cache row b
    int fixed_seqlen, seqlen_new;
    int capacity;    // keys a row can hold: cache length, or max_pages * page_size
    int cache_rows;  // rows of a contiguous cache, or pages of a paged one
    int page_size, max_pages;

    FA2_DEVICE int cached(int b) const { return cache_seqlens != nullptr ? cache_seqlens[b] : fixed_seqlen; }
    FA2_DEVICE bool seqlen_ok(int len) const { return len >= 0 && len <= capacity - seqlen_new; }
    FA2_DEVICE int cache_row(int b) const { return cache_batch_idx != nullptr ? cache_batch_idx[b] : b; }
    FA2_DEVICE bool row_ok(int row) const { return row >= 0 && row < cache_rows; }
};

// Diagnostics for bench/dev/decode_trace.py: built with FA2_DECODE_TRACE, thread 0 of each block records %globaltimer
// and clock64 at numbered points of each work item's life (and the block and its SM in the last slots); otherwise
// the marks compile away.
constexpr int kTracePoints = 24;
#ifndef FA2_DECODE_TRACE_STRIDE  // key tiles 0, S, 2S, ... 9S get marks 2..11
#define FA2_DECODE_TRACE_STRIDE 1
#endif
#ifdef FA2_DECODE_TRACE
#ifndef FA2_DECODE_TRACE_ARRAY  // (another name for a second traced build in the same process)
#define FA2_DECODE_TRACE_ARRAY fa2_decode_trace
#endif
extern "C" {
__device__ unsigned long long FA2_DECODE_TRACE_ARRAY[8192 * kTracePoints * 2];
}
FA2_DEVICE void decode_mark(int point, int item) {
    const unsigned id = item;
    if (threadIdx.x != 0 || id >= 8192) return;
    const unsigned long long now = global_timer();
    const unsigned sm = sm_id();
    unsigned long long* slot = FA2_DECODE_TRACE_ARRAY + (unsigned long long)id * kTracePoints * 2;
    slot[2 * point] = now;
    slot[2 * point + 1] = clock64();
    slot[2 * (kTracePoints - 1)] = sm;
    slot[2 * (kTracePoints - 1) + 1] = blockIdx.x;
}
#else
FA2_DEVICE void decode_mark(int, int) {}
#endif

// Extras: the sliding window (causal folded in as its right side 0; instantiated with Causal = false), softcap,
// ALiBi and cache_leftpad, all switched by run-time values; without it the kernel compiles to the plain decode.
// DeepRing: each warp keeps Stages key tiles in flight while it waits for the next (every slot refilled right
// after its tile's math) instead of Stages - 1 (refilled before the next tile's math): for streams of a few tiles
// per warp, where the rounds that every block starts together dominate (docs/design.md).
// WarpItems: each warp streams whole work items of its own (no split across warps, so no block merge and no block
// barrier: a warp writes its rows itself), for grids with a work item per warp and more, where a block's per-item
// merge and barrier were the SM's time without loads in flight. One split only.
template <int HeadDim, int BlockN, int Stages, int Warps, bool L2Prefetch, class Elem_, bool Causal, bool Paged,
          bool Extras = false, bool DeepRing = false, bool WarpItems = false>
struct DecodeTraits {
    using Elem = Elem_;
    static constexpr bool kL2Prefetch = L2Prefetch;  // cp.async with the L2::256B hint for K/V
    static constexpr int kHeadDim = HeadDim, kBlockN = BlockN, kStages = Stages, kWarps = Warps;
    static constexpr int kThreads = 32 * Warps;
    static constexpr bool kCausal = Causal, kPaged = Paged, kExtras = Extras, kDeepRing = DeepRing;
    static constexpr bool kWarpItems = WarpItems;
    static_assert(!(Causal && Extras), "with Extras, causal is the window's right side 0");
    using QTile = SmemTile<16, HeadDim>;
    using KVTile = SmemTile<BlockN, HeadDim, HeadDim % 64 == 0>;  // swizzled rows where the head dim allows
    static constexpr int kQBytes = 2 * QTile::kBytes;  // the item's Q tile and the next item's (per warp: WarpItems)
    static constexpr int kQAreaBytes = (WarpItems ? Warps : 1) * kQBytes;
    static constexpr int kRingBytes = 2 * Stages * KVTile::kBytes;  // K and V ring of one warp
    // The block's merge: every warp's fp32 output rows (a pitch of HeadDim + 8 floats: conflict-free float2
    // stores) and lse. (The splits' merges need no dynamic shared memory.)
    static constexpr int kMergePitch = HeadDim + 8;
    static constexpr int kMergeBytes = WarpItems ? 0 : Warps * 16 * (kMergePitch + 1) * 4;
    // A block with one item merges in its rings' memory; a block walking several items keeps the next item's
    // first tiles in flight in its rings while it merges, so its merge area comes after them.
    static constexpr int kSmemBytes = kQAreaBytes + cmax(Warps * kRingBytes, kMergeBytes);
    static constexpr int kPersistentSmemBytes = kQAreaBytes + Warps * kRingBytes + kMergeBytes;
    static_assert(Stages >= 2, "the K/V ring needs at least two stages");
    static_assert(BlockN % 16 == 0 && BlockN <= 64, "key tiles of 16..64 keys (a tile spans BlockN / 16 pages)");
};

// One work item of decode_attention: a split of the keys of (batch row b, kv head, block of 16 packed rows).
struct DecodeItem {
    int split, group, b;  // group: kv head + nheads_kv * row block
    int kv_head, row0;
    int cached, cache_row, pad;  // the index values read for row b
    int seqlen_k, key_begin, key_end;
    int first_tile, my_tiles;  // the warp's first key tile of the item's keys, and how many it takes
    bool poisoned;
};

// A key tile's first key and (paged) the index of its first page and the key's slot there.
struct DecodeTileStart {
    int first, page, offset;
};

// A key tile's copies, worked out apart from issuing them: a pointer per page the tile spans.
template <int Pages>
struct DecodeKVPlan {
    const u16* k[Pages];
    const u16* v[Pages];
    int rows_in;       // tile rows with keys: 0 for a lane past k's head dim, or if a page was bad
    int rows_in_v;     // the same for v's head dim
    int first_offset;  // (paged) the tile's first key's slot in its first page
};

// This thread's Q chunks of an item: their sources (null: zero-filled).
template <int Chunks>
struct DecodeQPlan {
    const u16* src[Chunks];
};

}  // namespace fa2
