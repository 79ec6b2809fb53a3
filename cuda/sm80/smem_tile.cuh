// Shared-memory tiles of the mma.sync kernels: layout (padded or swizzled rows), cp.async fills, fragment loads and
// the warp epilogue that writes accumulators out.
#pragma once
#include "common/types.cuh"
#include "sm80/memory.cuh"
#include "sm80/mma.cuh"

namespace fa2 {

// ---- shared-memory tiles ----------------------------------------------------------------------------------
// A tile of Rows x Cols 16-bit elements, row-major, each row padded by 16 bytes. With a row pitch that is an
// odd number of 16-byte chunks the 8 row addresses of one ldmatrix land in 8 different bank groups, so the
// tile is conflict-free for ldmatrix (plain and .trans) and for cp.async fills at any head dim, without the
// head-dim-specific XOR swizzles (a swizzle needs >= 8 chunks per row; head dim 32 has 4).
// Swizzle (Cols a multiple of 64): unpadded rows, 16-byte chunk c of row r stored at chunk c ^ (r % 8), just as
// conflict-free for ldmatrix; a warp's cp.async fill of two 256-byte rows is then one contiguous 512-byte span,
// which the padded pitch splits: streaming K/V from HBM into padded rows ran 4% slower (docs/design.md).
template <int Rows, int Cols, bool Swizzle = false>
struct SmemTile {
    static_assert(Cols % 16 == 0, "tile columns must be a multiple of 16 elements");
    static_assert(!Swizzle || Cols % 64 == 0, "the XOR swizzle needs a multiple of 8 chunks per row");
    static constexpr int kPitch = Swizzle ? Cols : Cols + 8;  // elements
    static constexpr int kBytes = Rows * kPitch * 2;
    static FA2_DEVICE u32 at(u32 base, int row, int col) {
        if constexpr (Swizzle) return base + (row * kPitch + (((col >> 3) ^ (row & 7)) << 3) + (col & 7)) * 2;
        return base + (row * kPitch + col) * 2;
    }

    // Global -> shared for the whole tile by `Threads` threads, 16 bytes each. Rows >= rows_valid and
    // columns >= cols_valid (a multiple of 8) are zero-filled rather than read.
    template <int Threads>
    static FA2_DEVICE void load_async(u32 base, const u16* gmem, int row_stride, int rows_valid, int cols_valid,
                                      int tid) {
        constexpr int kChunksPerRow = Cols / 8;
        constexpr int kChunks = Rows * kChunksPerRow;
        if constexpr (Threads % kChunksPerRow == 0) {
            // Each thread keeps one column and walks down rows: one pointer and a fixed step instead of a
            // precomputed 64-bit offset per chunk (those cost 2 registers each and spilled at head dim 128).
            constexpr int kRowStep = Threads / kChunksPerRow;
            const int r0 = tid / kChunksPerRow, c = (tid % kChunksPerRow) * 8;
            const u16* src = gmem + r0 * row_stride + c;
            const int step = kRowStep * row_stride;  // the host keeps row strides below 2^24
            const bool col_ok = c < cols_valid;
#pragma unroll
            for (int i = 0; i < (Rows + kRowStep - 1) / kRowStep; ++i) {
                const int r = r0 + i * kRowStep;
                if (Rows % kRowStep == 0 || r < Rows) {
                    const bool ok = col_ok && r < rows_valid;
                    cp_async_16(at(base, r, c), ok ? src : gmem, ok);
                }
                src += step;
            }
        } else {
#pragma unroll
            for (int i = 0; i < (kChunks + Threads - 1) / Threads; ++i) {
                const int idx = tid + i * Threads;
                if (kChunks % Threads == 0 || idx < kChunks) {
                    const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
                    const bool ok = r < rows_valid && c < cols_valid;
                    cp_async_16(at(base, r, c), ok ? gmem + r * row_stride + c : gmem, ok);
                }
            }
        }
    }

