"""The bulk fp32 reductions' ceiling: how many bytes a second every SM's `cp.reduce.async.bulk ... add.f32` (the
Hopper backward's dQ additions) can add into a global accumulator, with nothing else running, by tile size, the
number of tiles each block keeps in flight and the accumulator's footprint (L2-resident or not).

    python bench/dev/reduce_ceiling.py                      # 34.8, 51.2 and 67.6 KB tiles (d = 128, 192, 256 steps)
    python bench/dev/reduce_ceiling.py --tiles 51200 --spans 6553600 --blocks-per-sm 1,2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cupy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fa2cupy_bench import harness as B  # noqa: E402
from fa2cupy import build  # noqa: E402

SOURCE = r"""
#include "sm90/mbarrier.cuh"
#include "sm90/tma.cuh"

template <int InFlight>
__global__ void reduce_tiles(float* dst, long long slots, int tile_bytes, int iters) {
    extern __shared__ __align__(128) unsigned char tiles[];
    const int tile_floats = tile_bytes / 4;
    for (int i = threadIdx.x; i < tile_floats * InFlight; i += blockDim.x)
        reinterpret_cast<float*>(tiles)[i] = 1e-6f * (i & 255);
    fa2::fence_proxy_async_smem();
    __syncthreads();
    if (threadIdx.x != 0) return;
    const fa2::u32 base = fa2::smem_u32(tiles);
    long long slot = (blockIdx.x * 7919LL) % slots;
    for (int i = 0; i < iters; ++i) {
        fa2::bulk_reduce_add_f32(dst + slot * tile_floats, base + (i % InFlight) * tile_bytes, tile_bytes);
        fa2::bulk_commit();
        fa2::bulk_wait_read<InFlight - 1>();
        slot = (slot + 131) % slots;
    }
    fa2::bulk_wait<0>();
}
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", default="34816,51200,67584", help="bytes a reduction (64 rows of d + 8 floats)")
    parser.add_argument("--spans", default="6553600,134217728", help="accumulator bytes the blocks add into")
    parser.add_argument("--inflight", default="1,2,4", help="tiles a block keeps in flight (1, 2 or 4)")
    parser.add_argument("--blocks-per-sm", default="1,2")
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    names = {n: f"reduce_tiles<{n}>" for n in (1, 2, 4)}  # (tiles in flight)
    module = cupy.RawModule(code=SOURCE, options=build.NVRTC_OPTIONS + ("-arch=sm_90a", f"-I{build.kernel_dir()}"),
                            name_expressions=tuple(names.values()))
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {sms} SMs")
    print("tile bytes  span MB  in flight  blocks/SM     TB/s")
    for tile in map(int, args.tiles.split(",")):
        for span in map(int, args.spans.split(",")):
            slots = span // tile
            dst = cupy.zeros(slots * tile // 4, cupy.float32)
            for inflight in map(int, args.inflight.split(",")):
                kernel = module.get_function(names[inflight])
                smem = tile * inflight
                kernel.max_dynamic_shared_size_bytes = smem
                for per_sm in map(int, args.blocks_per_sm.split(",")):
                    if smem * per_sm > 227 * 1024:
                        continue
                    grid = sms * per_sm
                    launch = lambda: kernel((grid,), (128,), (dst, cupy.int64(slots), cupy.int32(tile),  # noqa: E731
                                                              cupy.int32(args.iters)), shared_mem=smem)
                    ms = B.time_gpu(launch, B.CupyEvents(), warmup=3, repeats=args.repeats).median_ms
                    tbps = grid * args.iters * tile / ms / 1e9
                    print(f"{tile:10d} {span / 2**20:8.1f} {inflight:10d} {per_sm:10d} {tbps:8.2f}", flush=True)


if __name__ == "__main__":
    main()
