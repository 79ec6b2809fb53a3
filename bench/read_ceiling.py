"""How fast can an H100 stream a KV cache out of HBM? Pure-read kernels (no attention math) in the load styles
a decode kernel can use, on the cache of issue 4's largest point (b=8, 64k keys, 8 kv heads, d=128, bf16: K and
V, 2.1 GB), to tell the decode kernel's gap to cuDNN (2.97 vs 3.08 TB/s) apart from the load style's ceiling.

    python bench/read_ceiling.py

Styles: plain 16-byte loads (ld.global.nc), the same with L1::no_allocate + L2::256B prefetch, cp.async 16-byte
copies into a shared-memory ring (what cuda/decode.cu does), and bulk copies (cp.async.bulk, the TMA engine) of
whole contiguous chunks. Patterns: each block streams one contiguous span ("span"), or the decode kernel's rows
(256 bytes of one kv head out of every 2 KB token row, "rows").
"""

import statistics
import sys

import cupy

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ void ld_nc(const void* p, u32 (&r)[4]) {
    asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
}
__device__ __forceinline__ void ld_nc_pf(const void* p, u32 (&r)[4]) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
}

// Byte offset of 16-byte chunk i of this block's share. span: contiguous bytes [lo, hi); rows: the block's
// (batch, kv head) rows, 256 bytes every 2048 (8 heads x 128 x bf16), chunk i = row i / 16, column i % 16.
template <bool Rows>
__device__ __forceinline__ u64 chunk_offset(u64 lo, u64 i, int head) {
    if (Rows) return lo + (i >> 4) * 2048 + head * 256 + (i & 15) * 16;
    return lo + i * 16;
}

// A block's share: span = total / gridDim.x; rows = one (region, head) with region = block / 8 over total / 2048
// rows split into gridDim.x / 8 regions.
template <bool Rows>
__device__ __forceinline__ void share(u64 total, u64& lo, u64& chunks, int& head) {
    if (Rows) {
        const u64 rows = total / 2048, regions = gridDim.x / 8, region = blockIdx.x / 8;
        head = blockIdx.x % 8;
        const u64 r0 = rows * region / regions, r1 = rows * (region + 1) / regions;
        lo = r0 * 2048;
        chunks = (r1 - r0) * 16;
    } else {
        head = 0;
        const u64 c = total / 16;
        const u64 c0 = c * blockIdx.x / gridDim.x, c1 = c * (blockIdx.x + 1) / gridDim.x;
        lo = c0 * 16;
        chunks = c1 - c0;
    }
}

template <bool Rows, bool Prefetch>
__device__ void read_ldg(const char* base, u64 total, u32* sink) {
    u64 lo, chunks; int head;
    share<Rows>(total, lo, chunks, head);
    u32 acc = 0;
    const u64 step = blockDim.x;
    u64 i = threadIdx.x;
    for (; i + 7 * step < chunks; i += 8 * step) {
        u32 r[8][4];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const char* p = base + chunk_offset<Rows>(lo, i + u * step, head);
            if (Prefetch) ld_nc_pf(p, r[u]); else ld_nc(p, r[u]);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= r[u][0] ^ r[u][1] ^ r[u][2] ^ r[u][3];
    }
    for (; i < chunks; i += step) {
        u32 r[4];
        ld_nc(base + chunk_offset<Rows>(lo, i, head), r);
        acc ^= r[0] ^ r[1] ^ r[2] ^ r[3];
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// The warp's cp.async ring over its share of `tiles` (tiles warp, warp + warps, ...): issue(t, slot) fills slot
// `slot` with tile t; each landed slot is touched once (one word per lane) so the copy cannot be skipped.
template <int Stages, class Issue>
__device__ void stream_ring(u64 tiles, int stage_bytes, u32 ring, Issue issue, u32* sink) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const u64 mine = tiles > (u64)warp ? (tiles - warp + warps - 1) / warps : 0;
#pragma unroll
    for (int s = 0; s < Stages - 1; ++s) {
        if ((u64)s < mine) issue(warp + (u64)s * warps, s);
        asm volatile("cp.async.commit_group;");
    }
    u32 acc = 0;
    for (u64 j = 0; j < mine; ++j) {
        asm volatile("cp.async.wait_group %0;" ::"n"(Stages - 2));
        __syncwarp();
        const u64 ahead = j + Stages - 1;
        if (ahead < mine) issue(warp + ahead * warps, (int)(ahead % Stages));
        asm volatile("cp.async.commit_group;");
        u32 x;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(x) : "r"(ring + (u32)(j % Stages) * stage_bytes + lane * 4));
        acc ^= x;
    }
    asm volatile("cp.async.wait_group 0;");
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// cp.async ring: each warp copies 32 x Per chunks per stage into its own slots, Stages deep.
template <bool Rows, int Stages, int Per>
__device__ void read_cpasync(const char* base, u64 total, u32* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    u64 lo, chunks; int head;
    share<Rows>(total, lo, chunks, head);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 ring = (u32)__cvta_generic_to_shared(smem) + warp * Stages * Per * 512;
    const u64 per_stage = 32 * Per;
    const u64 tiles = (chunks + per_stage - 1) / per_stage;
    auto issue = [&](u64 t, int slot) {
#pragma unroll
        for (int u = 0; u < Per; ++u) {
            const u64 i = t * per_stage + u * 32 + lane;
            const bool ok = i < chunks;
            const char* p = base + chunk_offset<Rows>(lo, ok ? i : 0, head);
            asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(ring + (slot * Per + u) * 512 + lane * 16),
                         "l"(p), "r"(ok ? 16 : 0));
        }
    };
    stream_ring<Stages>(tiles, Per * 512, ring, issue, sink);
}

