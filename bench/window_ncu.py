"""The window bar's kernels, one launch each, for Nsight Compute: full causal attention and a (4096, 0) window
over 64k tokens (fp16, hidden 2048: h16 d128 as bench/window_speed.py, or h32 with --headdim 64), forward and
backward, warm-up outside the profiled range (cudaProfilerStart/Stop). SM cycles do not move with the clock,
which the H100 changes by several percent between and within runs (bench/NOTES.md), so a cycle ratio is a
steadier reading of a kernel change than a time.

    ncu --clock-control none --profile-from-start off \\
        --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,launch__registers_per_thread \\
        python bench/window_ncu.py [--forward-only] [--headdim 64] [--window-rows 128,3,3,1 ...]

--window-rows: the window's forward also on other Hopper rows of the head dim (block_n,k_stages,v_stages,
q_buffers[,consumer_wgs]), launched first. --tree DIR: kernels built from the sources in DIR (a copy of cuda/, say
HEAD's from `git archive`) instead of this package's.
"""

import argparse
import sys
from pathlib import Path

import cupy
import cupy.cuda.profiler

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402
from fa2cupy import build, configs, forward  # noqa: E402


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--window-rows", nargs="*", default=[],
                        help="the window's forward also on these Hopper rows of the head dim (block_n,k_stages,"
                             "v_stages,q_buffers[,consumer_wgs]), e.g. 128,3,3,1")
    parser.add_argument("--tree", type=Path, help="a copy of cuda/ to build the kernels from")
    parser.add_argument("--headdim", type=int, default=128, choices=(64, 128))
    args = parser.parse_args(argv)
    forward_only, rows = args.forward_only, args.window_rows
    if args.tree:
        build.use_sources(args.tree)
    rng = cupy.random.default_rng(0)
    d = args.headdim
    shape = (1, 65536, 2048 // d, d)
    q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    steps, candidates = [], []
    shipped = configs.FORWARD_HOPPER_TABLE[d]
    for row in rows:  # each planned now (the plan is cached with its config), so the table goes back at once
        configs.FORWARD_HOPPER_TABLE[d] = configs.HopperFwdConfig(d, *map(int, row.split(",")))
        plan = forward.plan_forward(shape, shape, (tuple(q.strides[i] // 2 for i in range(4)),) * 4, "float16",
                                    d ** -0.5, True, 90, window_size=(4096, 0))
        configs.FORWARD_HOPPER_TABLE[d] = shipped
        out = cupy.full_like(q, float("nan"))
        lse = cupy.empty((1, shape[2], 65536), cupy.float32)
        candidates.append((row, out))
        steps.append(lambda p=plan, o=out, l=lse: forward.run_forward(
            p, q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, l.data.ptr, cupy.cuda.get_current_stream().ptr))
    for window in ((-1, -1), (4096, 0)):
        out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=True, window_size=window, return_attn_probs=True)
        steps.append(lambda w=window: fa2cupy.flash_attn_func(q, k, v, causal=True, window_size=w))
        if not forward_only:
            steps.append(lambda w=window, o=out, l=lse: fa2cupy.flash_attn_backward(dout, q, k, v, o, l, causal=True,
                                                                                   window_size=w))
    for step in steps:
        step()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.start()
    for step in steps:
        step()
        cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.stop()
    for row, candidate in candidates:  # the window's output on each row against the shipped row's
        print(f"row {row}: max |out - shipped| = {float(cupy.abs(candidate.astype(cupy.float32) - out).max()):.3e}")


if __name__ == "__main__":
    main(sys.argv[1:])
