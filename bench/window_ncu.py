"""The window bar's kernels, one launch each, for Nsight Compute: full causal attention and a (4096, 0) window
over 64k tokens (h16 d128 fp16, as bench/window_speed.py), forward and backward, warm-up outside the profiled
range (cudaProfilerStart/Stop). SM cycles do not move with the clock, which the H100 changes by several percent
between and within runs (bench/NOTES.md), so a cycle ratio is a steadier reading of a kernel change than a time.

    ncu --clock-control none --profile-from-start off \\
        --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,launch__registers_per_thread \\
        python bench/window_ncu.py [--forward-only]
"""

import sys

import cupy
import cupy.cuda.profiler

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402


def main(argv):
    forward_only = "--forward-only" in argv
    rng = cupy.random.default_rng(0)
    shape = (1, 65536, 16, 128)
    q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    steps = []
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


if __name__ == "__main__":
    main(sys.argv[1:])
