"""The varlen forward on packed and on paged K/V (the same keys; pages of 16 and 256 in a shuffled pool), one
launch each inside the profiled range, for Nsight Compute: fp16, 16 heads of 128, mixed lengths of 16k tokens in
all (bench/varlen_speed.py's), non-causal.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats python bench/paged_ncu.py [--tree DIR]

(--tree: the kernels built from another copy of cuda/, for an A/B in two runs.)
"""

import sys

import cupy
import cupy.cuda.profiler
import numpy as np

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402
from fa2cupy import build  # noqa: E402
from varlen_speed import mixed_lengths, paged_pool  # noqa: E402


def main():
    if "--tree" in sys.argv:
        build.use_sources(sys.argv[sys.argv.index("--tree") + 1])
    h, d = 16, 128
    rng = cupy.random.default_rng(0)
    gen = np.random.default_rng(1)
    lengths = mixed_lengths(gen, 16384)
    total, longest = sum(lengths), max(lengths)
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    q, k, v = (rng.standard_normal((total, h, d), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    calls = [("packed", lambda: fa2cupy.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest))]
    for page_size in (16, 256):
        k_pages, v_pages, table = paged_pool(gen, lengths, page_size, k, v)
        calls.append((f"paged {page_size}", lambda kp=k_pages, vp=v_pages, t=table: fa2cupy.flash_attn_varlen_func(
            q, kp, vp, cu, cu, longest, longest, block_table=t)))
    for _ in range(3):
        for _, call in calls:
            call()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.start()
    for _, call in calls:
        call()
        cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.stop()
    print("profiled:", ", ".join(name for name, _ in calls))


if __name__ == "__main__":
    main()
