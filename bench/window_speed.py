"""Sliding-window speed: a (4096, 0) window over 64k tokens against full causal attention over the same tokens
(issue 5's bar: >= 8x faster), forward and backward, bf16, 16 heads of 128.

    python bench/window_speed.py [--seqlen 65536] [--window 4096]

Same timer as ``fa2cupy bench`` (CUDA events per call, calls back to back, median).
"""

import argparse
import sys

import cupy

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402
from fa2cupy import benchmark as B  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=65536)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--headdim", type=int, default=128)
    args = parser.parse_args()
    rng = cupy.random.default_rng(0)
    shape = (1, args.seqlen, args.heads, args.headdim)
    q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    events = B.CupyEvents()
    results = {}
    for name, window in (("causal", (-1, -1)), (f"window ({args.window}, 0)", (args.window, 0))):
        out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=True, window_size=window, return_attn_probs=True)
        fwd = B.time_gpu(lambda: fa2cupy.flash_attn_func(q, k, v, causal=True, window_size=window), events,
                         warmup=3, repeats=10)
        bwd = B.time_gpu(lambda: fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=True,
                                                             window_size=window), events, warmup=3, repeats=10)
        results[name] = (fwd.median_ms, bwd.median_ms)
        print(f"{name}: forward {fwd.median_ms:.2f} ms, backward {bwd.median_ms:.2f} ms", flush=True)
    (cf, cb), (wf, wb) = results.values()
    print(f"speed-up of the window over full causal, seqlen {args.seqlen}: forward {cf / wf:.1f}x, "
          f"backward {cb / wb:.1f}x (bar: >= 8x)")


if __name__ == "__main__":
    main()
