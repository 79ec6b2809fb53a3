"""One decode step of fa2cupy, SDPA flash and SDPA cuDNN per case, for Nsight Compute: warm-up outside the
profiled range, then each implementation once inside it (cudaProfilerStart/Stop), each step preceded by a marker
kernel so that its kernels can be told apart. Shows which kernels the SDPA backends launch (grid, block, shared
memory) and how many DRAM bytes each one reads; with --parse, the kernel time of each step and its KV bandwidth
(K+V bytes / the step's kernel time, the issue-4 bar's metric on the kernels alone: no launch or host time).

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum,\\
        launch__grid_size,launch__block_size,launch__shared_mem_per_block_dynamic,launch__registers_per_thread \\
        python bench/decode_ncu.py 8x65536 64x16384

    ncu --clock-control none --profile-from-start off --csv --print-units base --log-file ncu.csv \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum python bench/decode_ncu.py --grid --steps steps.txt
    python bench/decode_ncu.py --parse ncu.csv --steps steps.txt

ncu flushes the caches before each kernel (its default cache control), so every step reads its cache from HBM,
also those that fit in the 50 MB L2 (the bench's back-to-back calls read those partly from L2).
"""

import argparse
import csv
import statistics
import sys

sys.path.insert(0, ".")

H, HKV, D = 32, 8, 128  # the decode bar's query heads, KV heads and head dim
IMPLEMENTATIONS = ("fa2cupy", "sdpa flash", "sdpa cudnn")
MARKER = "fa2_ncu_step_marker"


def profile(cases, steps_file=None):
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa2cupy

    marker = cupy.RawKernel(f'extern "C" __global__ void {MARKER}(int* x) {{ if (x) *x = 0; }}', MARKER)
    backends = {"sdpa flash": SDPBackend.FLASH_ATTENTION, "sdpa cudnn": SDPBackend.CUDNN_ATTENTION}
    gen = torch.Generator(device="cuda").manual_seed(0)
    names = []
    for case in cases:
        batch, seqlen = (int(x) for x in case.split("x"))
        q = torch.randn(batch, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        kc = torch.randn(batch, seqlen, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        vc = torch.randn(batch, seqlen, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        lens = torch.full((batch,), seqlen, device="cuda", dtype=torch.int32)
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()

        def step(name):
            if name == "fa2cupy":
                return fa2cupy.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
            with sdpa_kernel([backends[name]]):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        for _ in range(3):
            for name in IMPLEMENTATIONS:
                step(name)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for name in IMPLEMENTATIONS:
            marker((1,), (1,), (0,))
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"{case} {name}")
            step(name)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            names.append(f"{case} {name}")
        torch.cuda.profiler.stop()
        del q, kc, vc, qt, kt, vt
        torch.cuda.empty_cache()
    if steps_file:
        with open(steps_file, "w") as f:
            f.write("\n".join(names) + "\n")
    print("profiled:", ", ".join(names))


def parse(csv_path, steps_path):
    """Table of each step's kernels (ncu --csv --print-units base output), its kernel time and KV bandwidth."""
    from fa2cupy import benchmark as B

    with open(steps_path) as f:
        names = [line.strip() for line in f if line.strip()]
    with open(csv_path) as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages start with ==PROF==
    kernels = {}  # ID -> [name, {metric: value}]
    for row in csv.DictReader(lines):
        entry = kernels.setdefault(int(row["ID"]), [row["Kernel Name"], {}])
        try:
            entry[1][row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
        except ValueError:  # a metric that is not a number (none of the two this table reads)
            pass
    steps, current = [], None
    for _, (name, metrics) in sorted(kernels.items()):
        if name.startswith(MARKER):
            current = []
            steps.append(current)
        elif current is not None:
            current.append((name, metrics))
    if len(steps) != len(names):
        raise SystemExit(f"{len(steps)} steps in {csv_path}, {len(names)} names in {steps_path}")
    rows, times = [], {}
    for name, kernels_of_step in zip(names, steps):
        case, impl = name.split(" ", 1)
        ns = sum(m["gpu__time_duration.sum"] for _, m in kernels_of_step)
        read = sum(m.get("dram__bytes_read.sum", 0.0) for _, m in kernels_of_step)
        times[case, impl] = ns
        rows.append((case, impl, len(kernels_of_step), ns, read, [k for k, _ in kernels_of_step]))
    print("case        implementation  kernels  kernel us   KV TB/s  DRAM read MB  kernels")
    for case, impl, count, ns, read, kernel_names in rows:
        b, sk = (int(x) for x in case.split("x"))
        kv = B.kv_cache_bytes(b, sk, HKV, D)
        short = ", ".join(k.split("(")[0].split("<")[0].removeprefix("void ")[-40:] for k in kernel_names)
        print(f"{case:<11} {impl:<15} {count:>7}  {ns / 1e3:>9.2f}  {kv / ns / 1e3:>8.3f}  {read / 1e6:>12.1f}  {short}")
    print()
    print("case        fa2cupy TB/s  vs flash  vs cuDNN  vs best SDPA")
    ratios = []
    for case in dict.fromkeys(name.split(" ", 1)[0] for name in names):
        ours, flash, cudnn = (times[case, impl] for impl in IMPLEMENTATIONS)
        b, sk = (int(x) for x in case.split("x"))
        kv = B.kv_cache_bytes(b, sk, HKV, D)
        best = min(flash, cudnn) / ours
        ratios.append(best)
        print(f"{case:<11} {kv / ours / 1e3:>12.3f}  {flash / ours:>7.2f}x  {cudnn / ours:>7.2f}x  {best:>11.2f}x")
    print(f"vs the better SDPA backend: {min(ratios):.2f}-{max(ratios):.2f}x (median {statistics.median(ratios):.2f}x)")


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", help="BxSEQLEN cases (default: 8x65536 64x16384 1x16384)")
    parser.add_argument("--grid", action="store_true", help="the cases of issue 4's grid (fa2cupy bench's)")
    parser.add_argument("--steps", help="file of the profiled steps' names, in order (written, or read by --parse)")
    parser.add_argument("--parse", metavar="CSV", help="tabulate an ncu --csv --print-units base log")
    args = parser.parse_args(argv)
    if args.parse:
        parse(args.parse, args.steps)
        return
    if args.grid:
        from fa2cupy import benchmark as B
        cases = [f"{b}x{s}" for b, s in B.decode_grid(B.DECODE_BATCHES, B.DECODE_SEQLENS)]
    else:
        cases = args.cases or ["8x65536", "64x16384", "1x16384"]
    profile(cases, args.steps)


if __name__ == "__main__":
    main(sys.argv[1:])
