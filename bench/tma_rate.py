"""How fast one SM moves a 128 x 128 16-bit tile (32 KB) from global into shared memory: 16-byte cp.async by 128
threads into 128-byte-swizzled slabs (as the kernels' SlabLoader does) against a tensor-map bulk copy
(cp.async.bulk.tensor.2d, two 128 x 64 boxes, the same swizzle done by the copy engine), one block per SM, each
loading `--tiles` distinct tiles one after another (cycles from the first copy's issue to the last byte landed),
from tiles that are in L2 (the same set for every block) or not (each block its own). The tensor map is encoded with
the driver's cuTensorMapEncodeTiled (ctypes) and read from global memory.

    python bench/tma_rate.py [--tiles 16] [--row-stride 2048]

Why (bench/NOTES.md, session 36): a backward block's own cost is its K/V and first Q/dO in (96 KB at ~27 B a cycle
with cp.async) and its dK/dV out; a faster copy would shrink it.
"""

import argparse
import ctypes
import statistics

import cupy
import numpy as np

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// byte offset of (row, 16-byte chunk c) in a slab of 128-byte rows, 128-byte swizzle (chunk ^ row % 8)
__device__ __forceinline__ u32 swz(int row, int c) { return row * 128 + ((c ^ (row & 7)) << 4); }

extern "C" __global__ void __launch_bounds__(128) load_cp_async(const unsigned short* src, long long row_stride,
                                                              int tiles, int shared_set, long long* cycles) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 base = smem_u32(smem);
    const int t = threadIdx.x;
    for (int i = 0; i < tiles; ++i) {
        const int tile = shared_set ? i : blockIdx.x * tiles + i;
        const unsigned short* tile_src = src + (long long)tile * 128 * row_stride;
        __syncthreads();
        const long long start = clock64();
        // 128 rows x 16 chunks of 16 bytes: each thread 16 chunks, two slabs of 64 columns
        for (int k = 0; k < 16; ++k) {
            const int idx = k * 128 + t, row = idx / 16, chunk = idx % 16, slab = chunk / 8;
            const u32 dst = base + slab * 16384 + swz(row, chunk % 8);
            const void* from = tile_src + (long long)row * row_stride + chunk * 8;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(from));
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        __syncthreads();
        if (t == 0) cycles[blockIdx.x * tiles + i] = clock64() - start;
    }
}

extern "C" __global__ void __launch_bounds__(128) load_tensor(const u64* tensor_map, int tiles, int shared_set,
                                                            long long* cycles) {
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) u64 bar;
    const u32 base = (smem_u32(smem) + 1023) & ~1023u, bar_addr = smem_u32(&bar);
    if (threadIdx.x == 0) asm volatile("mbarrier.init.shared.b64 [%0], 1;\n" ::"r"(bar_addr));
    __syncthreads();
    for (int i = 0; i < tiles; ++i) {
        const int tile = shared_set ? i : blockIdx.x * tiles + i;
        __syncthreads();
        const long long start = clock64();
        if (threadIdx.x == 0) {
            asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;\n" ::"r"(bar_addr), "r"(32768));
            for (int slab = 0; slab < 2; ++slab)
                asm volatile(
                    "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                    " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(base + slab * 16384), "l"(tensor_map), "r"(slab * 64),
                    "r"(tile * 128), "r"(bar_addr)
                    : "memory");
        }
        u32 done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\n"
                         : "=r"(done) : "r"(bar_addr), "r"(i & 1) : "memory");
        if (threadIdx.x == 0) cycles[blockIdx.x * tiles + i] = clock64() - start;
    }
}
"""


def encode_tensor_map(ptr: int, rows: int, row_stride: int) -> np.ndarray:
    """A CUtensorMap (128 bytes) for a rows x 128 16-bit matrix with rows `row_stride` elements apart, boxes of
    128 rows x 64 columns, 128-byte swizzle."""
    cuda = ctypes.CDLL("libcuda.so.1")
    encode = cuda.cuTensorMapEncodeTiled
    encode.restype = ctypes.c_int
    tensor_map = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 2)(128, rows)
    strides = (ctypes.c_uint64 * 1)(row_stride * 2)
    box = (ctypes.c_uint32 * 2)(64, 128)
    element_strides = (ctypes.c_uint32 * 2)(1, 1)
    # data type 1: UINT16; interleave 0; swizzle 3: 128B; L2 promotion 2: 128B; OOB fill 0
    status = encode(ctypes.byref(tensor_map), 1, 2, ctypes.c_void_p(ptr), dims, strides, box, element_strides, 0, 3,
                    2, 0)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled returned {status}")
    return np.frombuffer(bytes(tensor_map), dtype=np.uint64).copy()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiles", type=int, default=16)
    parser.add_argument("--row-stride", type=int, default=2048, help="elements between rows (h16 d128: 2048)")
    args = parser.parse_args()
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    rows = sms * args.tiles * 128
    src = cupy.empty((rows, args.row_stride), dtype=cupy.uint16)  # (what the tiles hold does not matter here)
    module = cupy.RawModule(code=SOURCE, options=("-arch=sm_90a",))
    cp_async, tensor = module.get_function("load_cp_async"), module.get_function("load_tensor")
    for f in (cp_async, tensor):
        f.max_dynamic_shared_size_bytes = 33 * 1024
    tmap = cupy.asarray(encode_tensor_map(src.data.ptr, rows, args.row_stride))
    cycles = cupy.zeros(sms * args.tiles, cupy.int64)
    for name, launch in (
        ("cp.async 16 B x 128 threads", lambda shared: cp_async(
            (sms,), (128,), (src, np.int64(args.row_stride), np.int32(args.tiles), np.int32(shared), cycles),
            shared_mem=33 * 1024)),
        ("tensor-map bulk copy, 2 boxes", lambda shared: tensor(
            (sms,), (128,), (tmap, np.int32(args.tiles), np.int32(shared), cycles), shared_mem=33 * 1024)),
    ):
        for shared, where in ((1, "in L2 (one set for all blocks)"), (0, "from DRAM (each block its own)")):
            launch(shared)  # warm-up (and, for the shared set, L2)
            launch(shared)
            cupy.cuda.Device().synchronize()
            c = cycles.get().reshape(sms, args.tiles)[:, 1:]  # (each block's first tile left out)
            med = statistics.median(c.ravel().tolist())
            print(f"{name:32s} {where:32s} median {med:7.0f} cycles a 32 KB tile ({32768 / med:5.1f} B a cycle, "
                  f"p10 {np.percentile(c, 10):.0f}, p90 {np.percentile(c, 90):.0f})", flush=True)


if __name__ == "__main__":
    main()
