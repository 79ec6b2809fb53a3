// Masks as small policies the kernels are templated on. A policy answers two questions: which key tiles a
// query tile can see at all (so invisible tiles are skipped, not computed and masked), and which scores inside
// a partially visible tile become -inf.
#pragma once
#include "primitives.cuh"

namespace fa2 {

// Sliding-window mask, bottom-right aligned (flash-attn >= 2.1): with diag = seqlen_k - seqlen_q, query row i
// sees key j iff i + diag - left <= j <= i + diag + right. Three kinds, fixed at compile time so that each kernel
// pays only for its own mask: kMaskNone (every key), kMaskCausal (the window (unlimited, 0), bounds folded into
// the code) and kMaskWindow (left/right from the host, kUnlimitedWindow for a side without a limit). Keys at or
// beyond seqlen_k are always masked (ragged last tile).
constexpr int kUnlimitedWindow = 1 << 30;  // row + diag + this stays below 2^31 for any supported length
enum MaskKind : int { kMaskNone = 0, kMaskCausal = 1, kMaskWindow = 2 };

template <int Kind>
struct WindowMask {
    static constexpr bool Masked = Kind != kMaskNone;
    int seqlen_q, seqlen_k, window_left, window_right;

    FA2_DEVICE int left() const { return Kind == kMaskWindow ? window_left : kUnlimitedWindow; }
    FA2_DEVICE int right() const { return Kind == kMaskWindow ? window_right : 0; }

    FA2_DEVICE int diag() const { return seqlen_k - seqlen_q; }
    // The first key any of rows [row0, ...) can see.
    FA2_DEVICE int key_begin(int row0) const {
        if (Kind != kMaskWindow) return 0;
        const int begin = row0 + diag() - left();
        return begin > 0 ? begin : 0;
    }
    // One past the last key any of rows [row0, row0 + rows) can see.
    FA2_DEVICE int key_end(int row0, int rows) const {
        if (!Masked) return seqlen_k;
        const int end = row0 + rows + seqlen_k - seqlen_q + right();
        return end < seqlen_k ? end : seqlen_k;
    }
    // The key tiles of BlockN keys that rows [row0, row0 + rows) visit: from tile `first`, `count` of them (0: none
    // is visible); tiles wholly outside every row's window are skipped.
    template <int BlockN>
    FA2_DEVICE void key_tiles(int row0, int rows, int& first, int& count) const {
        const int end = key_end(row0, rows);
        first = key_begin(row0) / BlockN;
        const int last = end > 0 ? (end + BlockN - 1) / BlockN : 0;
        count = last > first ? last - first : 0;
    }
    // Whether query row `row` sees key `col`.
    FA2_DEVICE bool visible(int row, int col) const {
        return col < seqlen_k &&
               (!Masked || (col <= row + seqlen_k - seqlen_q + right() && (Kind != kMaskWindow || col >= row + diag() - left())));
    }
    // The first query row that can see key `col` (the backward walks query tiles from there).
    FA2_DEVICE int first_query(int col) const {
        if (!Masked) return 0;
        const int row = col - (seqlen_k - seqlen_q) - right();
        return row > 0 ? row : 0;
    }
    // One past the last query row that can see key `col`.
    FA2_DEVICE int query_end(int col) const {
        if (Kind != kMaskWindow) return seqlen_q;
        const int end = col - diag() + left() + 1;
        return end < seqlen_q ? end : seqlen_q;
    }
    // Whether the tile of rows [row0, row0 + rows) x keys [col0, col0 + cols) needs per-element masking.
    FA2_DEVICE bool tile_needs_mask(int row0, int rows, int col0, int cols) const {
        return col0 + cols > seqlen_k || (Masked && col0 + cols - 1 > row0 + seqlen_k - seqlen_q + right()) ||
               (Kind == kMaskWindow && col0 < row0 + rows - 1 + seqlen_k - seqlen_q - left());
    }
    // s: this warp's scores in C-fragment layout; rows start at row0 (global query index), columns at col0.
    template <int MTiles, int NTiles>
    FA2_DEVICE void apply(float (&s)[MTiles][NTiles][4], int row0, int col0, int lane) const {
#pragma unroll
        for (int mt = 0; mt < MTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = row0 + mt * 16 + (lane >> 2) + half * 8;
                if constexpr (Kind == kMaskWindow) {
                    // Each key's distance from the row's diagonal: one register per row, not two bounds.
                    const int from_diag = col0 + (lane & 3) * 2 - row - diag();
#pragma unroll
                    for (int nt = 0; nt < NTiles; ++nt) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int key = col0 + nt * 8 + (lane & 3) * 2 + e, dist = from_diag + nt * 8 + e;
                            if (key >= seqlen_k || dist > window_right || dist < -window_left)
                                s[mt][nt][2 * half + e] = -pos_inf();
                        }
                    }
                } else {
                    int limit = Masked ? row + diag() + 1 : seqlen_k;  // first invisible key
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
    }
};

}  // namespace fa2
