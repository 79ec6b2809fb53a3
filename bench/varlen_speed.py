"""Varlen speed against the padded batch of the same real tokens (target: >= 0.95x), forward and backward,
fp16, 16 heads of 128, 16k tokens in all.

    python bench/varlen_speed.py [--tokens 16384] [--causal] [--paged 16,256]
    python bench/varlen_speed.py --trees base=ab_trees/base/cuda new=cuda [--rounds 4] [--causal] [--paged 16]
        [--mma] [--backward]
    (from the repository root, after ``pip install -e .``: the harness is the installed package ``fa2cupy_bench``)

Two comparisons, each timed back to back with the same timer as ``fa2cupy bench`` (CUDA events, median):
* equal lengths: varlen over b sequences of s tokens against flash_attn_func on (b, s): the same work, so the
  time ratio is the overhead of varlen (rounds taking turns, medians over rounds);
* mixed lengths (random, 256..4096, fixed seed): varlen TFLOPs/s against the padded batch's at the same total
  real tokens, padded to the longest sequence; the padded batch does the extra work of its padding, so this is
  the speed a user gains by not padding;
* with --trees: only the equal-length forwards (with --backward the backwards too; with --paged the
  mixed-length paged and packed ones), with kernels built from each copy of cuda/ in turn within one process
  (rounds of every tree, each keeping its best round), so that kernel versions compare on one clock (--mma: on the
  mma.sync forward);
* with --paged: the varlen forward reading K/V through a shuffled block_table of pages of each given size against
  the packed varlen forward on the same keys (the page look-ups' cost), and the paged call on the mma.sync forward;
* with --grid: only the equal-length comparison, over every head dim of --headdims (--hidden / d heads each), every
  sequence length of --seqlens, causal and not, each case's four calls in rounds taking turns (a case's best round
  per call), one line per case: the bar's grid in one run (--sustain: each timed set at its own steady clock).

    python bench/varlen_speed.py --grid --headdims 64,80,96,128,192,256 --seqlens 2048,8192,16384
"""

import argparse
import statistics
import sys

import cupy
import numpy as np

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402
from fa2cupy_bench import harness as B  # noqa: E402
from fa2cupy import build, paging, pipeline  # noqa: E402
from fa2cupy.options import KernelOptions  # noqa: E402

#: Keyword arguments that every fa2cupy call here takes besides its own: the KernelOptions (--mma: the mma.sync
#: forward where the Hopper one would run).
CALL = {"kernel_options": None}
MMA = KernelOptions(hopper_forward=False)


def flops(lengths, heads, d, causal, bwd):
    per = sum(4 * n * n * heads * d for n in lengths) * (0.5 if causal else 1.0)
    return per * (2.5 if bwd else 1.0)


def mixed_lengths(gen, tokens):
    """Random sequence lengths of 256..4096 tokens, ``tokens`` in all (the last one shorter)."""
    lengths, total = [], 0
    while total < tokens:
        n = int(min(gen.integers(256, 4097), tokens - total))
        lengths.append(n)
        total += n
    return lengths


def paged_pool(gen, lengths, page_size, k, v):
    """Packed varlen K/V ``(total, h, d)`` copied into pages of ``page_size`` rows of a shuffled pool:
    (k_pages, v_pages, block_table) on the GPU."""
    table, num_pages = paging.shuffled_block_table(gen, lengths, page_size, unused=0)
    pools = []
    for packed in (k, v):
        pool = cupy.zeros((num_pages, page_size) + packed.shape[1:], packed.dtype)
        paging.write_pages(cupy, pool, packed, np.concatenate([[0], np.cumsum(lengths)]), table)
        pools.append(pool)
    return pools[0], pools[1], cupy.asarray(table)


