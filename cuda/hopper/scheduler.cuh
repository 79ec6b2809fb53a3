// The Hopper forward's work items and the order blocks take them in: (query tile, head, batch row), the last query
// tiles of every head first within groups of heads that share L2; and each item's sequence bounds.
#pragma once
#include "common/types.cuh"
#include "common/warp.cuh"
#include "attention/masks.cuh"
#include "hopper/fwd_traits.cuh"

namespace fa2 {

template <int BlockM>
struct HopperFwdScheduler {
    int nheads, heads_per_group, tail_heads;
    int m_blocks, heads, items;

    FA2_DEVICE HopperFwdScheduler(int seqlen_q, int nheads_, int batch, int heads_per_group_, int tail_heads_)
        : nheads(nheads_), heads_per_group(heads_per_group_), tail_heads(tail_heads_),
          m_blocks((seqlen_q + BlockM - 1) / BlockM), heads(nheads_ * batch), items(m_blocks * heads) {}

    // Work item -> (query tile, head, batch row). The (batch row, head) pairs go in groups of heads_per_group
    // whose K/V fit in L2 together, so that the blocks at work at any time share them (all heads at once
    // overflowed it: 60% hits at 32 x 4 MB); within a group the last query tiles of every head first, as under
    // a causal mask they see the most keys (with the tile counter, blocks then take items longest first). The
    // last group holds the last tail_heads pairs (the host makes the rest whole groups): taken longest first while
    // the grid ends, its longest items must start early enough to end with its short ones (configs.
    // hopper_tail_heads).
    FA2_DEVICE void coords(int item, int& m_block, int& head, int& b) const {
        const int lead_items = (heads - tail_heads) * m_blocks;
        int first = heads - tail_heads, members = tail_heads, rank = item - lead_items;
        if (item < lead_items) {
            const int group = item / (m_blocks * heads_per_group);
            first = group * heads_per_group;
            members = heads_per_group;
            rank = item - group * m_blocks * heads_per_group;
        }
        const int tile = rank / members, pair = first + rank - tile * members;
        m_block = m_blocks - 1 - tile;
        head = pair % nheads;
        b = pair / nheads;
    }
};

// A sequence's lengths and first rows.
struct HopperFwdBounds {
    int seqlen_q, seqlen_k, q_start, k_start;
};

// Sequence b's bounds (varlen: from cu_seqlens, checked; `reporter` reports a bad one; padded: the arguments').
template <class Tr>
FA2_DEVICE HopperFwdBounds sequence_bounds(const HopperFwdArgs& args, int b, bool reporter) {
    HopperFwdBounds r{args.seqlen_q, args.seqlen_k, 0, 0};
    if constexpr (Tr::kVarlen) {
        const SeqBounds seq(args.cu_seqlens_q, args.cu_seqlens_k, b, args.total_q, args.total_k, args.error_claim,
                            args.error_host, r.seqlen_q, r.seqlen_k, reporter ? 1 : 0);
        // (the same on every lane: uniform, the loops over the sequence's tiles and what they count stay off
        // vector registers and lane loops, as with the padded kernel's bounds from kernel arguments)
        // (paged: cu_seqlens_k counts keys in the sequence's pages, which start at its block_table row)
        r = {warp_uniform(r.seqlen_q), warp_uniform(r.seqlen_k), warp_uniform(seq.q_start),
             Tr::kPaged ? 0 : warp_uniform(seq.k_start)};
    }
    return r;
}

}  // namespace fa2
