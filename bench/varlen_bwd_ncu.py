"""The padded and the varlen backward at equal lengths (4 x 4096, h16 d128 fp16), one call each inside the profiled
range, for Nsight Compute's clock-free cycles of every backward kernel (varlen_speed.py's times move by several %
between runs on the H100):

    ncu --clock-control none --profile-from-start off -k regex:bwd \\
        --metrics sm__cycles_elapsed.max,gpu__time_duration.sum python3 bench/varlen_bwd_ncu.py [--causal] [--tree DIR]
        [--seqlen 1024] [--forward]

(--tree: the kernels built from another copy of cuda/, for an A/B in two runs; --seqlen: 16k / seqlen sequences
of seqlen tokens; --forward: the forwards instead, `-k regex:flash_fwd`.)
"""

import sys

import cupy
import cupy.cuda.profiler

sys.path.insert(0, ".")
from fa2cupy import build  # noqa: E402
from varlen_speed import equal_length_calls  # noqa: E402


def main(argv):
    causal = "--causal" in argv
    if "--tree" in argv:
        build.use_sources(argv[argv.index("--tree") + 1])
    s = int(argv[argv.index("--seqlen") + 1]) if "--seqlen" in argv else 4096
    rng = cupy.random.default_rng(0)
    calls = equal_length_calls(lambda *shape: rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16),
                               16384 // s, s, 16, 128, causal)
    kind = "fwd" if "--forward" in argv else "bwd"
    calls = {side: calls[f"{side} {kind}"] for side in ("padded", "varlen")}
    for call in list(calls.values()) * 2:  # compiled and warm before the profiled range
        call()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.start()
    for name, call in calls.items():
        print("profiled:", name, flush=True)
        call()
        cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