def equal_length_calls(rand, b, seqlen, h, d, causal):
    """The padded batch (b, seqlen) and the same tokens packed as b varlen sequences: forward and backward calls
    of each, on fresh random inputs."""
    q, k, v, do = (rand(b, seqlen, h, d) for _ in range(4))
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=causal, **CALL, return_attn_probs=True)
    cu = cupy.arange(0, b * seqlen + 1, seqlen, dtype=cupy.int32)
    qv, kv, vv, dov = (x.reshape(b * seqlen, h, d) for x in (q, k, v, do))
    outv, lsev, _ = fa2cupy.flash_attn_varlen_func(qv, kv, vv, cu, cu, seqlen, seqlen, causal=causal, **CALL,
                                                    return_attn_probs=True)
    return {
        "padded fwd": lambda: fa2cupy.flash_attn_func(q, k, v, causal=causal, **CALL),
        "padded bwd": lambda: fa2cupy.flash_attn_backward(do, q, k, v, out, lse, causal=causal, **CALL),
        "varlen fwd": lambda: fa2cupy.flash_attn_varlen_func(qv, kv, vv, cu, cu, seqlen, seqlen, causal=causal, **CALL),
        "varlen bwd": lambda: fa2cupy.flash_attn_varlen_backward(dov, qv, kv, vv, outv, lsev, cu, cu, seqlen, seqlen,
                                                                 causal=causal, **CALL),
    }


