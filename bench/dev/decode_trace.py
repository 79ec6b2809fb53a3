"""Where a decode launch spends its time, item by item: builds decode_attention with FA2_DECODE_TRACE (thread 0
of each block records %globaltimer at numbered points of each work item, decode/traits.cuh's decode_mark) and prints,
per case, how long each phase takes (median and max over items, microseconds) and, where blocks walk several
items, each item's span by its place in its block and the gap between items. Same shape as the decode bar
(hq=32 hkv=8 d=128, seqlen_q=1, full caches).

    python bench/dev/decode_trace.py [--cases 1x16384,64x1024] [--config 32,2,4,1] [--splits 0] [--defines ...]
                                 [--tree ab_trees/x/cuda]
    (from the repository root, after ``pip install -e .``: the harness is the installed package ``fa2cupy_bench``)
"""

import argparse
import sys

import cupy
import numpy as np

sys.path.insert(0, ".")
from fa2cupy_bench import harness as B  # noqa: E402
from fa2cupy import build, configs, decode, device_errors  # noqa: E402
from tune_decode import D, HKV, decode_caches, decode_step  # noqa: E402

POINTS = 24  # kTracePoints
PHASES = (  # (label, from point, to point)
    ("prologue (Q + first tiles landed)", 0, 1),
    ("tile 0 wait", 1, 2),
    ("tiles 1-7 (per tile)", 3, 10),
    ("tiles 1-3 (per tile)", 3, 6),
    ("tiles 4-7 (per tile)", 6, 10),
    ("tiles 7-9 (per tile)", 9, 11),
    ("loop end (warp 0)", 1, 12),
    ("other warps' loops", 12, 13),
    ("warp rows to shared memory", 13, 20),
    ("block lse and weights", 20, 21),
    ("block rows written", 21, 14),
    ("fence + arrival", 14, 15),
    ("split merge (merging blocks)", 15, 16),
)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="1x4096,1x16384,8x1024,64x1024,8x65536")
    parser.add_argument("--config", default=None, help="block_n,stages,warps,l2_prefetch[,deep_ring] (default: "
                        "the table's row)")
    parser.add_argument("--splits", default="0", help="comma-separated num_splits (0 = heuristic)")
    parser.add_argument("--defines", default="", help="extra NVRTC defines, e.g. FA2_DECODE_TRACE_STRIDE=25 "
                        "(tile marks every 25th tile)")
    parser.add_argument("--tree", help="build from this copy of cuda/ instead")
    args = parser.parse_args()
    if args.tree:
        build.use_sources(args.tree)
    device = cupy.cuda.runtime.getDevice()
    config = configs.decode_config(int(cupy.cuda.Device().compute_capability), D)
    if args.config:
        bn, st, w, pf, *deep = (int(x) for x in args.config.split(","))
        config = configs.DecodeConfig(D, bn, st, w, bool(pf), bool(deep and deep[0]))
    name = config.name_expression("float16", False, False)
    defines = [f"-D{d}" for d in args.defines.split(",") if d]
    module = build.install_traced("decode", name, decode._opt_in_smem(config, device),  # what plan_decode gets
                                  ["-DFA2_DECODE_TRACE", *defines])
    stride = next((int(d.split("=")[1]) for d in args.defines.split(",") if d.startswith("FA2_DECODE_TRACE_STRIDE=")),
                  1)
    trace = module.get_global("fa2_decode_trace")
    trace_host = np.zeros(8192 * POINTS * 2, dtype=np.uint64)  # fa2_decode_trace's size
    errors = device_errors.pointers(device)
    events = B.CupyEvents()
    rng = cupy.random.default_rng(0)
    print(f"config bn{config.block_n} st{config.stages} w{config.warps} pf{int(config.l2_prefetch)} "
          f"deep{int(config.deep_ring)}")
    for case in args.cases.split(","):
        b, sk = map(int, case.split("x"))
        q, kc, vc = decode_caches(rng, b, sk)
        nbytes = B.kv_cache_bytes(b, sk, HKV, D)
        for splits in map(int, args.splits.split(",")):
            plan, run, _ = decode_step(q, kc, vc, config, splits, errors)
            t = B.time_gpu(run, events, warmup=10, repeats=50)
            trace.memset_async(0, trace_host.nbytes)  # then one launch, warm, read back
            run()
            cupy.cuda.runtime.deviceSynchronize()
            trace.copy_to_host(trace_host.ctypes.data, trace_host.nbytes)
            raw = trace_host.reshape(-1, POINTS, 2)
            print(f"\n{case} splits={plan.splits} grid={plan.attention.grid[0]}: "
                  f"{nbytes / (t.median_ms * 1e-3) / 1e12:.2f} TB/s, {t.median_ms * 1e3:.1f} us per call (events, "
                  f"back to back)")
            report(raw, stride, plan.splits)


