// Masks and score modifiers as small policies the kernels are templated on. A policy answers two questions: which key tiles a
// query tile can see at all (so invisible tiles are skipped, not computed and masked), and which scores inside
// a partially visible tile become -inf.
#pragma once
#include "common/types.cuh"
#include "common/fast_div.cuh"
#include "common/math.cuh"
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
    // is visible); tiles wholly outside every row's window are skipped. (The tile width as a template argument in
    // the kernels; at run time in bwd_convert_dq, which counts the Hopper dK/dV kernel's tiles.)
    template <int BlockN>
    FA2_DEVICE void key_tiles(int row0, int rows, int& first, int& count) const {
        key_tiles(row0, rows, BlockN, first, count);
    }
    FA2_DEVICE void key_tiles(int row0, int rows, int block_n, int& first, int& count) const {
        const int end = key_end(row0, rows);
        first = key_begin(row0) / block_n;
        const int last = end > 0 ? (end + block_n - 1) / block_n : 0;
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

// Dropout on P (FA2 with dropout): Philox4x32-7 (Salmon et al. 2011; seven rounds pass BigCrush, and
// FlashAttention-2 draws its mask with seven too), counter-based, so the forward and both backward kernels
// regenerate the same keep mask from (seed, offset) whatever their tiling. Score (i, j) of sequence entry
// bh = batch * nheads + head has the random 8-bit number
//     byte (j >> 3) & 3 of word (i >> 3) & 3 of philox(key = (seed_lo, seed_hi ^ offset_hi),
//         counter = (bh, (i >> 5) << 3 | (i & 7), offset_lo, (j >> 5) << 3 | (j & 7)))
// so one call covers the queries {x, x + 8, x + 16, x + 24} x the keys {y, y + 8, y + 16, y + 24} of a 32 x 32
// block that share their residues mod 8. A thread holds such a grid whole in the forward's C fragments (rows
// g + 8 r, columns 2 t + e + 8 c, with g = lane / 4, t = lane % 4) and in the backward's transposed ones (keys as
// rows) alike, wherever its fragment spans 32 rows and 32 columns: no number is drawn to be thrown away (a 16-row
// or 16-column span uses half a call). A score is kept iff its number is below `threshold` = round((1 - p) * 256),
// 1..255: the keep probability is threshold / 256 exactly, and the kept scores are scaled by its inverse,
// 256 / threshold, so the output stays an unbiased estimate (p is realised in steps of 1/256:
// fa2cupy.forward.dropout_threshold). The query and key enter the counter in the words that Philox's first round
// only XORs in (bh and offset, the same for a whole block, take its multiplies), so a kernel that holds one of them
// fixed along its loop computes the first rounds' share of it once (Dropout::Fixed).
template <int Rounds>
FA2_DEVICE void philox_4x32(u32 (&c)[4], u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < Rounds; ++round) {
        const u32 hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        const u32 hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        const u32 n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0, c[1] = lo1, c[2] = n2, c[3] = lo0;
        k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    }
}

struct Dropout {
    u32 threshold;            // keep iff the 8-bit number < threshold (1..255); 0 switches dropout off (keep all)
    u32 key0, key1, offset;   // Philox key (the seed, offset's high word folded in) and the counter's offset word
    u32 bh;                   // batch * nheads + head
    float scale;              // 256 / threshold, applied to the kept P

    static constexpr u32 kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // Philox4x32's multipliers
    FA2_DEVICE bool on() const { return threshold != 0; }
    // Round r's key words.
    FA2_DEVICE u32 ka(int r) const { return key0 + (u32)r * 0x9E3779B9u; }
    FA2_DEVICE u32 kb(int r) const { return key1 + (u32)r * 0xBB67AE85u; }
    // A query's or key's counter word: its 32-block and residue mod 8; of x = base + r, base a multiple of 32 and
    // r < 8, in one instruction.
    static FA2_DEVICE u32 group(int x) { return (u32)(x >> 5 << 3 | (x & 7)); }
    static FA2_DEVICE u32 group(int base, int r) { return (u32)base >> 2 | (u32)r; }
    // The four Philox words of the call that covers score (i, j): the definition above, one call per score.
    FA2_DEVICE void words(u32 (&w)[4], int i, int j) const {
        w[0] = bh, w[1] = group(i), w[2] = offset, w[3] = group(j);
        philox_4x32<7>(w, key0, key1);
    }

