"""The Hopper backward (cuda/bwd_hopper.cu's dK/dV kernel) against the mma.sync backward and torch SDPA, one process.

    python bench/hopper_bwd.py [--seqlens 1024,2048,4096,8192,16384] [--headdims 64,128] [--rounds 2] [--window]
    python bench/hopper_bwd.py --trees base=ab_trees/base/cuda,new=cuda [--seqlens ...]   # A/B of kernel sources
    python bench/hopper_bwd.py --rows 64:64:2:1,64:128:2:1 [--seqlens ...]   # A/B of table rows (d:m:stages:keys)

bf16, 16k tokens per batch, hidden 2048 (2048 / d heads): TFLOPs/s of fa2cupy's backward with the Hopper dK/dV
kernel and with the mma.sync one (backward.HOPPER), and of SDPA's flash and cuDNN backends (torch.autograd.grad),
CUDA events, median per round, implementations taking turns, best round each. The gradients of the two fa2cupy
kernels are compared (max |difference| / max |SDPA flash's|). With --window: the window bar's backward, (4096, 0)
over 64k tokens against full causal, h16 d128, both kernels. With --trees: only the Hopper kernel, built from each
copy of cuda/ in turn (build.use_sources), same process, best round each. With --rows: only the Hopper kernel, with
each configs.HopperBwdConfig row in turn for its head dim.
"""

import argparse
import sys

sys.path.insert(0, ".")
from fa2cupy import backward, build, configs, interface  # noqa: E402
from fa2cupy import benchmark as B  # noqa: E402


def use_hopper(on: bool) -> None:
    backward.HOPPER = on
    interface._cached_calls.clear()


def bench(seqlens, rounds, headdims):
    cases = [c for c in B.paper_grid(headdims=headdims, seqlens=seqlens)]
    rows = []
    for case in cases:
        best = {}
        for _ in range(rounds):
            for name, hopper, impl in (("hopper", True, "fa2cupy"), ("mma.sync", False, "fa2cupy"),
                                       ("sdpa flash", True, "sdpa_flash"), ("sdpa cuDNN", True, "sdpa_cudnn")):
                use_hopper(hopper)
                rec = B.bench_backward_case(case, impls=(impl,), memory=False)
                entry = rec["results"][impl]
                if entry["error"]:
                    print(f"{case.label} {name}: {entry['error']}", flush=True)
                    continue
                best[name] = max(best.get(name, 0.0), entry["tflops"])
        diff = None
        for hopper in (True, False):  # both kernels' gradients against SDPA flash
            use_hopper(hopper)
            rec = B.bench_backward_case(case, impls=("fa2cupy", "sdpa_flash"), memory=False, repeats=3, warmup=1)
            diff = (diff or ()) + (rec["max_abs_diff"],)
        rows.append((case.label, *(best.get(n) for n in ("hopper", "mma.sync", "sdpa flash", "sdpa cuDNN")), diff))
        h, m, f, c = rows[-1][1:5]
        print(f"{case.label:36s} hopper {h:6.1f}  mma.sync {m:6.1f}  flash {f:6.1f}  cuDNN {c:6.1f}  "
              f"hopper/flash {h / f:5.2f}x  hopper/mma.sync {h / m:5.2f}x  hopper/cuDNN {h / c:5.2f}x  "
              f"max diff vs flash (hopper, mma.sync) {diff[0]:.2e} {diff[1]:.2e}", flush=True)
    return rows


def rows_ab(rows, seqlens, rounds):
    """Each table row (headdim, block_m, stages, dq_by_keys) in turn on the cases of its head dim."""
    use_hopper(True)
    shipped = dict(configs.BACKWARD_HOPPER_TABLE)
    for d in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == d]
        for case in B.paper_grid(headdims=(d,), seqlens=seqlens):
            best = {}
            for _ in range(rounds):
                for row in mine:
                    configs.BACKWARD_HOPPER_TABLE[d] = configs.HopperBwdConfig(*row)
                    interface._cached_calls.clear()
                    rec = B.bench_backward_case(case, impls=("fa2cupy",), memory=False)
                    best[row] = max(best.get(row, 0.0), rec["results"]["fa2cupy"]["tflops"] or 0.0)
            first = best[mine[0]]
            print(f"{case.label:36s} " + "  ".join(f"{':'.join(str(int(x)) for x in r)} {t:6.1f} ({t / first:5.3f})"
                                                   for r, t in best.items()), flush=True)
    configs.BACKWARD_HOPPER_TABLE.update(shipped)
    interface._cached_calls.clear()


def trees_ab(trees, seqlens, rounds, headdims):
    use_hopper(True)
    for case in B.paper_grid(headdims=headdims, seqlens=seqlens):
        best = {}
        for _ in range(rounds):
            for name, directory in trees:
                build.use_sources(directory)
                interface._cached_calls.clear()
                rec = B.bench_backward_case(case, impls=("fa2cupy",), memory=False)
                best[name] = max(best.get(name, 0.0), rec["results"]["fa2cupy"]["tflops"] or 0.0)
        first = best[trees[0][0]]
        print(f"{case.label:36s} " + "  ".join(f"{n} {t:6.1f} ({t / first:5.3f})" for n, t in best.items()),
              flush=True)
    build.use_sources(None)


def window_bar(rounds):
    import torch

    import fa2cupy

    torch.manual_seed(0)
    b, s, h, d = 1, 65536, 16, 128
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(4))
    events = B.TorchEvents()
    for hopper in (True, False):
        use_hopper(hopper)
        times = {}
        for _ in range(rounds):
            for label, window in (("causal", (-1, -1)), ("window", (4096, 0))):
                out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=True, window_size=window,
                                                      return_attn_probs=True)

                def fn(out=out, lse=lse, window=window):
                    return fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=True, window_size=window)

                t = B.time_gpu(fn, events, warmup=2, repeats=5, max_seconds=30)
                times[label] = min(times.get(label, float("inf")), t.median_ms)
        print(f"window bar backward ({'hopper' if hopper else 'mma.sync'}): causal {times['causal']:.2f} ms, "
              f"window {times['window']:.2f} ms, {times['causal'] / times['window']:.2f}x", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--window", action="store_true")
    ap.add_argument("--headdims", default="64,128")
    ap.add_argument("--trees", default="", help="name=DIR,...: A/B of the Hopper kernel built from each")
    ap.add_argument("--rows", default="", help="d:block_m:stages:dq_by_keys,...: A/B of Hopper backward table rows")
    args = ap.parse_args()
    headdims = B.parse_int_list(args.headdims)
    if args.trees:
        trees = [tuple(item.split("=", 1)) for item in args.trees.split(",")]
        trees_ab(trees, B.parse_int_list(args.seqlens), args.rounds, headdims)
        return
    if args.rows:
        rows = [tuple(int(x) for x in item.split(":")) for item in args.rows.split(",")]
        rows_ab([(d, m, s, bool(k)) for d, m, s, k in rows], B.parse_int_list(args.seqlens), args.rounds)
        return
    bench(B.parse_int_list(args.seqlens), args.rounds, headdims)
    if args.window:
        window_bar(args.rounds)


if __name__ == "__main__":
    main()
