"""The backward's cost against its steps: sliding windows (w, 0) of several widths and full causal attention over
64k tokens (h16 d128 fp16, as bench/window_speed.py), the dK/dV kernel launched alone, and the O(N) passes
(preprocess, dQ conversion) timed beside it. A least-squares fit of the dK/dV kernel's time over the windows,
t x steps + o x blocks, says what a query-tile step and a key block's own cost are, and so where the window bar
(issue 5: (4096, 0) >= 8x faster than full causal) is lost.

    python bench/bwd_window_sweep.py [--windows 1024,2048,4096,8192,16384] [--rounds 3]
    ncu --clock-control none --profile-from-start off --metrics sm__cycles_elapsed.max \\
        python bench/bwd_window_sweep.py --ncu          # one dK/dV launch per case, in SM cycles
    python bench/bwd_window_sweep.py --tree ab_trees/base/cuda ...   # the kernels of another copy of cuda/

Steps are counted as the kernel walks them: per key block (the plan's block_n keys), the query tiles (its block_m
rows: 64 at d=128, 128 at d=64) with a row that sees one of its keys (WindowMask::query_tiles), for every head.
"""

import argparse
import statistics
import sys
from types import SimpleNamespace

import cupy
import cupy.cuda.profiler
import numpy as np

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402
from fa2cupy import backward, build  # noqa: E402
from fa2cupy import benchmark as B  # noqa: E402


def steps_of(seqlen, window, block_m=64, block_n=128):
    """Query-tile steps of every 128-key block (one head), as WindowMask::query_tiles counts them."""
    total = 0
    for key0 in range(0, seqlen, block_n):
        first = key0 // block_m  # causal, seqlen_q == seqlen_k: the first row that sees key0 is key0
        last_key = min(key0 + block_n, seqlen) - 1
        end_row = seqlen if window is None else min(last_key + window + 1, seqlen)
        total += max(0, -(-end_row // block_m) - first)
    return total


def launches(q, k, v, dout, window):
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=True, window_size=window, return_attn_probs=True)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    strides = {n: tuple(s // x.itemsize for s in x.strides)
               for n, x in zip(("q", "k", "v", "dout", "out", "dq", "dk", "dv"), (q, k, v, dout, out, *grads))}
    plan = backward.plan_backward(q.shape, k.shape, strides, str(q.dtype), q.shape[-1] ** -0.5, True, False,
                                  int(cupy.cuda.Device().compute_capability), window_size=window)
    dsum = cupy.empty(plan.dsum_shape, cupy.float32)
    dq_accum = cupy.empty(plan.dq_accum_shape, cupy.float32)
    stream = cupy.cuda.get_current_stream().ptr
    # (what the launches use, kept alive, by name: the plan's tile rows count the steps)
    keep = SimpleNamespace(plan=plan, out=out, lse=lse, grads=grads, dsum=dsum, dq_accum=dq_accum)
    p = lambda x: x.data.ptr  # noqa: E731
    pre = lambda: plan.preprocess(stream, (p(dout), p(out), p(dsum), p(dq_accum), 0))  # noqa: E731
    maps = backward.maps_writer(plan, p(q), p(k), p(v), p(dout))
    main = lambda: plan.main(stream, (p(q), p(k), p(v), p(dout), p(lse), p(dsum), p(dq_accum), p(grads[1]),  # noqa
                                      p(grads[2]), 0, 0, 0, 0, 0, 0, 0, 0), maps)
    conv = lambda: plan.convert(stream, (p(dq_accum), p(grads[0]), 0))  # noqa: E731
    return keep, pre, main, conv


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--windows", default="1024,2048,4096,8192,16384")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ncu", action="store_true", help="one dK/dV launch per case inside the profiled range")
    parser.add_argument("--tree", help="a copy of cuda/ to build the kernels from (build.use_sources)")
    args = parser.parse_args(argv)
    if args.tree:
        build.use_sources(args.tree)
    rng = cupy.random.default_rng(0)
    shape = (1, args.seqlen, args.heads, args.headdim)
    q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    cases = [(w, (w, 0)) for w in map(int, args.windows.split(","))] + [(None, (-1, -1))]
    runs = {w: launches(q, k, v, dout, window) for w, window in cases}
    block_m, block_n = runs[None][0].plan.config.block_m, runs[None][0].plan.config.block_n
    blocks = args.heads * (-(-args.seqlen // block_n))
    steps = {w: args.heads * steps_of(args.seqlen, w, block_m, block_n) for w, _ in cases}
    if args.ncu:
        for w, _ in cases:
            runs[w][2]()
        cupy.cuda.Device().synchronize()
        cupy.cuda.profiler.start()
        for w, _ in cases:
            runs[w][2]()
        cupy.cuda.Device().synchronize()
        cupy.cuda.profiler.stop()
        print("cases in order:", ", ".join(f"{w or 'causal'} ({steps[w]} steps)" for w, _ in cases))
        return
    events = B.CupyEvents()
    times = {w: ([], [], []) for w, _ in cases}
    for _ in range(args.rounds):
        for w, _ in cases:
            for i, f in enumerate(runs[w][1:]):
                times[w][i].append(B.time_gpu(f, events, warmup=2, repeats=8).median_ms)
    med = {w: [statistics.median(t) for t in times[w]] for w, _ in cases}
    for w, _ in cases:
        pre, main_ms, conv = med[w]
        print(f"{'causal' if w is None else f'window ({w}, 0)'}: {steps[w]} steps of {block_m} rows, "
              f"dK/dV {main_ms:.3f} ms "
              f"({1e6 * main_ms / steps[w] * 132:.3f} ns x 132 per step), preprocess {pre:.3f} ms, "
              f"dQ conversion {conv:.3f} ms", flush=True)
    ws = [w for w, _ in cases if w is not None]
    a = np.array([[steps[w], blocks] for w in ws], dtype=float)
    y = np.array([med[w][1] for w in ws])
    (t, o), *_ = np.linalg.lstsq(a, y, rcond=None)
    per_sm = 132e6  # ms -> ns, times the SMs: each SM's share
    print(f"fit over the windows: a step {t * per_sm:.1f} ns per SM, a key block's own cost {o * per_sm:.1f} ns "
          f"per SM (= {o / t:.2f} steps); residuals " +
          ", ".join(f"{(t * steps[w] + o * blocks) / med[w][1] - 1:+.2%}" for w in ws))
    c = med[None][1]
    print(f"causal dK/dV {c:.3f} ms against the fit's {t * steps[None] + o * blocks:.3f} ms")
    if 4096 in med:
        whole = {w: sum(med[w]) for w in (None, 4096)}
        print(f"(4096, 0): dK/dV alone {c / med[4096][1]:.2f}x, with the O(N) passes {whole[None] / whole[4096]:.2f}x"
              f"; without the key blocks' own cost {(c - o * blocks) / (med[4096][1] - o * blocks):.2f}x; "
              f"step ratio {steps[None] / steps[4096]:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