    // K and V tiles together from gathered rows (paged K/V): locate(r, page, slot) finds tile row r (its page and
    // its slot in the page) and returns true, or returns false for a row to zero-fill; rows_at(page, slot, k_row,
    // v_row) points k_row/v_row at that row's first elements. One look-up serves both tiles (their rows come from
    // the same page). Columns >= cols_valid are zero-filled as in load_async. Zero-filled chunks name k_any/v_any
    // (any valid address) as their source, which is not read.
    // Where each copy instruction takes whole rows (32 / (Cols / 8) of them) and a warp's copies cover at most 32
    // rows, each lane looks one of the warp's rows up, all at once, and the copies take the rows' pages by
    // shuffles: one look-up round trip per tile instead of one per copy (those held paged calls at ~0.76x packed
    // speed). Other widths, or ByLanes false, look each chunk's row up in turn.
    template <int Threads, bool ByLanes, class Locate, class RowsAt>
    static FA2_DEVICE void load_async_pair_rows(u32 base_k, u32 base_v, const u16* k_any, const u16* v_any,
                                                int cols_valid, int tid, Locate locate, RowsAt rows_at) {
        constexpr int kChunksPerRow = Cols / 8;
        constexpr int kChunks = Rows * kChunksPerRow;
        if constexpr (ByLanes && 32 % kChunksPerRow == 0 && kChunks % Threads == 0 && Rows <= Threads) {
            constexpr int kRowsPerCopy = 32 / kChunksPerRow, kCopies = kChunks / Threads;
            static_assert(kCopies * kRowsPerCopy <= 32, "a warp's rows, one per lane");
            const int lane = tid & 31, warp_first = tid - lane, c = lane % kChunksPerRow * 8;
            // Row of this warp's copy i, sub-row s: (warp_first + i * Threads) / kChunksPerRow + s.
            int my_page = -1, my_slot = 0;
            if (lane < kCopies * kRowsPerCopy &&
                !locate((warp_first + lane / kRowsPerCopy * Threads) / kChunksPerRow + lane % kRowsPerCopy,
                        my_page, my_slot))
                my_page = -1;
#pragma unroll 1
            for (int i = 0; i < kCopies; ++i) {
                const int from = i * kRowsPerCopy + lane / kChunksPerRow;
                const int page = __shfl_sync(0xffffffffu, my_page, from);
                const int slot = __shfl_sync(0xffffffffu, my_slot, from);
                const int r = (warp_first + i * Threads) / kChunksPerRow + lane / kChunksPerRow;
                const bool ok = page >= 0 && c < cols_valid;
                const u16 *k_row = k_any, *v_row = v_any;
                if (ok) rows_at(page, slot, k_row, v_row);
                cp_async_16(at(base_k, r, c), ok ? k_row + c : k_any, ok);
                cp_async_16(at(base_v, r, c), ok ? v_row + c : v_any, ok);
            }
        } else {
            // Not unrolled: unrolled, every chunk's look-up and two 64-bit addresses are live at once, and kernels
            // at the register cap spill (92 bytes at d=64 128x128).
#pragma unroll 1
            for (int i = 0; i < (kChunks + Threads - 1) / Threads; ++i) {
                const int idx = tid + i * Threads;
                if (kChunks % Threads == 0 || idx < kChunks) {
                    const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
                    const u16 *k_row = k_any, *v_row = v_any;
                    // (look-up and addresses in one step: with the addresses set after the test of ok, the d=64
                    // 128 x 128 row spilled 72 bytes)
                    const bool ok = [&] {
                        int page, slot;
                        if (!locate(r, page, slot)) return false;
                        rows_at(page, slot, k_row, v_row);
                        return true;
                    }() && c < cols_valid;
                    cp_async_16(at(base_k, r, c), ok ? k_row + c : k_any, ok);
                    cp_async_16(at(base_v, r, c), ok ? v_row + c : v_any, ok);
                }
            }
        }
    }

    // Epilogue of a warp that owns rows [row0, row0 + MTiles*16) of the tile: its fp32 C fragments (times `scale`)
    // are packed into those rows of shared memory, then written to global memory 16 bytes per lane, row by row.
    // Rows at or past `rows_valid` and columns at or past `cols_valid` are not written. Only this warp may use
    // those shared-memory rows meanwhile.
    template <class E, int MTiles, int DTiles>
    static FA2_DEVICE void store_warp_rows(u32 base, const float (&acc)[MTiles][DTiles][4], float scale, int row0,
                                           u16* gmem, int row_stride, int rows_valid, int cols_valid, int lane) {
        static_assert(DTiles * 8 == Cols, "the fragments span the tile's columns");
        __syncwarp();
#pragma unroll
        for (int mt = 0; mt < MTiles; ++mt)
#pragma unroll
            for (int dt = 0; dt < DTiles; ++dt)
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    st_shared_u32(at(base, row0 + mt * 16 + (lane >> 2) + half * 8, dt * 8 + (lane & 3) * 2),
                                  Mma<E>::pack(acc[mt][dt][2 * half] * scale, acc[mt][dt][2 * half + 1] * scale));
        __syncwarp();
        constexpr int kWarpChunks = MTiles * 16 * DTiles;
#pragma unroll
        for (int i = 0; i < (kWarpChunks + 31) / 32; ++i) {
            const int idx = lane + i * 32;
            const int r = idx / DTiles, c = (idx % DTiles) * 8;
            if ((kWarpChunks % 32 == 0 || idx < kWarpChunks) && r < rows_valid && c < cols_valid) {
                u32 chunk[4];
                ld_shared_v4(at(base, row0 + r, c), chunk);
                st_global_v4(gmem + (i64)r * row_stride + c, chunk);
            }
        }
    }

    // A operand (16 rows x 16 k) at (row0, k0) for mma.m16n8k16 — matches the A fragment order.
    static FA2_DEVICE void load_a(u32 (&a)[4], u32 base, int row0, int k0, int lane) {
        ldmatrix_x4(a, at(base, row0 + (lane & 7) + ((lane >> 3) & 1) * 8, k0 + (lane >> 4) * 8));
    }
    // A operand (16 rows x 16 k) at (m0, k0) from a tile stored transposed, [k][m] (dS^T in the backward).
    static FA2_DEVICE void load_a_trans(u32 (&a)[4], u32 base, int m0, int k0, int lane) {
        ldmatrix_x4_trans(a, at(base, k0 + (lane & 7) + (lane >> 4) * 8, m0 + ((lane >> 3) & 1) * 8));
    }
    // B operands for two n8 tiles from a tile stored [n][k] (K in S = Q K^T): b[0..1] n-tile n0, b[2..3] n0+8.
    static FA2_DEVICE void load_b_nk(u32 (&b)[4], u32 base, int n0, int k0, int lane) {
        ldmatrix_x4(b, at(base, n0 + (lane & 7) + (lane >> 4) * 8, k0 + ((lane >> 3) & 1) * 8));
    }
    // B operands for two n8 tiles from a tile stored [k][n] (V in O = P V), transposed by ldmatrix.
    static FA2_DEVICE void load_b_kn(u32 (&b)[4], u32 base, int k0, int n0, int lane) {
        ldmatrix_x4_trans(b, at(base, k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8));
    }
};

}  // namespace fa2