// Bulk copies (TMA engine): one thread per block issues Bytes-long contiguous copies into a Stages-deep ring,
// mbarrier completion; span pattern only.
template <int Stages, int Bytes>
__device__ void read_bulk(const char* base, u64 total, u32* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) u64 bars[Stages];
    u64 lo, chunks; int head;
    share<false>(total, lo, chunks, head);
    const u64 bytes = chunks * 16, tiles = bytes / Bytes;  // tail ignored (a few KB)
    const u32 buf = (u32)__cvta_generic_to_shared(smem);
    if (threadIdx.x == 0) {
        for (int s = 0; s < Stages; ++s)
            asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"((u32)__cvta_generic_to_shared(&bars[s])));
        asm volatile("fence.mbarrier_init.release.cluster;");
    }
    __syncthreads();
    auto issue = [&](u64 t) {
        const int s = (int)(t % Stages);
        const u32 bar = (u32)__cvta_generic_to_shared(&bars[s]);
        asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(bar), "r"(Bytes));
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(buf + s * Bytes), "l"(base + lo + t * Bytes), "r"(Bytes), "r"(bar) : "memory");
    };
    if (threadIdx.x == 0)
        for (u64 t = 0; t < Stages && t < tiles; ++t) issue(t);
    u32 acc = 0;
    for (u64 t = 0; t < tiles; ++t) {
        const int s = (int)(t % Stages);
        const u32 bar = (u32)__cvta_generic_to_shared(&bars[s]);
        const u32 parity = (u32)((t / Stages) & 1);
        u32 done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        u32 x;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(x) : "r"(buf + s * Bytes + threadIdx.x * 4));
        acc ^= x;
        __syncthreads();  // every thread has read slot s before it is refilled
        if (threadIdx.x == 0 && t + Stages < tiles) issue(t + Stages);
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

extern "C" __global__ void __launch_bounds__(256) ldg_span(const char* b, u64 n, u32* s) { read_ldg<false, false>(b, n, s); }
extern "C" __global__ void __launch_bounds__(256) ldg_rows(const char* b, u64 n, u32* s) { read_ldg<true, false>(b, n, s); }
extern "C" __global__ void __launch_bounds__(256) ldgpf_span(const char* b, u64 n, u32* s) { read_ldg<false, true>(b, n, s); }
extern "C" __global__ void __launch_bounds__(256) ldgpf_rows(const char* b, u64 n, u32* s) { read_ldg<true, true>(b, n, s); }
extern "C" __global__ void __launch_bounds__(128) cpasync_rows(const char* b, u64 n, u32* s) { read_cpasync<true, 2, 16>(b, n, s); }
extern "C" __global__ void __launch_bounds__(128) cpasync_span(const char* b, u64 n, u32* s) { read_cpasync<false, 2, 16>(b, n, s); }
extern "C" __global__ void __launch_bounds__(128) cpasync4_rows(const char* b, u64 n, u32* s) { read_cpasync<true, 4, 8>(b, n, s); }
extern "C" __global__ void __launch_bounds__(128) bulk_span_16k(const char* b, u64 n, u32* s) { read_bulk<4, 16384>(b, n, s); }
extern "C" __global__ void __launch_bounds__(128) bulk_span_32k(const char* b, u64 n, u32* s) { read_bulk<6, 32768>(b, n, s); }

