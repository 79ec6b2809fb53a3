// Masks as small policies the kernels are templated on. A policy answers two questions: which key tiles a
// query tile can see at all (so invisible tiles are skipped, not computed and masked), and which scores inside
// a partially visible tile become -inf. Later masks (sliding window, ALiBi, softcap) slot in beside these.
#pragma once
#include "primitives.cuh"

namespace fa2 {

// Bottom-right aligned causal mask (flash-attn >= 2.1): query row i sees key j iff j <= i + (seqlen_k - seqlen_q),
// or every key when Causal is false. Keys at or beyond seqlen_k are always masked (ragged last tile).
template <bool Causal>
struct CausalMask {
    int seqlen_q, seqlen_k;

    // One past the last key any of rows [row0, row0 + rows) can see.
    FA2_DEVICE int key_end(int row0, int rows) const {
        if (!Causal) return seqlen_k;
        const int end = row0 + rows + seqlen_k - seqlen_q;
        return end < seqlen_k ? end : seqlen_k;
    }
    // Whether query row `row` sees key `col`.
    FA2_DEVICE bool visible(int row, int col) const {
        return col < seqlen_k && (!Causal || col <= row + seqlen_k - seqlen_q);
    }
    // The first query row that can see key `col` (the backward walks query tiles from there).
    FA2_DEVICE int first_query(int col) const {
        if (!Causal) return 0;
        const int row = col - (seqlen_k - seqlen_q);
        return row > 0 ? row : 0;
    }
    // Whether the key tile [col0, col0 + cols) needs per-element masking for rows from row0 on.
    FA2_DEVICE bool tile_needs_mask(int row0, int col0, int cols) const {
        if (col0 + cols > seqlen_k) return true;
        return Causal && col0 + cols - 1 > row0 + seqlen_k - seqlen_q;
    }
    // s: this warp's scores in C-fragment layout; rows start at row0 (global query index), columns at col0.
    template <int MTiles, int NTiles>
    FA2_DEVICE void apply(float (&s)[MTiles][NTiles][4], int row0, int col0, int lane) const {
        const int diag = seqlen_k - seqlen_q;
#pragma unroll
        for (int mt = 0; mt < MTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = row0 + mt * 16 + (lane >> 2) + half * 8;
                int limit = Causal ? row + diag + 1 : seqlen_k;  // first invisible key
                limit = limit < seqlen_k ? limit : seqlen_k;
#pragma unroll
                for (int nt = 0; nt < NTiles; ++nt) {
                    const int col = col0 + nt * 8 + (lane & 3) * 2;
                    if (col >= limit) s[mt][nt][2 * half] = -pos_inf();
                    if (col + 1 >= limit) s[mt][nt][2 * half + 1] = -pos_inf();
                }
            }
        }
    }
};

}  // namespace fa2