    // The same words in two parts, for kernels that draw along a loop over keys with their queries fixed (the
    // forward, the dQ kernel) or over queries with their keys fixed (the dK/dV kernel). Written out, round r of the
    // call maps (c0, c1, c2, c3) to (hi(M1 c2) ^ c1 ^ ka(r), lo(M1 c2), hi(M0 c0) ^ c3 ^ kb(r), lo(M0 c0)), so
    // with counter (bh, q, offset, k) a word that depends on only one of q and k stays so until round 3: those parts
    // (three words, key words folded in) are made once per query (fix_query) or key (fix_key), and a call from them
    // costs 22 instructions (10 wide multiplies, 12 XORs) instead of 28 and its set-up. Queries and keys come as
    // their counter words (group()).
    struct Fixed { u32 v0, v1, v2; };
    FA2_DEVICE Fixed fix_query(u32 qg) const {
        const u32 x0 = __umulhi(kM1, offset) ^ qg ^ ka(0);                     // round 0, word 0
        const u32 g0 = __umulhi(kM0, x0), e0 = kM0 * x0;                       // round 1: y3 = e0
        const u32 y2 = g0 ^ kM0 * bh ^ kb(1);
        const u32 f1 = __umulhi(kM1, y2), d1 = kM1 * y2;                       // round 2: z1 = d1
        return {f1 ^ ka(2), d1 ^ ka(3), e0 ^ kb(2)};
    }
    FA2_DEVICE void words_fixed_query(u32 (&w)[4], const Fixed& q, u32 kg) const {
        const u32 x2 = __umulhi(kM0, bh) ^ kg ^ kb(0);                         // round 0, word 2
        const u32 g1 = __umulhi(kM1, x2), e1 = kM1 * x2;                       // round 1: y1 = e1
        const u32 y0 = g1 ^ kM1 * offset ^ ka(1);
        const u32 f0 = __umulhi(kM0, y0), d0 = kM0 * y0;                       // round 2: z3 = d0
        finish(w, q.v0 ^ e1, q.v1, f0 ^ q.v2, d0 ^ kb(3));
    }
    FA2_DEVICE Fixed fix_key(u32 kg) const {
        const u32 x2 = __umulhi(kM0, bh) ^ kg ^ kb(0);
        const u32 g1 = __umulhi(kM1, x2), e1 = kM1 * x2;
        const u32 y0 = g1 ^ kM1 * offset ^ ka(1);
        const u32 f0 = __umulhi(kM0, y0), d0 = kM0 * y0;
        return {e1 ^ ka(2), d0 ^ kb(3), f0 ^ kb(2)};
    }
    FA2_DEVICE void words_fixed_key(u32 (&w)[4], const Fixed& k, u32 qg) const {
        const u32 x0 = __umulhi(kM1, offset) ^ qg ^ ka(0);
        const u32 g0 = __umulhi(kM0, x0), e0 = kM0 * x0;
        const u32 y2 = g0 ^ kM0 * bh ^ kb(1);
        const u32 f1 = __umulhi(kM1, y2), d1 = kM1 * y2;
        finish(w, f1 ^ k.v0, d1 ^ ka(3), k.v2 ^ e0, k.v1);
    }
    // Rounds 3-6 from round 2's words z0 and z2 and the key-folded (z1 ^ ka(3)) and (z3 ^ kb(3)).
    FA2_DEVICE void finish(u32 (&w)[4], u32 z0, u32 z1a, u32 z2, u32 z3b) const {
        w[0] = __umulhi(kM1, z2) ^ z1a, w[1] = kM1 * z2, w[2] = __umulhi(kM0, z0) ^ z3b, w[3] = kM0 * z0;
#pragma unroll
        for (int round = 4; round < 7; ++round) {
            const u32 hi0 = __umulhi(kM0, w[0]), lo0 = kM0 * w[0];
            const u32 hi1 = __umulhi(kM1, w[2]), lo1 = kM1 * w[2];
            w[0] = hi1 ^ w[1] ^ ka(round), w[1] = lo1, w[2] = hi0 ^ w[3] ^ kb(round), w[3] = lo0;
        }
    }

