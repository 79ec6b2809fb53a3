// Masks and score modifiers as small policies the kernels are templated on. A policy answers two questions: which key tiles a
// query tile can see at all (so invisible tiles are skipped, not computed and masked), and which scores inside
// a partially visible tile become -inf.
#pragma once
#include "common/types.cuh"
#include "common/fast_div.cuh"
#include "common/errors.cuh"

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
    // The query tiles of BlockM rows with a row that sees one of keys [col0, col0 + cols) (col0 < seqlen_k; the
    // backward walks them): from tile `first`, `count` of them (0: none).
    template <int BlockM>
    FA2_DEVICE void query_tiles(int col0, int cols, int& first, int& count) const {
        first = first_query(col0) / BlockM;
        const int last_key = (col0 + cols < seqlen_k ? col0 + cols : seqlen_k) - 1;
        const int end = (query_end(last_key) + BlockM - 1) / BlockM;
        count = end > first ? end - first : 0;
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

// Paged K/V of a varlen forward: key j of a sequence is row j % page_size of page pages[j / page_size], `pages`
// the sequence's block_table row. A block_table entry that is not a page of k is reported (ValueError on the host)
// and its row read as zeros, never read through.
struct PagedKeys {
    const int* pages;
    FastDiv page_of;
    int page_size, num_pages;
    // The page and row in it of `key`, or false for a bad entry (reported as sequence `batch`'s).
    FA2_DEVICE bool locate(int key, int& page, int& row, int batch, int* error_claim, long long* error_host) const {
        const int page_idx = page_of.div(key), entry = pages[page_idx];
        if ((unsigned)entry >= (unsigned)num_pages) {
            report_bad_value(error_claim, error_host, kBadVarlenPage, batch, page_idx, entry);
            return false;
        }
        page = entry, row = key - page_idx * page_size;
        return true;
    }
};

// Varlen: sequence `batch` is rows cu_seqlens[batch] .. cu_seqlens[batch + 1] of the packed arrays. Turns the
// kernel's seqlen_q/seqlen_k (the maxima the grid was sized for) into this sequence's lengths and gives its first
// rows. A sequence whose bounds are not 0 <= start <= end <= total with end - start <= the maximum would read or
// write outside the arrays: it is reported (ValueError on the host) and treated as empty. Without cu_seqlens
// (null) nothing changes. cu_seqlens_k may be null for the kernels that only walk queries.
struct SeqBounds {
    int q_start = 0, k_start = 0;
    // reporter: 1 if this thread reports bad bounds, 0 if not (one thread per sequence); by default (-1) thread 0 of
    // the first block of the grid's (x, y) plane, which the kernels with a grid z per sequence have once per sequence.
    FA2_DEVICE SeqBounds(const int* cu_seqlens_q, const int* cu_seqlens_k, int batch, int total_q, int total_k,
                         int* error_claim, long long* error_host, int& seqlen_q, int& seqlen_k, int reporter = -1) {
        if (cu_seqlens_q == nullptr) return;
        const int q0 = cu_seqlens_q[batch], q1 = cu_seqlens_q[batch + 1];
        const int k0 = cu_seqlens_k != nullptr ? cu_seqlens_k[batch] : 0;
        const int k1 = cu_seqlens_k != nullptr ? cu_seqlens_k[batch + 1] : 0;
        const bool q_ok = 0 <= q0 && q0 <= q1 && q1 <= total_q && q1 - q0 <= seqlen_q;
        const bool k_ok = 0 <= k0 && k0 <= k1 && k1 <= total_k && k1 - k0 <= seqlen_k;
        if (q_ok && k_ok) {
            q_start = q0, k_start = k0;
            seqlen_q = q1 - q0, seqlen_k = k1 - k0;
            return;
        }
        if (reporter < 0 ? threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 : reporter != 0)
            report_bad_value(error_claim, error_host, q_ok ? kBadCuSeqlensK : kBadCuSeqlensQ, batch, q_ok ? k0 : q0,
                             q_ok ? k1 : q1);
        seqlen_q = seqlen_k = 0;
    }
};

// Dropout on P (FA2 with dropout): Philox4x32-10 (Salmon et al. 2011), counter-based, so the forward and both
// backward kernels regenerate the same keep mask from (seed, offset) whatever their tiling. The random 16-bit
// number of score (i, j) of sequence entry bh = batch * nheads + head is element
//     (i >> 3 & 1) * 4 + (j & 1) + (j >> 3 & 1) * 2
// of the eight 16-bit halves of philox(key = seed ^ (offset_hi << 32), counter = (i & ~8, j & ~9, bh, offset_lo)):
// one call covers rows {i, i + 8} x keys {j, j + 1, j + 8, j + 9}, exactly what one thread of an m16n8 C fragment
// pair holds in the forward. A score is kept iff its number is below `threshold` = round((1 - p) * 65536).
FA2_DEVICE void philox_4x32_10(u32 (&c)[4], u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const u32 hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        const u32 hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        const u32 n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0, c[1] = lo1, c[2] = n2, c[3] = lo0;
        k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    }
}

