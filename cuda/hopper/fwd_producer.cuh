// The Hopper forward's producer warpgroup: each work item's Q tile and its K/V tiles into shared memory, announced on
// mbarriers, ahead of the consumers; and the rows the consumers staged, out to o (fwd_epilogue.cuh). Padded calls
// move every tile by TMA from one thread; varlen calls so too for Q, whole output tiles and, with packed K/V, a
// sequence's whole K/V tiles, and with every producer thread's cp.async for the rest (ragged tiles, paged K/V).
#pragma once
#include "common/types.cuh"
#include "common/hints.cuh"
#include "common/warp.cuh"
#include "sm80/memory.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/tma.cuh"
#include "sm90/slabs.cuh"
#include "sm90/warpgroup.cuh"
#include "attention/masks.cuh"
#include "hopper/fwd_traits.cuh"
#include "hopper/scheduler.cuh"
#include "hopper/fwd_epilogue.cuh"

namespace fa2 {

// Padded calls: the producer's first thread issues every copy (a slab of 64 columns per box); the others have left.
// Q lands on q_full, a tile's K and V together on full, each barrier expecting the bytes.
template <class Tr>
FA2_DEVICE void produce_padded(const HopperFwdSmem<Tr>& smem, const HopperFwdScheduler<Tr::kBlockM>& sched,
                               const HopperFwdArgs& args) {
    using QTile = typename Tr::QTile;
    using KVTile = typename Tr::KVTile;
    using VTile = typename Tr::VTile;
    constexpr int kKS = Tr::kKStages, kVS = Tr::kVStages;
    u32 tiles = 0, items_loaded = 0;
    for (int item = blockIdx.x;;) {
        const int q_buffer = ring_slot<Tr::kQBuffers>(items_loaded);
        int* const slot = smem.item_slots + Tr::kSlotWords * q_buffer;
        if (item >= sched.items) {
            // The rows of the last items out, as the consumers stage them, then the end in a free buffer.
            for (u32 last = items_loaded > Tr::kQBuffers ? items_loaded - Tr::kQBuffers : 0; last < items_loaded;
                 ++last) {
                mbar_wait(smem.q_empty(ring_slot<Tr::kQBuffers>(last)), ring_phase<Tr::kQBuffers>(last));
                write_rows_tma(smem, args.tmap_o, ring_slot<Tr::kQBuffers>(last));
            }
            bulk_wait<0>();  // (every row out, every buffer read, before the block can leave)
            slot[0] = sched.items;
            mbar_arrive(smem.q_full(q_buffer));
            return;
        }
        // The next item now, so that the atomic's round trip overlaps this one's copies.
        const int next = args.tile_counter != nullptr ? atomicAdd(args.tile_counter, 1) + (int)gridDim.x
                                                      : item + (int)gridDim.x;
        int m_block, head, b;
        sched.coords(item, m_block, head, b);
        const int row0 = m_block * Tr::kBlockM, kv_head = head / args.heads_per_kv;
        fwd_mark(20, items_loaded);
        mbar_wait(smem.q_empty(q_buffer), ring_phase<Tr::kQBuffers>(items_loaded) ^ 1);
        if (items_loaded >= Tr::kQBuffers) {
            write_rows_tma(smem, args.tmap_o, q_buffer);
            bulk_wait_read<0>();  // (the rows read out before Q lands there)
        }
        slot[0] = item, slot[1] = args.seqlen_q, slot[2] = args.seqlen_k, slot[3] = 0;
        slot[4] = m_block, slot[5] = head, slot[6] = b;
        fwd_mark(22, items_loaded);
        mbar_arrive_expect_tx(smem.q_full(q_buffer), QTile::kBytes);  // (release: the item's words)
        // (Q's slabs here and the rows' in write_rows_tma written out: through tma_load_tile / tma_store_tile ptxas
        // orders the producer's item set-up differently, not measured)
        for (int slab = 0; slab < QTile::kSlabs; ++slab)
            tma_load(smem.q + q_buffer * QTile::kBytes + slab * QTile::kSlabBytes, args.tmap_q, 64 * slab, head, row0,
                     b, smem.q_full(q_buffer));
        const WindowMask<Tr::kMask> mask{args.seqlen_q, args.seqlen_k, args.window_left, args.window_right};
        int n_first, n_blocks;
        mask.template key_tiles<Tr::kBlockN>(row0, Tr::kBlockM, n_first, n_blocks);
        for (int t = 0, key = n_first * Tr::kBlockN; t < n_blocks; ++t, ++tiles, key += Tr::kBlockN) {
            const int k_slot = ring_slot<kKS>(tiles), v_slot = ring_slot<kVS>(tiles);
            mbar_wait(smem.k_empty(k_slot), ring_phase<kKS>(tiles) ^ 1);
            mbar_arrive_expect_tx(smem.full(k_slot), KVTile::kBytes + VTile::kBytes);
            tma_load_tile<KVTile>(smem.k + k_slot * KVTile::kBytes, args.tmap_k, kv_head, key, b, smem.full(k_slot));
            mbar_wait(smem.v_empty(v_slot), ring_phase<kVS>(tiles) ^ 1);
            tma_load_tile<VTile>(smem.v + v_slot * VTile::kBytes, args.tmap_v, kv_head, key, b, smem.full(k_slot));
        }
        fwd_mark(23, items_loaded);
        ++items_loaded;
        item = next;
    }
}

// Varlen calls: every producer thread takes part. A tile (zeros from row `valid` on) goes into swizzled slabs by each
// thread's cp.async, then one arrival per thread on its barrier, made when they have landed. An item's Q and whole
// output tiles, and with packed K/V (not paged) its sequence's whole K/V tiles, go by the first thread's TMA copies
// instead. The stages below take the producer's state by reference; produce_varlen binds them to it.
template <class Tr>
using VarlenLoader = SlabLoader<Tr::kProducerThreads, Tr::kHeadDim>;

// With three consumer warpgroups the producer has 32 registers: its rows and these two strides are taken afresh per
// item (keep_here), or ptxas holds each array's row offset and the strides' sign words through the item loop, and
// spills.
template <class Tr>
FA2_DEVICE void renew_per_item(const int& ptid, const int& cols, VarlenLoader<Tr>& loader, int& out_row_stride,
                               int& row_pages) {
    if constexpr (Tr::kConsumerWGs == 3) {
        int thread = ptid;
        keep_here(thread);
        loader = VarlenLoader<Tr>(thread, cols);
        keep_here(out_row_stride);
        keep_here(row_pages);
    }
}

// Hands `item` (or, past the last, the end) and its sequence's bounds to the consumers in Q buffer `buffer`, once the
// producer has it back (so that they do not wait for cu_seqlens at every item's start).
template <class Tr>
FA2_DEVICE void publish_item(const HopperFwdSmem<Tr>& smem, const int& ptid, int buffer, int item,
                             const HopperFwdBounds& seq, int m_block, int head, int b) {
    if (ptid == 0) {
        int* slot = smem.item_slots + Tr::kSlotWords * buffer;
        slot[0] = item, slot[1] = seq.seqlen_q, slot[2] = seq.seqlen_k, slot[3] = seq.q_start;
        slot[4] = m_block, slot[5] = head, slot[6] = b;
    }
}

// The item after `item`: with a tile counter the one the first thread took (`ticket`), handed to the others through
// two exchange words in turn (a word is rewritten only after every thread has read it); without, a grid stride on.
template <class Tr>
FA2_DEVICE int next_varlen_item(const HopperFwdSmem<Tr>& smem, int* __restrict__ const& tile_counter,
                                const int& ptid, int& exchange, int item, int ticket) {
    if (tile_counter == nullptr) return item + (int)gridDim.x;
    if (ptid == 0) smem.item_slots[Tr::kSlotWords * Tr::kQBuffers + exchange] = ticket;
    named_barrier_sync<Tr::kProducerBarrier, Tr::kProducerThreads>();
    const int next = warp_uniform(smem.item_slots[Tr::kSlotWords * Tr::kQBuffers + exchange]);
    exchange ^= 1;
    return next;
}

// Paged: lane j of producer warp w looks up row 32 w + j of the next tile (keys_left from its first on), its K and V
// rows alike (a bad block_table entry is reported and its rows read as zeros, as in flash_fwd); with 64-key tiles row
// 16 w + j % 16 (SlabLoader::load_paged_rows). (Looking the rows up a tile ahead measured the same: docs/design.md.)
template <class Tr>
FA2_DEVICE void look_up_paged_rows(const HopperFwdArgs& args, const int& ptid, const int& row_pages, const int& b,
                             const int& kv_head, const HopperFwdBounds& seq, const int& keys_left, const u16*& k_row,
                             const u16*& v_row) {
    const PagedKeys keys{args.block_table + (i64)b * row_pages, {args.page_magic, args.page_shift}, args.page_size,
                         args.num_pages};
    int page, slot;
    const int row = Tr::kBlockN >= Tr::kProducerThreads ? ptid : 16 * (ptid >> 5) + (ptid & 15);
    const bool ok = row < keys_left && keys.locate(seq.seqlen_k - keys_left + row, page, slot, b, args.error_claim,
                                                   args.error_host);
    k_row = ok ? args.k + kv_head * args.k_head_stride + page * args.k_batch_stride + (i64)slot * args.k_row_stride
               : nullptr;
    v_row = ok ? args.v + kv_head * args.v_head_stride + page * args.v_batch_stride + (i64)slot * args.v_row_stride
               : nullptr;
}

// The next tile's K and V (into ring slots of the tiles-th tile), then its one arrival: the item's (kv_head, seq),
// the next tile's K and V rows (k_tile, v_tile; paged: this lane's, k_row and v_row, from look_up_rows) and the keys
// left from its first on, all running (fewer live registers). Packed K/V: a whole tile of the sequence's keys by TMA
// (the first thread's copies and arrivals); the sequence's last, ragged tile by cp.async (load_rows), whose zeros past
// its keys keep another sequence's rows (which may hold anything) out of P V.
template <class Tr, class LookUpRows, class LoadRows>
FA2_DEVICE void load_kv_tile(const HopperFwdSmem<Tr>& smem, const HopperFwdArgs& args, const int& ptid, u32& tiles,
                             const int& kv_head, const HopperFwdBounds& seq, int& keys_left, const u16*& k_tile,
                             const u16*& v_tile, const u16*& k_row, const u16*& v_row, const LookUpRows& look_up_rows,
                             const LoadRows& load_rows) {
    using KVTile = typename Tr::KVTile;
    using VTile = typename Tr::VTile;
    constexpr int kKS = Tr::kKStages, kVS = Tr::kVStages;
    const int k_slot = ring_slot<kKS>(tiles), v_slot = ring_slot<kVS>(tiles);
    if constexpr (Tr::kPaged) look_up_rows();  // (its load in flight while the slot is waited for)
    mbar_wait(smem.k_empty(k_slot), ring_phase<kKS>(tiles) ^ 1);
    if (!Tr::kPaged && keys_left >= Tr::kBlockN) {
        const int row = seq.k_start + seq.seqlen_k - keys_left;
        if (ptid == 0) {
            mbar_arrive_expect_tx<Tr::kCopyArrivals>(smem.full(k_slot), KVTile::kBytes + VTile::kBytes);
            tma_load_tile<KVTile>(smem.k + k_slot * KVTile::kBytes, args.tmap_k, kv_head, row, 0, smem.full(k_slot));
        }
        mbar_wait(smem.v_empty(v_slot), ring_phase<kVS>(tiles) ^ 1);
        if (ptid == 0)
            tma_load_tile<VTile>(smem.v + v_slot * VTile::kBytes, args.tmap_v, kv_head, row, 0, smem.full(k_slot));
    } else {
        load_rows(KVTile{}, smem.k + k_slot * KVTile::kBytes, k_tile, k_row, args.k, args.k_row_stride, args.headdim);
        mbar_wait(smem.v_empty(v_slot), ring_phase<kVS>(tiles) ^ 1);
        load_rows(VTile{}, smem.v + v_slot * VTile::kBytes, v_tile, v_row, args.v, args.v_row_stride,
                  args.headdim_v);
        // (packed: fenced here, once an item, so that the consumers' steady loop fences only when paged)
        if constexpr (Tr::kPaged)
            cp_async_mbar_arrive(smem.full(k_slot));
        else
            cp_async_fenced_arrive(smem.full(k_slot));
    }
    ++tiles;
    k_tile += (i64)Tr::kBlockN * args.k_row_stride;
    v_tile += (i64)Tr::kBlockN * args.v_row_stride;
    keys_left -= Tr::kBlockN;
}

template <class Tr>
FA2_DEVICE void produce_varlen(const HopperFwdSmem<Tr>& smem, const HopperFwdScheduler<Tr::kBlockM>& sched,
                               const HopperFwdArgs& args) {
    using QTile = typename Tr::QTile;
    // The producer's state: its thread, its loader and the two strides renewed per item, the K/V tiles it has
    // loaded, the items (Q buffer items_loaded % kQBuffers next), the exchange word in turn. (The stages are bound to
    // them by lambdas: with the state in a struct of its own, or the stages called directly, the loop compiled to
    // other instructions and registers.)
    const int ptid = threadIdx.x - 32 * Tr::kConsumerWarps;
    VarlenLoader<Tr> loader(ptid, args.headdim);
    int out_row_stride = args.o_row_stride, row_pages = args.max_pages;
    u32 tiles = 0;
    u32 items_loaded = 0;
    int exchange = 0;
    const auto renew = [&] { renew_per_item<Tr>(ptid, args.headdim, loader, out_row_stride, row_pages); };
    const auto load_tile = [&](auto tile, u32 dst, const u16* src, int row_stride, int valid, int cols) {
        loader.template load<decltype(tile)>(dst, src, row_stride, valid, cols);
    };
    const auto q_buffer = [&] { return ring_slot<Tr::kQBuffers>(items_loaded); };
    const auto store_rows = [&](int buffer) {  // fwd_epilogue.cuh
        write_rows_varlen<Tr>(smem, args, loader, ptid, out_row_stride, buffer);
    };
    // The next Q buffer once the consumers hand it back, with the rows of the item it held written out.
    const auto free_buffer = [&] {
        mbar_wait(smem.q_empty(q_buffer()), ring_phase<Tr::kQBuffers>(items_loaded) ^ 1);
        if (items_loaded >= Tr::kQBuffers) store_rows(q_buffer());
    };
    const auto publish = [&](int item, const HopperFwdBounds& seq, int m_block, int head, int b) {
        publish_item<Tr>(smem, ptid, q_buffer(), item, seq, m_block, head, b);
    };
    const auto next_item = [&](int item, int ticket) {
        return next_varlen_item<Tr>(smem, args.tile_counter, ptid, exchange, item, ticket);
    };
    const auto mark = [&](int point) {
        if (ptid == 0) fwd_mark(point, items_loaded);
    };
    for (int item = blockIdx.x;;) {
        renew();
        // The first thread takes the next item now, so that the atomic's round trip overlaps this one's loads.
        int ticket = 0;
        if (args.tile_counter != nullptr && ptid == 0 && item < sched.items)
            ticket = atomicAdd(args.tile_counter, 1) + gridDim.x;
        if (item >= sched.items) {
            // The rows of the last items out, as the consumers stage them, then the end in a free buffer.
            for (u32 last = items_loaded > Tr::kQBuffers ? items_loaded - Tr::kQBuffers : 0; last < items_loaded;
                 ++last) {
                mbar_wait(smem.q_empty(ring_slot<Tr::kQBuffers>(last)), ring_phase<Tr::kQBuffers>(last));
                store_rows(ring_slot<Tr::kQBuffers>(last));
            }
            publish(sched.items, HopperFwdBounds{}, 0, 0, 0);
            if (ptid == 0) mbar_arrive(smem.q_full(q_buffer()));  // (release: the item slot's store)
            break;
        }
        int m_block, head, b;
        sched.coords(item, m_block, head, b);
        const int row0 = m_block * Tr::kBlockM, kv_head = head / args.heads_per_kv;
        // (a sequence's first item: its last query tile of head 0)
        const HopperFwdBounds seq =
            sequence_bounds<Tr>(args, b, ptid == 0 && m_block == sched.m_blocks - 1 && head == 0);
        if (Tr::kVarlen && row0 >= seq.seqlen_q) {  // past this sequence's queries: the consumers never see it
            item = next_item(item, ticket);
            continue;
        }
        mark(20);
        free_buffer();
        publish(item, seq, m_block, head, b);
        mark(22);
        const WindowMask<Tr::kMask> mask{seq.seqlen_q, seq.seqlen_k, args.window_left, args.window_right};
        int n_first, n_blocks;
        mask.template key_tiles<Tr::kBlockN>(row0, Tr::kBlockM, n_first, n_blocks);
        // The next tile's K and V rows, and the keys left from its first on (load_kv_tile).
        const int first_key = n_first * Tr::kBlockN;
        int keys_left = seq.seqlen_k - first_key;
        const u16* k_tile = args.k + b * args.k_batch_stride + (i64)(seq.k_start + first_key) * args.k_row_stride +
                            kv_head * args.k_head_stride;
        const u16* v_tile = args.v + b * args.v_batch_stride + (i64)(seq.k_start + first_key) * args.v_row_stride +
                            kv_head * args.v_head_stride;
        const u16* k_row = nullptr;
        const u16* v_row = nullptr;
        // Q by TMA: rows past the sequence's end are the next one's, or zeros past the array's (each output row
        // depends on its own query row alone, and these are never written out).
        if (ptid == 0) {
            mbar_arrive_expect_tx(smem.q_full(q_buffer()), QTile::kBytes);  // (release: the item's words)
            tma_load_tile<QTile>(smem.q + q_buffer() * QTile::kBytes, args.tmap_q, head, seq.q_start + row0, 0,
                                 smem.q_full(q_buffer()));
        }
        const auto look_up_rows = [&] {
            look_up_paged_rows<Tr>(args, ptid, row_pages, b, kv_head, seq, keys_left, k_row, v_row);
        };
        // The next tile's K or V rows (`tile_type`: KVTile, or VTile for V's): from `tile` (packed), or from their
        // pages (paged: `row` is this lane's row, and zero-filled rows name `pool`, the start of K or V, as their
        // source, which is not read). (`cols`: k's or v's head dim)
        const auto load_rows = [&](auto tile_type, u32 dst, const u16* tile, const u16* row, const u16* pool,
                                   int row_stride, int cols) {
            if constexpr (Tr::kPaged)
                loader.template load_paged_rows<decltype(tile_type)>(dst, row, pool, ptid >> 5, ptid & 31);
            else
                load_tile(tile_type, dst, tile, row_stride, keys_left, cols);
        };
        const auto load_kv = [&] {
            load_kv_tile<Tr>(smem, args, ptid, tiles, kv_head, seq, keys_left, k_tile, v_tile, k_row, v_row,
                             look_up_rows, load_rows);
        };
        for (int t = 0; t < n_blocks; ++t) load_kv();
        mark(23);
        ++items_loaded;
        item = next_item(item, ticket);
    }
    cp_async_wait_all();            // leave nothing in flight into shared memory
    if (ptid == 0) bulk_wait<0>();  // (every row out before the block can leave)
}

}  // namespace fa2
