// The tensor memory accelerator (sm_90): tensor maps, bulk tensor copies between global and shared memory, bulk
// reductions, and the bulk groups that track them.
#pragma once
#include "common/types.cuh"
#include "sm80/memory.cuh"

namespace fa2 {

// Bulk reduction from shared to global memory (no tensor map): `bytes` (a multiple of 16, both addresses 16-byte
// aligned) of fp32 added element-wise at `dst`, asynchronously. The shared memory must be written and made visible
// to the async proxy (fence_proxy_async_smem, then a barrier) before; wait_read before it is rewritten.
FA2_DEVICE void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}
// Tensor maps (TMA, common/types.cuh: TensorMap): encoded on the host (fa2cupy/tensor_maps.py) into the kernel's
// __grid_constant__ parameter struct (common/params.cuh), which the copies name by its generic address. Four
// dimensions, innermost first: the head dim's columns, the head, the row, the batch row; boxes of 64 columns (128
// bytes, the 128-byte swizzle of SwizzledSlabs: a slab per box) and a tile's rows.
// One box of `map` at (column, head, row, batch) into shared memory at `dst` (1024-byte aligned for the swizzle),
// its bytes counted on mbarrier `bar` (rows outside the tensor read as zeros).
FA2_DEVICE void tma_load(u32 dst, const TensorMap& map, int column, int head, int row, int batch, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(&map)), "r"(column), "r"(head), "r"(row), "r"(batch), "r"(bar)
        : "memory");
}
// One box of shared memory at `src` out to `map` at (column, head, row, batch), in this thread's bulk group (rows
// outside the tensor are not written). src written by ordinary stores: fence_proxy_async_smem and a barrier first.
FA2_DEVICE void tma_store(const TensorMap& map, int column, int head, int row, int batch, u32 src) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                     reinterpret_cast<u64>(&map)),
                 "r"(column), "r"(head), "r"(row), "r"(batch), "r"(src)
                 : "memory");
}

// The fp32 box of shared memory at `src` added element-wise to `map` (a 2-dimensional fp32 map: columns, rows) at
// (column, row), in this thread's bulk group: elements outside the map are not written, so a box wider than the
// map's columns adds only those (the Hopper backward's dQ rows, staged wider than the call's head dim). src written
// by ordinary stores: fence_proxy_async_smem and a barrier first; wait_read before it is rewritten.
FA2_DEVICE void tma_reduce_add_2d(const TensorMap& map, int column, int row, u32 src) {
    asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                     reinterpret_cast<u64>(&map)),
                 "r"(column), "r"(row), "r"(src)
                 : "memory");
}

FA2_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
FA2_DEVICE void bulk_wait_read() {  // this thread's bulk groups but the last N have read their shared memory
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
FA2_DEVICE void bulk_wait() {  // ... and completed
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Turns between blocks over a global int (the deterministic dQ reductions): wait until it reads `turn` (acquire),
// and pass the turn on (release). Bulk operations are in the async proxy: a fence orders them after the wait, and
// before the release once their bulk group has completed (bulk_wait).
FA2_DEVICE void wait_for_turn(const int* flag, int turn) {
    wait_for_count(flag, turn);
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
FA2_DEVICE void pass_turn(int* flag) {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(flag) : "memory");
}

// A tile of SwizzledSlabs from `map`'s rows `row` .. (its box's rows) of (head, batch): one TMA box per slab, its
// bytes counted on `bar`. (The 128-byte swizzle of a box of 64 columns is the slabs' own.)
template <class Tile>
FA2_DEVICE void tma_load_tile(u32 dst, const TensorMap& map, int head, int row, int batch, u32 bar) {
    for (int slab = 0; slab < Tile::kSlabs; ++slab)
        tma_load(dst + slab * Tile::kSlabBytes, map, 64 * slab, head, row, batch, bar);
}

// A tile of SwizzledSlabs at `src` out to `map`'s rows `row` .. (its box's rows) of (head, batch): one TMA store per
// slab, in one bulk group (rows outside the tensor are not written).
template <class Tile>
FA2_DEVICE void tma_store_tile(const TensorMap& map, int head, int row, int batch, u32 src) {
    for (int slab = 0; slab < Tile::kSlabs; ++slab)
        tma_store(map, 64 * slab, head, row, batch, src + slab * Tile::kSlabBytes);
    bulk_commit();
}

}  // namespace fa2