    // Bit 7 of each byte of the result is set iff that byte of w, as a number, is >= threshold: its score is
    // dropped. Four compares in three instructions: (w | 0x80) - (threshold & 0x7F) never borrows across bytes
    // and leaves bit 7 set iff the low seven bits compare >=; where the top bits differ, w's top bit decides
    // (w & u where the threshold's top bit is set, w | u where it is clear: one three-input LOP3).
    FA2_DEVICE u32 drop_flags(u32 w) const {
        const u32 spread = threshold * 0x01010101u, u = (w | 0x80808080u) - (spread & 0x7F7F7F7Fu);
        return (w & u) | ((w | u) & ~spread);
    }
    // All ones where the score whose flag is bit 7 of byte `byte` of `flags` is dropped, else 0.
    static FA2_DEVICE u32 drop_mask(u32 flags, u32 byte) { return prmt_b32(flags, 0u, (8u | byte) * 0x1111u); }
    // The same for a packed pair: 0xFFFF in its low half where the score of bit 7 of byte `byte` of lo_flags is
    // dropped, in its high half where that of byte `byte` of hi_flags is.
    static FA2_DEVICE u32 pair_drop_mask(u32 lo_flags, u32 hi_flags, u32 byte) {
        return prmt_b32(lo_flags, hi_flags, (8u | byte) * 0x0011u | (12u | byte) * 0x1100u);
    }
    // Score (i, j) on its own (the mask-reporting kernel; the attention kernels share calls as described above).
    FA2_DEVICE bool keep_one(int i, int j) const {
        u32 w[4];
        words(w, i, j);
        return !on() || (w[(i >> 3) & 3] >> ((j >> 3) & 3) * 8 & 0xFFu) < threshold;
    }