def time_pair(fwd, bwd, events):
    f = B.time_gpu(fwd, events, warmup=3, repeats=15).median_ms
    b = B.time_gpu(bwd, events, warmup=3, repeats=15).median_ms
    return f, b


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--paged", default="", help="comma-separated page sizes: paged forward vs packed")
    parser.add_argument("--trees", nargs="*", default=(), help="name=path/to/cuda ...: forward A/B of sources")
    parser.add_argument("--rounds", type=int, default=4, help="timing rounds (equal lengths, or --trees)")
    parser.add_argument("--backward", action="store_true", help="with --trees: the equal-length backwards too")
    parser.add_argument("--mma", action="store_true", help="with --trees: the forwards on the mma.sync kernel")
    parser.add_argument("--grid", action="store_true", help="equal lengths over --headdims x --seqlens x masks")
    parser.add_argument("--headdims", default="64,80,96,128,192,256", help="with --grid")
    parser.add_argument("--seqlens", default="2048,8192,16384", help="with --grid")
    parser.add_argument("--hidden", type=int, default=2048, help="with --grid: heads = hidden // headdim")
    parser.add_argument("--sustain", type=float, default=0.0,
                        help="with --grid: seconds of back-to-back calls before each timed set, so that each call is "
                             "timed at the clock its own load settles to")
    args = parser.parse_args()
    h, d, causal = args.heads, args.headdim, args.causal
    rng = cupy.random.default_rng(0)
    events = B.CupyEvents()

    def rand(*shape):
        return rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)

    if args.trees:
        CALL["kernel_options"] = MMA if args.mma else None
        return compare_trees(args, rand, events)
    if args.grid:
        return grid(args, rand, events)

    for seqlen in (1024, 4096):
        calls = equal_length_calls(rand, args.tokens // seqlen, seqlen, h, d, causal)
        # Rounds taking turns (padded, varlen, padded, ...): timed one after the other, the two see different
        # clocks (the padded backward's own time moves by 4% between runs); medians over rounds.
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(B.time_gpu(call, events, warmup=3, repeats=15).median_ms)
        pf, pb, vf, vb = (statistics.median(times[n]) for n in ("padded fwd", "padded bwd", "varlen fwd",
                                                                  "varlen bwd"))
        print(f"equal lengths {args.tokens // seqlen}x{seqlen} causal={causal}: padded fwd {pf:.3f} ms bwd "
              f"{pb:.3f} ms | varlen fwd {vf:.3f} ms bwd {vb:.3f} ms | varlen speed / padded: fwd {pf / vf:.3f}x "
              f"bwd {pb / vb:.3f}x (bar >= 0.95x; medians of {args.rounds} rounds)", flush=True)

    gen = np.random.default_rng(1)
    lengths = mixed_lengths(gen, args.tokens)
    total, longest = sum(lengths), max(lengths)
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    qv, kv, vv, dov = (rand(total, h, d) for _ in range(4))
    outv, lsev, _ = fa2cupy.flash_attn_varlen_func(qv, kv, vv, cu, cu, longest, longest, causal=causal, **CALL,
                                                    return_attn_probs=True)
    vf, vb = time_pair(lambda: fa2cupy.flash_attn_varlen_func(qv, kv, vv, cu, cu, longest, longest, causal=causal,
                                                              **CALL),
                       lambda: fa2cupy.flash_attn_varlen_backward(dov, qv, kv, vv, outv, lsev, cu, cu, longest,
                                                                  longest, causal=causal, **CALL), events)
    q, k, v, do = (rand(len(lengths), longest, h, d) for _ in range(4))
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=causal, **CALL, return_attn_probs=True)
    pf, pb = time_pair(lambda: fa2cupy.flash_attn_func(q, k, v, causal=causal, **CALL),
                       lambda: fa2cupy.flash_attn_backward(do, q, k, v, out, lse, causal=causal, **CALL), events)
    real_f, real_b = flops(lengths, h, d, causal, False), flops(lengths, h, d, causal, True)
    print(f"mixed lengths ({len(lengths)} sequences, {total} tokens, longest {longest}) causal={causal}: "
          f"varlen {real_f / vf / 1e9:.0f} / {real_b / vb / 1e9:.0f} TFLOPs/s fwd/bwd on real tokens; padded "
          f"batch ({len(lengths)}x{longest}) takes {pf / vf:.2f}x / {pb / vb:.2f}x varlen's time", flush=True)

    for page_size in (int(p) for p in args.paged.split(",") if p):
        # The mixed lengths again, each sequence's keys on pages of page_size rows in a shuffled pool.
        k_pages, v_pages, table_d = paged_pool(gen, lengths, page_size, kv, vv)
        paged = fa2cupy.flash_attn_varlen_func(qv, k_pages, v_pages, cu, cu, longest, longest, causal=causal, **CALL,
                                               block_table=table_d)
        packed = fa2cupy.flash_attn_varlen_func(qv, kv, vv, cu, cu, longest, longest, causal=causal, **CALL)
        same = bool(cupy.array_equal(paged, packed))
        pf = B.time_gpu(lambda: fa2cupy.flash_attn_varlen_func(qv, k_pages, v_pages, cu, cu, longest, longest,
                                                               causal=causal, **CALL, block_table=table_d),
                        events, warmup=3, repeats=15).median_ms
        vf = B.time_gpu(lambda: fa2cupy.flash_attn_varlen_func(qv, kv, vv, cu, cu, longest, longest, causal=causal,
                                                               **CALL),
                        events, warmup=3, repeats=15).median_ms
        # the same paged call on the mma.sync forward (what GPUs other than Hopper run)
        mf = B.time_gpu(lambda: fa2cupy.flash_attn_varlen_func(qv, k_pages, v_pages, cu, cu, longest, longest,
                                                               causal=causal, block_table=table_d, kernel_options=MMA),
                        events, warmup=3, repeats=15).median_ms
        print(f"paged K/V, pages of {page_size}, mixed lengths causal={causal}: paged fwd {pf:.3f} ms, packed fwd "
              f"{vf:.3f} ms: paged speed / packed {vf / pf:.3f}x (bitwise equal: {same}); paged on the mma.sync "
              f"forward {mf:.3f} ms ({mf / pf:.2f}x the time)", flush=True)