// The decode kernel's pattern: K and V rows of one kv head from two arrays, each warp its own ring of Stages
// stages of Keys keys (K rows then V rows, chunk by chunk as cuda/decode.cu issues them), one block per
// (region, head) as in "rows".
template <int Stages, int Keys, bool Zfill = false, int Pitch = 256, bool DecodeOrder = false>
__device__ void read_kv(const char* kbase, const char* vbase, u64 total, u32* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    // Block order: heads of a region adjacent, or cuda/decode.cu's grid (split, head, batch) with 2 splits.
    const u64 rows = total / 2048, regions = gridDim.x / 8;
    const u64 region = DecodeOrder ? blockIdx.x % 2 + 2 * (blockIdx.x / 16) : blockIdx.x / 8;
    const int head = DecodeOrder ? (blockIdx.x / 2) % 8 : blockIdx.x % 8;
    const u64 r0 = rows * region / regions, r1 = rows * (region + 1) / regions;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int kStageBytes = Keys * 2 * Pitch;  // K and V rows of Keys keys (Pitch bytes apart in smem)
    const u32 ring = (u32)__cvta_generic_to_shared(smem) + warp * Stages * kStageBytes;
    const u64 tiles = (r1 - r0) / Keys;
    auto issue = [&](u64 t, int slot) {
#pragma unroll
        for (int u = 0; u < Keys / 2; ++u) {
            const int idx = u * 32 + lane, r = idx >> 4, c = (idx & 15) * 16;
            const u64 off = (r0 + t * Keys + r) * 2048 + head * 256 + c;
            const u32 dst = ring + slot * kStageBytes + r * Pitch + c;
            if (Zfill) {  // the zero-filling form (source size in a register), as cuda/decode.cu issues it
                const int size = r0 + t * Keys + r < r1 ? 16 : 0;
                asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(kbase + off), "r"(size));
                asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst + Keys * Pitch), "l"(vbase + off), "r"(size));
            } else {
                asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(kbase + off));
                asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst + Keys * Pitch), "l"(vbase + off));
            }
        }
    };
    stream_ring<Stages>(tiles, kStageBytes, ring, issue, sink);
}
extern "C" __global__ void __launch_bounds__(128) kv_2x32(const char* k, const char* v, u64 n, u32* s) { read_kv<2, 32>(k, v, n, s); }
extern "C" __global__ void __launch_bounds__(128) kv_4x16(const char* k, const char* v, u64 n, u32* s) { read_kv<4, 16>(k, v, n, s); }
extern "C" __global__ void __launch_bounds__(128) kv_4x8(const char* k, const char* v, u64 n, u32* s) { read_kv<4, 8>(k, v, n, s); }
extern "C" __global__ void __launch_bounds__(128) kvz_2x32(const char* k, const char* v, u64 n, u32* s) { read_kv<2, 32, true>(k, v, n, s); }
extern "C" __global__ void __launch_bounds__(128) kvp_2x32(const char* k, const char* v, u64 n, u32* s) { read_kv<2, 32, false, 272>(k, v, n, s); }
extern "C" __global__ void __launch_bounds__(128) kvzp_2x32(const char* k, const char* v, u64 n, u32* s) { read_kv<2, 32, true, 272>(k, v, n, s); }
extern "C" __global__ void __launch_bounds__(128) kvo_2x32(const char* k, const char* v, u64 n, u32* s) { read_kv<2, 32, false, 256, true>(k, v, n, s); }
extern "C" __global__ void __launch_bounds__(128) kvzpo_2x32(const char* k, const char* v, u64 n, u32* s) { read_kv<2, 32, true, 272, true>(k, v, n, s); }
extern "C" __global__ void __launch_bounds__(128) kv_8x8(const char* k, const char* v, u64 n, u32* s) { read_kv<8, 8>(k, v, n, s); }
"""

# (kernel, threads, dynamic shared memory bytes)
KERNELS = (
    ("ldg_span", 256, 0), ("ldg_rows", 256, 0), ("ldgpf_span", 256, 0), ("ldgpf_rows", 256, 0),
    ("cpasync_span", 128, 4 * 2 * 16 * 512), ("cpasync_rows", 128, 4 * 2 * 16 * 512),
    ("cpasync4_rows", 128, 4 * 4 * 8 * 512),
    ("bulk_span_16k", 128, 4 * 16384), ("bulk_span_32k", 128, 6 * 32768),
)


def main():
    total = 2 * 8 * 65536 * 8 * 128 * 2  # K and V of b=8, sk=64k, hkv=8, d=128, bf16
    buf = cupy.random.default_rng(0).integers(0, 2**31, total // 4, dtype=cupy.int32).view(cupy.uint8)
    sink = cupy.zeros(1, cupy.uint32)
    mod = cupy.RawModule(code=SOURCE, options=("-std=c++17", "-arch=sm_90a"))
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def timed(fn, grid, threads, smem, args):
        for _ in range(3):
            fn((grid,), (threads,), args, shared_mem=smem)
        times = []
        for _ in range(15):
            start.record()
            fn((grid,), (threads,), args, shared_mem=smem)
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end))
        return statistics.median(times)

    print(f"{total / 1e9:.2f} GB read per launch, {sms} SMs", flush=True)
    for name, threads, smem in KERNELS:
        fn = mod.get_function(name)
        if smem > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = smem
        for blocks_per_sm in (1, 2, 4):
            if smem * blocks_per_sm > 227 * 1024:
                continue
            grid = sms * blocks_per_sm
            if "rows" in name:
                grid -= grid % 8  # whole groups of 8 heads
            ms = timed(fn, grid, threads, smem, (buf, cupy.uint64(total), sink))
            print(f"{name:14s} {blocks_per_sm} blocks/SM (grid {grid}): {total / ms / 1e9:.3f} TB/s ({ms:.3f} ms)",
                  flush=True)
    # K and V as two arrays (the decode kernel's inputs), each half of the bytes: V at K + half (one buffer), or
    # V a separate allocation, or V shifted by a few KB from the half, in case K and V rows share DRAM banks.
    half = total // 2
    v_alone = cupy.empty(half + 65536, cupy.uint8)
    v_alone[:half] = buf[half:]
    layouts = (("V = K + half", buf.data.ptr + half), ("V separate", v_alone.data.ptr),
               ("V = K + half + 4 KB", None), ("V = K + half + 64 KB", None))
    for name in ("kv_2x32", "kvz_2x32", "kvp_2x32", "kvzp_2x32", "kvo_2x32", "kvzpo_2x32", "kv_4x16", "kv_4x8",
                 "kv_8x8"):
        fn = mod.get_function(name)
        stages, keys = (int(x) for x in name.split("_")[1].split("x"))
        smem = 4 * stages * keys * 2 * (272 if "p" in name.split("_")[0] else 256)
        if smem > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = smem
        for layout, v_ptr in layouts:
            if v_ptr is None:  # shifted: K from the buffer's start, V from the spare allocation at an offset
                shift = 4096 if "4 KB" in layout else 65536
                v_ptr = v_alone.data.ptr + shift
                v_bytes = half - shift
            else:
                v_bytes = half
            for blocks_per_sm in (1, 2):
                if smem * blocks_per_sm > 227 * 1024 or ("o_" in name and blocks_per_sm > 1):
                    continue
                grid = sms * blocks_per_sm - (sms * blocks_per_sm) % 8
                args = (buf, cupy.uint64(v_ptr), cupy.uint64(min(half, v_bytes) // 2048 * 2048), sink)
                ms = timed(fn, grid, 128, smem, args)
                print(f"{name:8s} {layout:22s} {blocks_per_sm} blocks/SM (grid {grid}): "
                      f"{2 * min(half, v_bytes) / ms / 1e9:.3f} TB/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