    // The queries of a thread's C-fragment rows (rows = queries row0 + g + 8 r over MTiles m16 tiles, row0 a multiple
    // of 16, of 32 when MTiles is even): fixed once, before the loop over keys. A 16-row tile on its own (MTiles
    // odd) covers half of each call's rows.
    template <int MTiles>
    struct Rows { Fixed part[(MTiles + 1) / 2]; };
    template <int MTiles>
    FA2_DEVICE Rows<MTiles> fix_rows(int row0, int lane) const {
        Rows<MTiles> rows;
#pragma unroll
        for (int p = 0; p < (MTiles + 1) / 2; ++p)
            rows.part[p] = fix_query(group(row0 + (MTiles % 2 ? 16 : 32) * p + (lane >> 2)));
        return rows;
    }
    // Their drop flags for keys key0 + 2 (lane & 3) + e + 8 c (key0 a multiple of 32; bytes c = 0..3):
    // flags[mt][h][e] for row row0 + 16 mt + 8 h + g.
    template <int MTiles>
    FA2_DEVICE void row_flags(u32 (&flags)[MTiles][2][2], const Rows<MTiles>& rows, int row0, int key0,
                              int lane) const {
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int p = 0; p < (MTiles + 1) / 2; ++p) {
                u32 w[4];
                words_fixed_query(w, rows.part[p], group(key0, (lane & 3) * 2 + e));
                if constexpr (MTiles % 2 == 0) {  // row tiles 2 p, 2 p + 1: one call's four rows
#pragma unroll
                    for (int r = 0; r < 4; ++r) flags[2 * p + r / 2][r % 2][e] = drop_flags(w[r]);
                } else {  // row tile p: rows 8 h of the call's first or second 16
                    const bool upper = (row0 + 16 * p) & 16;
#pragma unroll
                    for (int h = 0; h < 2; ++h) flags[p][h][e] = drop_flags(upper ? w[2 + h] : w[h]);
                }
            }
    }
    // a: one warp's P as the A fragments of O += P V (c_to_a), a[mt] = keys 16 kk .. 16 kk + 15 of a 32-key block
    // (kk 0 or 1) for row tile mt; flags: row_flags() of that block. Dropped entries become 0 (256 / threshold is
    // applied to the output once).
    template <int MTiles>
    static FA2_DEVICE void apply_a(u32 (&a)[MTiles][4], const u32 (&flags)[MTiles][2][2], int kk) {
#pragma unroll
        for (int mt = 0; mt < MTiles; ++mt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // a[mt][i]: row half i & 1, n8 tile 2 kk + (i >> 1), keys e = 0, 1
                const int h = i & 1;
                a[mt][i] &= ~pair_drop_mask(flags[mt][h][0], flags[mt][h][1], 2 * kk + (i >> 1));
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
// The same from the call's 64-bit seed and offset, or rng_state's where given (read where the dropout is made: the
// Hopper kernels make it per tile or step, so that no register holds it across their loops).
FA2_DEVICE Dropout make_dropout(u32 threshold, u64 seed, u64 offset, const u32* rng_state, int batch, int nheads,
                                int head, float scale) {
    u32 seed_lo = (u32)seed, seed_hi = (u32)(seed >> 32), offset_lo = (u32)offset, offset_hi = (u32)(offset >> 32);
    load_rng_state(rng_state, seed_lo, seed_hi, offset_lo, offset_hi);
    return make_dropout(threshold, seed_lo, seed_hi, offset_lo, offset_hi, batch, nheads, head, scale);
}

// SeqBounds for the whole block, kept in shared memory: info = {seqlen_q, seqlen_k, q_start, k_start}. The tight
// kernels read these where they use them instead of holding them: one more register across a main loop at the
// 255-register cap costs tens of bytes of spills (ptxas); the loops' barriers make the compiler re-read.
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

    // Whether the scores change at all (softcap or ALiBi): the kernels skip the modifiers, and keep the softmax
    // scale folded into the exponent, where they do not.
    FA2_DEVICE bool on() const { return cap > 0.f || slope != 0.f; }

    // The final logit of raw score s at (row, col); dcap receives d(logit) / d(scale * s) from the softcap,
    // 1 - tanh^2 (1 without a softcap): the backward's dS picks it up.
    FA2_DEVICE float logit(float s, int row, int col, float& dcap) const {
        return cap > 0.f ? logit_of<true>(s, row, col, dcap) : logit_of<false>(s, row, col, dcap);
    }
    // logit() with the softcap's switch (Capped: cap > 0) taken outside, for loops that switch once: where logit()'s
    // branch is if-converted, both sides are computed for every score (the decode kernel's rows at d >= 192 then
    // spilled 30-98 bytes).
    template <bool Capped>
    FA2_DEVICE float logit_of(float s, int row, int col, float& dcap) const {
        float x;
        if constexpr (Capped) {
            const float t = fast_tanh(s * cap_inv);
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

// The score modifiers in the units the softmax then scales (the Hopper forward): per score a value v whose logit is
// unit * v, so that the softmax takes scale unit * log2(e) and the lse unit (OnlineSoftmax::finalize).
//   softcap:      v = tanh(scale s / cap) - slope / cap * |d|   (unit cap)
//   ALiBi alone:  v = s - slope / scale * |d|                   (unit scale: no multiply per score)
//   ALiBi, scale 0: v = scale s - slope |d|                     (unit 1)
// No int-to-float conversion per score, and no multiply by the scale or the cap per score: beside a softcapped
// score's MUFU operations (then three: tanh as an exp2 and a reciprocal, the softmax's exp2) the forward was bound
// by its issue slots; the fewer FMA-pipe operations took softcap 238 -> 389 and ALiBi 400 -> 510 TFLOPs/s (d=128,
// causal, 8k, H200). Built per tile from the call's UnitModsConstants and the item's slope.
//
// ALiBi's distance d = row + diag - col is d_r - c along a thread's row r, with d_r that of the thread's first
// column and c = 8 nt + e a constant of the fragment. Where every score of the warp's tile lies on one side of the
// diagonal (sign sd of d: every tile of a causal call; all but those that cross it otherwise), slope |d| is
// sd slope d_r - sd slope c: v = fma(sd slope, c, v0) is one FMA with an immediate per score, and the row's part
// -sd slope d_r goes to the softmax as its bias (RowBias); on a tile that crosses the diagonal each score takes
// fma(-slope, |d_r - c|, v0), two.
struct UnitScoreMods {
    enum Kind : int { kCap, kCapAlibi, kAlibi, kAlibiUnscaled };
    Kind kind;
    float arg;    // softcap: scale / cap, tanh's argument per raw score; else the prescale
    float slope;  // ALiBi slope in units of `unit`
    float unit;
    int diag;     // seqlen_k - seqlen_q

    FA2_DEVICE float scale_log2() const { return unit * kLog2e; }
    // A softcapped value (kCap, kCapAlibi) before ALiBi: tanh(scale s / cap) of raw score s.
    FA2_DEVICE float capped(float s) const { return fast_tanh(s * arg); }

    // s: one warpgroup warp's raw scores in C-fragment layout (rows from row0, the warp's 16, and columns from
    // col0) -> values v, with bias[r] the part of row r's values left to the softmax (0 without ALiBi).
    // NonNegative: every visible score's d is >= 0 (causal), so |d| is d (the masked ones are -inf after).
    // OneSided: without NonNegative, whether tiles on one side of the diagonal take the one-FMA form (else every
    // tile takes |d|: fewer registers).
    // AlibiOnly: the kind is kAlibi (ALiBi alone at a positive scale), so the others' code is left out.
    template <bool NonNegative, bool OneSided = true, bool AlibiOnly = false, int NTiles>
    FA2_DEVICE void apply(float (&s)[1][NTiles][4], int row0, int col0, int lane, float (&bias)[2]) const {
        if constexpr (AlibiOnly) return apply_kind<kAlibi, NonNegative, OneSided>(s, row0, col0, lane, bias);
        switch (kind) {
            case kCap: return apply_kind<kCap, NonNegative, OneSided>(s, row0, col0, lane, bias);
            case kCapAlibi: return apply_kind<kCapAlibi, NonNegative, OneSided>(s, row0, col0, lane, bias);
            case kAlibi: return apply_kind<kAlibi, NonNegative, OneSided>(s, row0, col0, lane, bias);
            default: return apply_kind<kAlibiUnscaled, NonNegative, OneSided>(s, row0, col0, lane, bias);
        }
    }
    template <Kind K, bool NonNegative, bool OneSided, int NTiles>
    FA2_DEVICE void apply_kind(float (&s)[1][NTiles][4], int row0, int col0, int lane, float (&bias)[2]) const {
        constexpr bool kCapped = K == kCap || K == kCapAlibi;
        if constexpr (K != kAlibi) {
#pragma unroll
            for (int nt = 0; nt < NTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float& v = s[0][nt][e];
                    if constexpr (kCapped)
                        v = capped(v);
                    else
                        v *= arg;
                }
        }
        if constexpr (K == kCap) return;
        // d of this thread's first column of the tile, for its two rows
        const float d0 = static_cast<float>(row0 + (lane >> 2) + diag - col0 - (lane & 3) * 2);
        const float d_row[2] = {d0, d0 + 8.f};
        // the side of the diagonal of every score of the warp's tile: 1 (d >= 0), -1 (d <= 0), 0 both (warp-uniform)
        const int d_max = row0 + 15 + diag - col0, d_min = row0 + diag - col0 - (NTiles * 8 - 1);
        const int side = NonNegative ? 1 : !OneSided ? 0 : d_min >= 0 ? 1 : d_max <= 0 ? -1 : 0;
        if (side != 0) {
            const float side_slope = side > 0 ? slope : -slope;
            bias[0] = -side_slope * d_row[0];
            bias[1] = -side_slope * d_row[1];
#pragma unroll
            for (int nt = 0; nt < NTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[0][nt][e] = fmaf(side_slope, static_cast<float>(nt * 8 + (e & 1)), s[0][nt][e]);
        } else {
#pragma unroll
            for (int nt = 0; nt < NTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[0][nt][e] =
                        fmaf(-slope, fabsf(d_row[e >> 1] - static_cast<float>(nt * 8 + (e & 1))), s[0][nt][e]);
        }
    }
};

// A call's UnitScoreMods constants, worked out once on the host (fa2cupy/forward.py, unit_mods_constants): the
// unit and its reciprocal, which takes an ALiBi slope into the unit with one multiply (once per work item).
struct UnitModsConstants {
    float unit, unit_inv;
};

// make_unit_score_mods' softcap kinds (softcap > 0): kCapAlibi, or kCap where unit_slope is 0.
FA2_DEVICE UnitScoreMods capped_unit_score_mods(const UnitModsConstants& c, float scale, float softcap,
                                                float unit_slope, int diag) {
    return {unit_slope != 0.f ? UnitScoreMods::kCapAlibi : UnitScoreMods::kCap, fast_quotient(scale, softcap),
            unit_slope, c.unit, diag};
}

// unit_slope: the ALiBi slope times c.unit_inv. The softcap's argument is divided out per tile (fast_quotient: a
// MUFU reciprocal): taken from the host too, it measured 3-4.5% slower at d = 256 causal, the schedule ptxas gave
// the softcap's loop (docs/design.md).
FA2_DEVICE UnitScoreMods make_unit_score_mods(const UnitModsConstants& c, float scale, float softcap,
                                              float unit_slope, int seqlen_q, int seqlen_k) {
    const int diag = seqlen_k - seqlen_q;
    if (softcap > 0.f) return capped_unit_score_mods(c, scale, softcap, unit_slope, diag);
    if (scale > 0.f) return {UnitScoreMods::kAlibi, 1.f, unit_slope, c.unit, diag};
    return {UnitScoreMods::kAlibiUnscaled, scale, unit_slope, c.unit, diag};
}

// step(Bool<modify>{}, Bool<drop>{}): the modifier kernels' run-time switches (score modifiers on, dropout on),
// uniform over a launch, as compile-time ones, so that each case runs code with only its own work in it.
template <class Step>
FA2_DEVICE void with_modifiers(bool modify, bool drop, Step&& step) {
    if (drop) {
        if (modify) step(Bool<true>{}, Bool<true>{});
        else step(Bool<false>{}, Bool<true>{});
    } else {
        if (modify) step(Bool<true>{}, Bool<false>{});
        else step(Bool<false>{}, Bool<false>{});
    }
}

// The ALiBi slope of (batch, head): slopes (nheads,) have batch_stride 0; no slopes (nullptr) mean slope 0.
FA2_DEVICE float alibi_slope(const float* slopes, int batch_stride, int batch, int head) {
    return slopes != nullptr ? slopes[batch * batch_stride + head] : 0.f;
}

FA2_DEVICE ScoreMods make_score_mods(float scale, float softcap, float slope, int seqlen_q, int seqlen_k) {
    return ScoreMods{scale, softcap, softcap > 0.f ? scale / softcap : 0.f, slope, seqlen_k - seqlen_q};
}

}  // namespace fa2