def grid(args, rand, events):
    """Equal-length varlen against padded, forward and backward, over head dims x sequence lengths x masks: each
    case's four calls timed in rounds taking turns, each call's best round (the bar's grid in one run)."""
    for d in (int(x) for x in args.headdims.split(",")):
        h = max(1, args.hidden // d)
        for seqlen in (int(x) for x in args.seqlens.split(",")):
            for causal in (False, True):
                b = max(1, args.tokens // seqlen)
                calls = equal_length_calls(rand, b, seqlen, h, d, causal)
                best = dict.fromkeys(calls, float("inf"))
                for _ in range(args.rounds):
                    for name, call in calls.items():
                        best[name] = min(best[name], B.time_gpu(call, events, warmup=3, repeats=10,
                                                                sustain_seconds=args.sustain).median_ms)
                fwd = flops([seqlen] * b, h, d, causal, False)
                print(f"d {d:3d} ({h:2d} heads) {b:2d}x{seqlen:<5d} causal={int(causal)}: TFLOPs/s padded / varlen "
                      f"fwd {fwd / best['padded fwd'] / 1e9:4.0f} / {fwd / best['varlen fwd'] / 1e9:4.0f} bwd "
                      f"{2.5 * fwd / best['padded bwd'] / 1e9:4.0f} / {2.5 * fwd / best['varlen bwd'] / 1e9:4.0f} | "
                      f"varlen speed / padded: fwd {best['padded fwd'] / best['varlen fwd']:.3f}x bwd "
                      f"{best['padded bwd'] / best['varlen bwd']:.3f}x (best of {args.rounds} rounds)", flush=True)


def compare_trees(args, rand, events):
    """Equal-length varlen and padded forwards (with --backward the backwards too; with --paged the mixed-length
    paged and packed varlen forwards) on kernels built from each tree, in rounds taking turns."""
    h, d, causal = args.heads, args.headdim, args.causal
    trees = [t.split("=", 1) for t in args.trees]
    calls = {}  # case: (name of the reference call, reference, name of the compared call, compared)
    for seqlen in (1024, 4096):
        each = equal_length_calls(rand, args.tokens // seqlen, seqlen, h, d, causal)
        for part in ("fwd", "bwd") if args.backward else ("fwd",):
            calls[f"{args.tokens // seqlen}x{seqlen} {part}"] = ("padded", each[f"padded {part}"],
                                                                "varlen", each[f"varlen {part}"])
    gen = np.random.default_rng(1)
    lengths = mixed_lengths(gen, args.tokens)
    longest = max(lengths)
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    qv, kv, vv = (rand(sum(lengths), h, d) for _ in range(3))
    for page_size in (int(p) for p in args.paged.split(",") if p):
        k_pages, v_pages, table = paged_pool(gen, lengths, page_size, kv, vv)
        calls[f"mixed, pages of {page_size}"] = (
            "packed", lambda: fa2cupy.flash_attn_varlen_func(qv, kv, vv, cu, cu, longest, longest, causal=causal,
                                                             **CALL),
            "paged", lambda kp=k_pages, vp=v_pages, t=table: fa2cupy.flash_attn_varlen_func(
                qv, kp, vp, cu, cu, longest, longest, causal=causal, **CALL, block_table=t))
    best = {}
    for _ in range(args.rounds):
        for name, path in trees:
            build.use_sources(path)
            pipeline.forget_plans()  # (the plans hold the previous tree's kernels)
            for case, (_, reference, _, compared) in calls.items():
                rf = B.time_gpu(reference, events, warmup=3, repeats=15).median_ms
                cf = B.time_gpu(compared, events, warmup=3, repeats=15).median_ms
                old = best.get((name, case), (float("inf"), float("inf")))
                best[(name, case)] = (min(old[0], rf), min(old[1], cf))
    for case, (ref_name, _, cmp_name, _) in calls.items():
        for name, _ in trees:
            rf, cf = best[(name, case)]
            print(f"{name:>10} {case} causal={causal}: {ref_name} {rf:.4f} ms, {cmp_name} {cf:.4f} ms: "
                  f"{cmp_name} speed / {ref_name} {rf / cf:.3f}x (best of {args.rounds} rounds)", flush=True)


if __name__ == "__main__":
    main()