struct Dropout {
    u32 threshold;            // keep iff the 16-bit number < threshold; 0 switches dropout off (keep all)
    u32 key0, key1, offset;   // Philox key (the seed, offset's high word folded in) and the counter's last word
    u32 bh;                   // batch * nheads + head
    float scale;              // 1 / (1 - p), applied to the kept P

    FA2_DEVICE bool on() const { return threshold != 0; }
    // The eight 16-bit numbers of rows {i_lo, i_lo + 8} x keys {k_lo, k_lo + 1, k_lo + 8, k_lo + 9}.
    FA2_DEVICE void numbers(u32 (&r)[4], int i_lo, int k_lo) const {
        r[0] = (u32)i_lo, r[1] = (u32)k_lo, r[2] = bh, r[3] = offset;
        philox_4x32_10(r, key0, key1);
    }
    FA2_DEVICE bool keep(const u32 (&r)[4], int index) const {
        return ((r[index >> 1] >> ((index & 1) * 16)) & 0xFFFFu) < threshold;
    }
    // Score (i, j) on its own (the mask-reporting kernel; the attention kernels share calls as described above).
    FA2_DEVICE bool keep_one(int i, int j) const {
        u32 r[4];
        numbers(r, i & ~8, j & ~9);
        return keep(r, ((i >> 3) & 1) * 4 + (j & 1) + ((j >> 3) & 1) * 2);
    }
    // p: one warp's P in C-fragment layout (rows = queries from row0, 16-aligned; columns = keys from col0,
    // 16-aligned): dropped entries become 0 (the 1 / (1 - p) is applied to the output once).
    template <int MTiles, int NTiles>
    FA2_DEVICE void apply_rows(float (&p)[MTiles][NTiles][4], int row0, int col0, int lane) const {
        static_assert(NTiles % 2 == 0, "keys come in 16-key pairs of n8 tiles");
#pragma unroll
        for (int mt = 0; mt < MTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < NTiles; nt += 2) {
                u32 r[4];
                numbers(r, row0 + mt * 16 + (lane >> 2), col0 + nt * 8 + (lane & 3) * 2);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int half = e >> 1, col = e & 1;
                    if (!keep(r, half * 4 + col)) p[mt][nt][e] = 0.f;
                    if (!keep(r, half * 4 + 2 + col)) p[mt][nt + 1][e] = 0.f;
                }
            }
    }
};

// The dropout seed and offset from device memory when rng_state = {seed lo, seed hi, offset lo, offset hi} is given
// (else the kernel arguments stay): a seed traced by JAX never has to reach the host.
FA2_DEVICE void load_rng_state(const u32* rng_state, u32& seed_lo, u32& seed_hi, u32& offset_lo, u32& offset_hi) {
    if (rng_state != nullptr) {
        seed_lo = rng_state[0], seed_hi = rng_state[1];
        offset_lo = rng_state[2], offset_hi = rng_state[3];
    }
}

