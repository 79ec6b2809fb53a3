"""Where the Hopper forward's work items spend their SM cycles: builds flash_fwd_hopper with FA2_FWD_TRACE (lane 0
of each consumer warpgroup's first warp and the producer's first thread record clock64 at numbered points of
each of their block's first 64 items, cuda/hopper/fwd_traits.cuh's fwd_mark) and prints, per case, the median cycles of
each phase over items (the first item of each block left out), per consumer warpgroup, and each point's median
offset from the same item's "Q in" (readable whatever order a changed kernel puts the points in).

    python bench/dev/hopper_trace.py [--cases causal:65536,window4096:65536] [--heads 16] [--headdim 128]
    python bench/dev/hopper_trace.py --cases causal:1024,varlen-causal:1024 --tokens 16384 [--tree ab_trees/x/cuda]
    python bench/dev/hopper_trace.py --headdim 192 --headdim-v 128 --heads 10 --cases causal:8192 --tokens 16384

A case is [varlen-]<none|causal|window<left>>:<seqlen>; with --tokens, a batch of tokens / seqlen sequences of
that length (varlen: packed, with cu_seqlens), else one.
"""

import argparse
import sys

import cupy
import numpy as np

sys.path.insert(0, ".")
from fa2cupy import build, configs, forward  # noqa: E402

POINTS, ITEMS, BLOCKS = 24, 64, 160  # kTracePoints, kTraceItems, kTraceBlocks
CONSUMER = (  # (label, from point, to point) within one item (-1: point 5 of the item before); + 10 for warpgroup 1
    ("Q wait (previous rows written -> Q in)", -1, 0),
    ("item worked out", 0, 6),
    ("first tile wait", 6, 7),
    ("turn wait", 7, 8),
    ("first S (issued -> landed)", 8, 1),
    ("first softmax", 1, 2),
    ("loop", 2, 3),
    ("last P V", 3, 4),
    ("finalize", 4, 9),
    ("rows staged", 9, 5),
    ("item (rows written -> rows written)", -1, 5),
)
PRODUCER = 20  # its points: 20 item known, 22 Q buffer free, 23 K/V issued


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="causal:65536,window4096:65536")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--headdim-v", type=int, default=0, help="v's own head dim (configs.hopper_fwd_v_config)")
    parser.add_argument("--tokens", type=int, default=0, help="tokens per call (default: one sequence)")
    parser.add_argument("--tree", help="build from this copy of cuda/ instead")
    args = parser.parse_args()
    if args.tree:
        build.use_sources(args.tree)
    d, heads = args.headdim, args.heads
    dv = args.headdim_v or d
    rng = cupy.random.default_rng(0)
    for case in args.cases.split(","):
        mask_name, seqlen = case.split(":")
        varlen = mask_name.startswith("varlen-")
        mask_name = mask_name.removeprefix("varlen-")
        seqlen = int(seqlen)
        batch = max(1, args.tokens // seqlen)
        window = (int(mask_name[6:]), 0) if mask_name.startswith("window") else (-1, -1)
        mask = "window" if window[0] >= 0 else mask_name
        config = configs.FORWARD_HOPPER_TABLE[d]
        if dv != d:
            config = configs.hopper_fwd_v_config(config, dv, False, False, mask, varlen)
        name = config.name_expression("float16", mask, varlen=varlen)
        module = build.install_traced("fwd_hopper", name, config.smem_bytes, ("-DFA2_FWD_TRACE",))  # what plans get
        shape, v_shape = (batch, seqlen, heads, d), (batch, seqlen, heads, dv)
        strides, v_strides = (((0 if varlen else seqlen * heads * w), heads * w, w, 1) for w in (d, dv))
        totals = (batch * seqlen,) * 2 if varlen else None
        plan = forward.plan_forward(shape, shape, (strides, strides, v_strides, v_strides), "float16", d ** -0.5,
                                    mask != "none", 90, window_size=window, varlen_totals=totals,
                                    headdim_v=None if dv == d else dv)
        q, k = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(2))
        v = rng.standard_normal(v_shape, dtype=cupy.float32).astype(cupy.float16)
        out = cupy.empty_like(v)
        lse = cupy.empty((batch, heads, seqlen), cupy.float32)
        cu = cupy.arange(0, batch * seqlen + 1, seqlen, dtype=cupy.int32) if varlen else None
        cu_ptr = cu.data.ptr if varlen else 0
        trace = module.get_global("fa2_fwd_trace")
        stream = cupy.cuda.get_current_stream()
        for _ in range(3):
            trace.memset_async(0, BLOCKS * ITEMS * POINTS * 8, stream)
            pointers = dict(forward.NO_POINTERS, q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, out=out.data.ptr,
                            softmax_lse=lse.data.ptr, cu_seqlens_q=cu_ptr, cu_seqlens_k=cu_ptr)
            forward.run_forward(plan, pointers, (0, 0), stream.ptr)
        stream.synchronize()
        host = np.zeros(BLOCKS * ITEMS * POINTS, np.int64)
        trace.copy_to_host(host.ctypes.data, host.nbytes)
        marks = host.reshape(BLOCKS, ITEMS, POINTS).astype(np.float64)
        marks[marks == 0] = np.nan
        dims = f"{d}/{dv}" if dv != d else f"{d}"
        print(f"== {case} b{batch} h{heads} d{dims} fp16, grid {plan.launch.grid[0]}, counter {plan.tile_counter}: "
              f"median cycles over items 1..63 of every block")
        for wg in range(2):
            cells = []
            for label, a, b in CONSUMER:
                to = marks[:, 1:, 10 * wg + b]
                start = marks[:, :-1, 10 * wg + 5] if a < 0 else marks[:, 1:, 10 * wg + a]
                cells.append(f"{label}: {np.nanmedian(to - start):.0f}")
            print(f"  warpgroup {wg}: " + "; ".join(cells))
            # Each point against the same item's "Q in", whatever order a kernel puts them in
            q_in = marks[:, 1:, 10 * wg]
            offsets = [f"{p}: {np.nanmedian(marks[:, 1:, 10 * wg + p] - q_in):.0f}" for p in range(1, 10)]
            period = np.nanmedian(marks[:, 2:, 10 * wg] - marks[:, 1:-1, 10 * wg])
            print("    points after Q in: " + ", ".join(offsets) + f"; Q in -> next Q in: {period:.0f}")
        producer = (("Q buffer free, previous rows out", PRODUCER, PRODUCER + 2),
                    ("K/V issued", PRODUCER + 2, PRODUCER + 3))
        print("  producer: " + "; ".join(f"{label}: {np.nanmedian(marks[:, 1:, b] - marks[:, 1:, a]):.0f}"
                                          for label, a, b in producer)
              + f"; Q issued -> Q in (wg 0): {np.nanmedian(marks[:, 1:, 0] - marks[:, 1:, PRODUCER + 2]):.0f}"
              + f"; Q buffer free -> wg 1's loop done: "
              f"{np.nanmedian(marks[:, 1:, PRODUCER + 2] - marks[:, :-1, 13]):.0f}")
        total = np.nanmax(marks[:, :, 15], axis=1) - np.nanmin(marks[:, :, PRODUCER], axis=1)
        print(f"  block span (first item known -> last rows written): median {np.nanmedian(total):.0f}, "
              f"max {np.nanmax(total):.0f}")


if __name__ == "__main__":
    main()