def report(raw, stride, splits=1):
    """Per-phase medians and maxima over work items, and, for blocks that walk several items, where a block's
    time goes between its items; with splits and a block per item, each row's merge tail."""
    raw = raw.astype(np.int64)
    stamps, sms, owners = raw[:, :POINTS - 1, 0], raw[:, POINTS - 1, 0], raw[:, POINTS - 1, 1]
    seen = stamps[:, 1] > 0  # every item records its start (point 1); point 0 is its block's start
    stamps, sms, owners = stamps[seen], sms[seen], owners[seen]
    start = stamps[stamps > 0].min()
    rel = np.where(stamps > 0, stamps - start, -1) / 1e3
    ends = np.maximum(rel[:, 14], rel[:, 16])
    blocks = np.unique(owners)
    block_ends = np.array([ends[owners == blk].max() for blk in blocks])
    print(f"  {len(stamps)} items, {len(blocks)} blocks on {len(np.unique(sms))} SMs; last block done at "
          f"{block_ends.max():.2f} us (median block {np.median(block_ends):.2f}, earliest {block_ends.min():.2f})")
    for label, a, z in PHASES:
        ok = (rel[:, a] >= 0) & (rel[:, z] >= 0)
        if not ok.any():
            continue
        span = (rel[ok, z] - rel[ok, a]) / ((z - a) * stride if label.endswith("(per tile)") else 1)
        print(f"    {label:40s} median {np.median(span):6.2f}  max {span.max():6.2f} us  ({ok.sum()} items)")
    if len(stamps) == len(blocks):
        if splits > 1:
            merge_tail(rel, owners, splits)
        return
    # Blocks that walk items: each item's span (its start to its rows written), the gap from one item's end to
    # the next item's first tile landing, by the item's place in its block.
    spans, gaps, counts = {}, [], []
    for blk in blocks:
        mine = np.flatnonzero(owners == blk)
        mine = mine[np.argsort(rel[mine, 1])]
        counts.append(len(mine))
        for k, i in enumerate(mine):
            place = "first" if k == 0 else "last" if k == len(mine) - 1 else "middle"
            spans.setdefault(place, []).append(ends[i] - rel[i, 1])
            if k and rel[i, 2] >= 0:
                gaps.append(rel[i, 2] - ends[mine[k - 1]])
    print(f"  items per block: {sorted(set(counts))} ({np.bincount(counts)[min(counts):].tolist()} blocks)")
    for place, values in spans.items():
        print(f"    item span, {place:6s} items                   median {np.median(values):6.2f}  max "
              f"{max(values):6.2f} us  ({len(values)} items)")
    if gaps:
        print(f"    previous item's end to first tile landed      median {np.median(gaps):6.2f}  max {max(gaps):6.2f} us")


def merge_tail(rel, owners, splits):
    """A block per item, the split fastest: block x holds split x % splits of row x // splits. Per row, from the
    last of its blocks to be done with its loops (point 13) to the merged rows (point 16), and how often the
    merging block was that last one."""
    tails, last_merges = [], []
    for row in np.unique(owners // splits):
        mine = np.flatnonzero(owners // splits == row)
        merged = mine[rel[mine, 16] >= 0]
        if len(mine) != splits or len(merged) != 1:
            continue
        tails.append(rel[merged[0], 16] - rel[mine, 13].max())
        last_merges.append(rel[merged[0], 13] == rel[mine, 13].max())
    if tails:
        print(f"    last loops done to row merged            median {np.median(tails):6.2f}  max {max(tails):6.2f} us  "
              f"({len(tails)} rows; merged by the last block done: {np.mean(last_merges):.0%})")


if __name__ == "__main__":
    main()
