// The Hopper forward's epilogue, the producer's part: the consumer warpgroups stage their normalised output rows in
// the item's Q buffer (Q is no longer read; fwd_consumer.cuh), and the producer writes them out to o before it loads
// another Q there, so the write is off the consumers' turns.
#pragma once
#include "common/types.cuh"
#include "sm80/memory.cuh"
#include "sm90/tma.cuh"
#include "sm90/slabs.cuh"
#include "sm90/warpgroup.cuh"
#include "hopper/fwd_traits.cuh"

namespace fa2 {

// Padded calls: the output rows the consumers staged in Q buffer `buffer`, out to o for the item its words name (the
// producer's one thread: a TMA store per slab, rows past the sequence not written).
template <class Tr>
FA2_DEVICE void write_rows_tma(const HopperFwdSmem<Tr>& smem, const TensorMap& tmap_o, int buffer) {
    using QTile = typename Tr::QTile;
    const int* slot = smem.item_slots + Tr::kSlotWords * buffer;
    const u32 tile = smem.q + buffer * QTile::kBytes;
    for (int slab = 0; slab < Tr::OTile::kSlabs; ++slab)
        tma_store(tmap_o, 64 * slab, slot[5], slot[4] * Tr::kBlockM, slot[6], tile + slab * QTile::kSlabBytes);
    bulk_commit();
}

// Varlen calls: the output rows the consumers staged in Q buffer `buffer` for the item its slot still names, out to
// o: a whole tile by the first thread's TMA store; a sequence's ragged last tile by every producer thread, each the
// chunks it loads Q into (`loader`'s), so that its own copies cannot overtake these reads. The rows of o are
// `row_stride` apart.
template <class Tr, class Loader>
FA2_DEVICE void write_rows_varlen(const HopperFwdSmem<Tr>& smem, const HopperFwdArgs& args, const Loader& loader,
                                  const int& ptid, const int& row_stride, int buffer) {
    using QTile = typename Tr::QTile;
    constexpr int kRowStep = Loader::kRowStep;
    const int* slot = smem.item_slots + Tr::kSlotWords * buffer;
    const int seqlen = slot[1], q_start = slot[3], m_block = slot[4], head = slot[5], b = slot[6];
    // (read before rewritten)
    named_barrier_sync<Tr::kProducerBarrier, Tr::kProducerThreads>();
    const int row0 = m_block * Tr::kBlockM;
    if (seqlen - row0 >= Tr::kBlockM) {  // a whole tile: the first thread's TMA store
        if (ptid == 0) {
            tma_store_tile<typename Tr::OTile>(args.tmap_o, head, q_start + row0, 0, smem.q + buffer * QTile::kBytes);
            bulk_wait_read<0>();  // (the rows read out before Q lands there)
        }
        return;
    }
    const int first_row = loader.first_row, column = loader.column;
    u16* to = args.o + b * args.o_batch_stride + (i64)(q_start + row0 + first_row) * row_stride +
              head * args.o_head_stride + column;
    u32 from = QTile::at(smem.q + buffer * QTile::kBytes, first_row, column);
#pragma unroll 1
    for (int row = first_row; row < Tr::kBlockM && row < seqlen - row0;
         row += kRowStep, from += kRowStep * QTile::kRowBytes, to += (i64)kRowStep * row_stride) {
#pragma unroll
        for (int pass = 0; pass < Loader::kPasses; ++pass) {  // (rows wider than 128 columns: a slab at a time)
            // (past o's own head dim, which may be narrower: with one pass, such a thread's rows are none)
            // (or past the kernel's own narrower v, Tr::kHeadDimV)
            if (pass >= Tr::OTile::kSlabs ||
                (pass > 0 && pass == Loader::kPasses - 1 && column + pass * 64 >= args.headdim_v))
                continue;
            u32 x[4];
            ld_shared_v4(from + pass * QTile::kSlabBytes, x);
            *reinterpret_cast<uint4*>(to + pass * 64) = make_uint4(x[0], x[1], x[2], x[3]);
        }
    }
    // (every thread's reads done before the first thread's TMA copy of the next Q lands there)
    named_barrier_sync<Tr::kProducerBarrier, Tr::kProducerThreads>();
}

}  // namespace fa2
