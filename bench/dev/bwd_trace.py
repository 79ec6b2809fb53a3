"""Where the Hopper backward's dK/dV blocks spend their SM cycles: builds bwd_dkdv_hopper with FA2_BWD_TRACE
(hopper/bwd_traits.cuh's bwd_mark: the block's thread 0 at its start, the consumers' first thread as K/V land, as the
first step's tiles land, after the first and the last step and after the dK/dV stores, the producer's first thread
at its end, and the SM) and prints, per case, the median cycles of each phase over blocks, and the gap between a
block's end and the next block's start on the same SM. Head dim 128 (dQ by columns: the consumers' first thread
marks every point; by keys it skips the first step's).

    python bench/dev/bwd_trace.py [--cases window4096:65536,causal:65536] [--heads 16] [--tokens 16384]

A case is <none|causal|window<left>>:<seqlen>; with --tokens, a batch of tokens / seqlen sequences, else one.
"""

import argparse
import sys

import cupy
import numpy as np

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402
from fa2cupy import build, configs  # noqa: E402

POINTS, BLOCKS = 8, 16384  # kBwdTracePoints, kBwdTraceBlocks
PHASES = (("start -> K/V in", 0, 1), ("K/V in -> first step's tiles in", 1, 2), ("first step", 2, 3),
          ("the other steps", 3, 4), ("dK/dV written", 4, 5), ("producer's end after the last step", 4, 6),
          ("block (start -> last mark)", 0, None))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="window4096:65536,causal:65536")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=0, help="tokens per call (default: one sequence)")
    args = parser.parse_args()
    d, heads = 128, args.heads
    config = configs.BACKWARD_HOPPER_TABLE[d]
    rng = cupy.random.default_rng(0)
    for case in args.cases.split(","):
        mask_name, seqlen = case.split(":")
        seqlen = int(seqlen)
        batch = max(1, args.tokens // seqlen)
        window = (int(mask_name[6:]), 0) if mask_name.startswith("window") else (-1, -1)
        mask = "window" if window[0] >= 0 else mask_name
        module = build.install_traced("bwd_hopper", config.name_expression("float16", mask), config.smem_bytes(),
                                      ("-DFA2_BWD_TRACE",))
        shape = (batch, seqlen, heads, d)
        q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
        causal = mask != "none"
        out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
        fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, window_size=window)  # warm-up
        trace = module.get_global("fa2_bwd_trace")
        marks = cupy.ndarray((BLOCKS, POINTS), cupy.int64, trace)
        marks.fill(-1)
        fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, window_size=window)
        cupy.cuda.Device().synchronize()
        m = marks.get()
        blocks = min(BLOCKS, batch * heads * -(-seqlen // 128))
        m = m[:blocks]
        ends = np.maximum(m[:, 5], m[:, 6])
        print(f"{case} (b{batch} h{heads} d{d}, {blocks} blocks traced): median cycles")
        for label, a, b in PHASES:
            x = (ends if b is None else m[:, b]) - m[:, a]
            print(f"  {label:40s} {np.median(x):9.0f}  (p10 {np.percentile(x, 10):.0f}, p90 {np.percentile(x, 90):.0f})")
        gaps = []
        for sm in np.unique(m[:, 7]):
            on = m[m[:, 7] == sm]
            order = np.argsort(on[:, 0])
            starts, stops = on[order, 0], np.maximum(on[order, 5], on[order, 6])
            gaps.extend(starts[1:] - stops[:-1])
        gaps = np.array(gaps)
        print(f"  {'gap: a block end -> next start, same SM':40s} {np.median(gaps):9.0f}  (p10 "
              f"{np.percentile(gaps, 10):.0f}, p90 {np.percentile(gaps, 90):.0f})", flush=True)


if __name__ == "__main__":
    main()
