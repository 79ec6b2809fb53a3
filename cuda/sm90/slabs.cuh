// The 128-byte-swizzled slabs wgmma and TMA read and write (sm_90): layout, stmatrix stores of accumulators and the
// producer's cp.async fills.
#pragma once
#include "common/types.cuh"
#include "common/hints.cuh"
#include "sm80/memory.cuh"
#include "sm90/mbarrier.cuh"

namespace fa2 {

// A tile of Rows x Cols 16-bit elements as the 128-byte-swizzle slabs wgmma reads (Cols a multiple of 64):
// slab s holds columns 64s..64s+63 of every row, row r at r * 128 bytes, its chunk c (8 columns) at c ^ (r % 8).
template <int Rows, int Cols>
struct SwizzledSlabs {
    static_assert(Cols % 64 == 0 && Rows % 8 == 0, "whole 64-column slabs of 8-row atoms");
    static constexpr int kSlabs = Cols / 64, kRowBytes = 128, kSlabBytes = Rows * kRowBytes,
                         kBytes = kSlabs * kSlabBytes;
    static FA2_DEVICE u32 at(u32 base, int r, int c) {
        return base + (c >> 6) * kSlabBytes + r * kRowBytes + ((((c >> 3) & 7) ^ (r & 7)) << 4);
    }
};

// The converse (sm_90): register i of each lane holds two b16 of matrix i in the mma C-fragment layout (row
// lane / 4, columns 2 (lane % 4) and the next), and lanes 8i..8i+7 give the addresses of matrix i's rows.
FA2_DEVICE void stmatrix_x4(u32 addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

// Zeroes `bytes` (a multiple of 16) of shared memory from `from`, every thread of the block a share, fenced for the
// async proxy (TMA copies, wgmma) that writes and reads it next; the caller synchronises the block after. For the
// tiles of a call whose arrays are narrower than the kernel: no copy writes the columns past them (SlabLoader).
FA2_DEVICE void zero_shared(u32 from, int bytes) {
    for (int at = 16 * threadIdx.x; at < bytes; at += 16 * blockDim.x)
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(from + at), "r"(0) : "memory");
    fence_proxy_async_smem();
}

// A producer warpgroup's share of copying tiles of Cols-wide rows into SwizzledSlabs (cp.async): thread `ptid` of
// Threads copies one 16-byte column chunk of every kRowStep-th row, a multiple of 8 rows apart, so its swizzled
// position within a row is the same for all of them and its addresses advance by constants. Rows wider than 128
// columns (192, 256: Threads / (Cols / 8) would not be a multiple of 8) go one slab's width at a time: the thread's
// chunk of each of the kPasses slabs, kSlabBytes apart.
template <int Threads, int Cols>
struct SlabLoader {
    static constexpr int kPassCols = Cols <= 128 ? Cols : 64, kPasses = Cols / kPassCols;
    static constexpr int kChunksPerRow = kPassCols / 8, kRowStep = Threads / kChunksPerRow;
    static_assert(kRowStep % 8 == 0, "a thread's rows share one swizzle phase");
    int first_row, column;
    // `cols`: the arrays' own head dim (a multiple of 8), where a kernel wider than it runs on them. Only the last
    // pass can reach past it, as a narrower head dim runs at the next kernel width up, 64 columns on. With one
    // pass, a thread whose chunk lies past it copies nothing (its first row is past every tile's: the kernel has
    // zeroed those columns of its tiles, and TMA copies write zeros there); with more, it fills its last pass's
    // chunks with zeros. (Compared at each copy, `cols` spilled the varlen backward's producers.)
    FA2_DEVICE SlabLoader(int ptid, int cols)
        : first_row(ptid / kChunksPerRow + (kPasses == 1 && ptid % kChunksPerRow * 8 >= cols ? kNoRows : 0)),
          column(ptid % kChunksPerRow * 8) {}
    static constexpr int kNoRows = 1 << 16;
    // Tile's rows of `src` (row_stride elements apart) into the tile at `dst`, zeros from row `valid` on. A loader
    // of more than one pass also fills narrower tiles (v's, where its head dim is narrower than q's: a pass a slab).
    template <class Tile>
    FA2_DEVICE void load(u32 dst, const u16* src, int row_stride, int valid, int cols) const {
        constexpr int kRows = Tile::kSlabBytes / Tile::kRowBytes, kTilePasses = kPasses == 1 ? 1 : Tile::kSlabs;
        static_assert(kPasses == 1 ? Tile::kSlabs * 64 == Cols : Tile::kSlabs <= kPasses, "the loader's columns");
        u32 to = Tile::at(dst, first_row, column);
        const u16* from = src + (i64)first_row * row_stride + column;
        const i64 step = (i64)kRowStep * row_stride;
        const bool last_pass = kTilePasses == 1 || column + (kTilePasses - 1) * 64 < cols;
#pragma unroll 4  // (4 copies in flight per thread)
        for (int row = first_row; row < kRows; row += kRowStep, to += kRowStep * Tile::kRowBytes, from += step)
#pragma unroll
            for (int pass = 0; pass < kTilePasses; ++pass) {
                const bool copy = row < valid && (pass < kTilePasses - 1 || last_pass);
                cp_async_16(to + pass * Tile::kSlabBytes, copy ? from + pass * 64 : src, copy);
            }
    }
    // Paged K/V: a tile's rows gathered from pages. Lane j of producer warp w holds the address of row 32 w + j
    // (null: zero-filled), and the warp copies its 32 rows 4 at a time, 8 lanes a row, each row's address handed
    // round by a shuffle: so every copy instruction reads 128 contiguous bytes of each of 4 rows (whole lines, as
    // the packed loader's 256 of 2). Copies of fewer bytes from more rows cost the LSU a pass per line: 32 bytes of
    // 16 rows an instruction held paged calls at ~0.85x packed speed, one row per copy with its page worked out
    // each time (~40 instructions a copy) at ~0.6x.
    // Tiles of 64 rows (the wide head dims' key tiles) go 16 rows a warp: lane j of warp w holds the address of row
    // 16 w + j % 16 (the upper 16 lanes the same rows again), and the warp copies them 4 at a time as above.
    template <class Tile>
    FA2_DEVICE void load_paged_rows(u32 dst, const u16* row, const u16* any, int warp, int lane) const {
        static_assert(Tile::kSlabs * 64 == Cols, "paged tiles at the loader's width");
        constexpr int kRows = Tile::kBytes / (Cols * 2), kWarpRows = kRows / (Threads / 32);
        static_assert((kWarpRows == 32 || kWarpRows == 16) && kWarpRows * Threads == 32 * kRows, "a warp's rows");
        const int chunk = lane % 8;
#pragma unroll
        for (int g = 0; g < kWarpRows / 4; ++g) {
            const u16* src = reinterpret_cast<const u16*>(
                __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row), 4 * g + lane / 8));
            const bool ok = src != nullptr;
            src = opaque((ok ? src : any) + 8 * chunk);  // (each copy's source: this register plus a constant)
#pragma unroll
            for (int s = 0; s < Cols / 64; ++s)
                cp_async_16(Tile::at(dst, kWarpRows * warp + 4 * g + lane / 8, 64 * s + 8 * chunk), src + 64 * s, ok);
        }
    }
};

}  // namespace fa2
