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
import fa2cupy  # noqa: E402
from fa2cupy import build  # noqa: E402


def main(argv):
    causal = "--causal" in argv
    if "--tree" in argv:
        build.use_sources(argv[argv.index("--tree") + 1])
    s = int(argv[argv.index("--seqlen") + 1]) if "--seqlen" in argv else 4096
    b, h, d = 16384 // s, 16, 128
    rng = cupy.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((b, s, h, d), dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    packed = [x.reshape(b * s, h, d) for x in (q, k, v, dout, out)]
    cu = cupy.arange(0, b * s + 1, s, dtype=cupy.int32)
    _, lse_varlen, _ = fa2cupy.flash_attn_varlen_func(*packed[:3], cu, cu, s, s, causal=causal,
                                                      return_attn_probs=True)
    calls = {
        "padded": lambda: fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=causal),
        "varlen": lambda: fa2cupy.flash_attn_varlen_backward(packed[3], *packed[:3], packed[4], lse_varlen, cu, cu,
                                                             s, s, causal=causal),
    }
    if "--forward" in argv:
        calls = {
            "padded": lambda: fa2cupy.flash_attn_func(q, k, v, causal=causal),
            "varlen": lambda: fa2cupy.flash_attn_varlen_func(*packed[:3], cu, cu, s, s, causal=causal),
        }
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