FA2_DEVICE Dropout make_dropout(u32 threshold, u32 seed_lo, u32 seed_hi, u32 offset_lo, u32 offset_hi, int batch,
                                int nheads, int head, float scale) {
    return Dropout{threshold, seed_lo, seed_hi ^ offset_hi, offset_lo, (u32)(batch * nheads + head), scale};
}

// SeqBounds for the whole block, kept in shared memory: info = {seqlen_q, seqlen_k, q_start, k_start}. The tight
// kernels read these where they use them instead of holding them: one more register across a main loop at the
// 255-register cap costs tens of bytes of spills (bench/NOTES.md); the loops' barriers make the compiler re-read.
FA2_DEVICE void share_seq_bounds(int* info, const int* cu_seqlens_q, const int* cu_seqlens_k, int batch, int total_q,
                                 int total_k, int* error_claim, long long* error_host, int max_seqlen_q,
                                 int max_seqlen_k) {
    if (threadIdx.x == 0) {
        int sq = max_seqlen_q, sk = max_seqlen_k;
        const SeqBounds seq(cu_seqlens_q, cu_seqlens_k, batch, total_q, total_k, error_claim, error_host, sq, sk);
        info[0] = sq, info[1] = sk, info[2] = seq.q_start, info[3] = seq.k_start;
    }
    __syncthreads();
}

// flash-attn's score modifiers, applied to the scaled score before the mask: the softcap softcap * tanh(x / softcap)
// and the ALiBi bias -slope * |row + seqlen_k - seqlen_q - col|. Kernels with modifiers turn each raw score q.k into
// its final logit with logit() and then run the softmax with scale 1 (the modifiers do not commute with the
// scale, so it cannot stay folded into the exponent). softcap == 0 and slope == 0 switch each part off; the
// branch is uniform over the launch.
struct ScoreMods {
    float scale;        // softmax scale
    float cap;          // softcap, 0 for none
    float cap_inv;      // scale / softcap: tanh's argument from the raw score in one multiply
    float slope;        // ALiBi slope of this (batch, head), 0 for none
    int diag;           // seqlen_k - seqlen_q

    // The final logit of raw score s at (row, col); dcap receives d(logit) / d(scale * s) from the softcap,
    // 1 - tanh^2 (1 without a softcap): the backward's dS picks it up.
    FA2_DEVICE float logit(float s, int row, int col, float& dcap) const {
        float x;
        if (cap > 0.f) {
            const float t = tanhf(s * cap_inv);
            dcap = 1.f - t * t;
            x = cap * t;
        } else {
            dcap = 1.f;
            x = s * scale;
        }
        return x - slope * fabsf((float)(row + diag - col));
    }

    // s: one warp's raw scores in C-fragment layout with rows from row0 and columns from col0 -> final logits.
    template <int MTiles, int NTiles>
    FA2_DEVICE void apply(float (&s)[MTiles][NTiles][4], int row0, int col0, int lane) const {
#pragma unroll
        for (int mt = 0; mt < MTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < NTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float unused;
                    s[mt][nt][e] = logit(s[mt][nt][e], row0 + mt * 16 + (lane >> 2) + (e >> 1) * 8,
                                         col0 + nt * 8 + (lane & 3) * 2 + (e & 1), unused);
                }
    }
};

// The ALiBi slope of (batch, head): slopes (nheads,) have batch_stride 0; no slopes (nullptr) mean slope 0.
FA2_DEVICE float alibi_slope(const float* slopes, int batch_stride, int batch, int head) {
    return slopes != nullptr ? slopes[batch * batch_stride + head] : 0.f;
}

FA2_DEVICE ScoreMods make_score_mods(float scale, float softcap, float slope, int seqlen_q, int seqlen_k) {
    return ScoreMods{scale, softcap, softcap > 0.f ? scale / softcap : 0.f, slope, seqlen_k - seqlen_q};
}

}  // namespace fa2
