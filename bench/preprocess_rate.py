"""The backward's O(N) passes alone (bwd_preprocess: D = rowsum(dO * O) and the fp32 dQ accumulator cleared; the
dQ conversion), over 64k tokens at hidden 2048 (h32 d64 and h16 d128, fp16), as DRAM rates, with the kernels of
one or more copies of cuda/ taking turns in one process (best round's median each). Each tree's D is compared
with the first's (bitwise) and its accumulator checked for zeros, after outputs poisoned with NaN.

    python bench/preprocess_rate.py [--trees base=ab_trees/base/cuda,new=cuda] [--rounds 4]
    ncu --clock-control none -k regex:bwd_preprocess --metrics dram__bytes_read.sum,dram__bytes_write.sum \\
        python bench/preprocess_rate.py --rounds 1      # what each pass moves to and from DRAM

Bytes counted: the preprocess reads dO and O and writes D and the accumulator's rows (its pitch, pad included);
the conversion reads the accumulator's rows and writes dQ.
"""

import argparse
import sys

import cupy

sys.path.insert(0, ".")
from fa2cupy import benchmark as B  # noqa: E402
from fa2cupy import build  # noqa: E402
from bench.bwd_window_sweep import launches  # noqa: E402


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--trees", default="cuda", help="name=DIR,... (a bare DIR is named after itself)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=65536)
    args = parser.parse_args(argv)
    trees = [t.partition("=")[::2] if "=" in t else (t, t) for t in args.trees.split(",")]
    rng = cupy.random.default_rng(0)
    events = B.CupyEvents()
    for d in (64, 128):
        shape = (1, args.seqlen, 2048 // d, d)
        q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
        runs = {}
        for name, tree in trees:
            build.use_sources(None if tree == "cuda" else tree)
            runs[name] = launches(q, k, v, dout, (4096, 0))
        build.use_sources(None)
        for name, (keep, pre, _main, _conv) in runs.items():  # D and the accumulator poisoned, then one pass
            keep.dsum.fill(float("nan"))
            keep.dq_accum.fill(float("nan"))
            pre()
        first = runs[trees[0][0]][0]
        for name, (keep, *_rest) in runs.items():
            accum = keep.dq_accum
            same = cupy.array_equal(keep.dsum, first.dsum)
            print(f"d={d} {name}: D {'bitwise equal to' if same else 'DIFFERS from'} "
                  f"{trees[0][0]}'s; accumulator rows cleared: {bool((accum[..., :d] == 0).all())}, their pad: "
                  f"{bool((accum[..., d:] == 0).all()) if accum.shape[-1] > d else 'none'}", flush=True)
        plan, dsum, accum = first.plan, first.dsum, first.dq_accum
        io = 2 * q.nbytes
        pre_bytes = io + dsum.nbytes + accum.nbytes
        conv_bytes = accum.nbytes + q.nbytes
        best = {name: [float("inf"), float("inf")] for name, _ in trees}
        for _ in range(args.rounds):
            for name, (_keep, pre, _main, conv) in runs.items():
                for i, f in enumerate((pre, conv)):
                    ms = B.time_gpu(f, events, warmup=3, repeats=20).median_ms
                    best[name][i] = min(best[name][i], ms)
        for name, (pre_ms, conv_ms) in best.items():
            print(f"d={d} h{shape[2]} {name}: preprocess {pre_ms:.3f} ms ({pre_bytes / pre_ms / 1e9:.2f} TB/s of "
                  f"{pre_bytes / 1e6:.0f} MB), conversion {conv_ms:.3f} ms ({conv_bytes / conv_ms / 1e9:.2f} TB/s "
                  f"of {conv_bytes / 1e6:.0f} MB); accumulator pitch {plan.dq_accum_shape[-1]}", flush=True)
        del runs


if __name__ == "__main__":
    main(sys.argv[1:])
