"""Rate of fp32 bulk reductions into global memory (cp.reduce.async.bulk .add.f32), by operation size: what bounds
the Hopper backward's dQ at d=128 (bench/NOTES.md, session 34).

    python bench/reduce_rate.py [--tiles 256] [--iters 64]

Each block adds one 32 KB tile of shared memory (64 rows of 128 floats, as a dQ tile) into a tile of the
accumulator per step, in operations of S bytes spread over its threads, waiting for the reads before the next
step, as the kernel does. The accumulator has `--tiles` tiles (256: 8 MB, L2-resident). Prints TB/s per S.
"""

import argparse
import sys

import cupy

sys.path.insert(0, ".")
from fa2cupy import benchmark as B  # noqa: E402

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256) reduce_rate(float* acc, int tiles, int iters, int op_bytes) {
    extern __shared__ __align__(128) float tile[];
    for (int i = threadIdx.x; i < 8192; i += blockDim.x) tile[i] = 1.0f;
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const unsigned src0 = (unsigned)__cvta_generic_to_shared(tile);
    const int ops = 32768 / op_bytes;
    for (int it = 0; it < iters; ++it) {
        float* dst = acc + (size_t)((blockIdx.x * 7 + it) % tiles) * 8192;
        for (int op = threadIdx.x; op < ops; op += blockDim.x) {
            asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                         :: "l"(dst + op * (op_bytes / 4)), "r"(src0 + op * op_bytes), "r"(op_bytes) : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        __syncthreads();
    }
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", type=int, default=256)
    ap.add_argument("--iters", type=int, default=64)
    args = ap.parse_args()
    kernel = cupy.RawKernel(SOURCE, "reduce_rate", options=("-arch=sm_90a",))
    kernel.max_dynamic_shared_size_bytes = 32768
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    acc = cupy.zeros(args.tiles * 8192, cupy.float32)
    events = B.CupyEvents()
    for blocks_per_sm in (1, 2):
        for op_bytes in (256, 512, 2048, 8192, 32768):
            grid = sms * blocks_per_sm
            launch = lambda: kernel((grid,), (256,), (acc, cupy.int32(args.tiles), cupy.int32(args.iters),  # noqa
                                                      cupy.int32(op_bytes)), shared_mem=32768)
            ms = B.time_gpu(launch, events, warmup=3, repeats=10).median_ms
            tb = grid * args.iters * 32768 / (ms * 1e-3) / 1e12
            print(f"blocks/SM {blocks_per_sm}  op {op_bytes:6d} B  {ms:.3f} ms  {tb:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
