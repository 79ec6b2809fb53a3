"""v's own head dim against the square call: forward and backward of d_qk / d_v beside d_qk / d_qk, in rounds taking
turns (CUDA events, median of --repeats after warm-up; a figure is its best round), 16k tokens per batch.

    python bench/dev/headdim_v_ab.py                                       # 192 / 128 (DeepSeek's), 2k and 8k
    python bench/dev/headdim_v_ab.py --pairs 192:128,128:64 --seqlens 8192 --causal on
    python bench/dev/headdim_v_ab.py --modes fwd --options default= g48=hopper_l2_group_bytes=50331648
    python bench/dev/headdim_v_ab.py --varlen --dtype fp16                 # the varlen calls too

TFLOPs/s count each pass's products at their own widths: forward 2 sq sk (d_qk + d_v) a head (Q K^T and P V),
backward 2.5 times that, as the square call's 4 sq sk d and 2.5 times it. The ratio is the pair's TFLOPs/s over the
square call's (issue 47's bar: 0.95); a call as fast as the square one reads (d_qk + d_v) / (2 d_qk). ``--options``
times both calls under each set of KernelOptions (``name=key=value,...``, as bench/dev/options_ab.py), a line each.
``--varlen`` times the same calls on the batch packed as varlen sequences too (flash_attn_varlen_func and its
backward), a line more: the varlen pair over the varlen square call, and over the padded pair.
"""

from __future__ import annotations

import argparse
import sys

from fa2cupy_bench import harness as B


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", default="192:128", help="D_QK:D_V, ...")
    p.add_argument("--seqlens", default="2048,8192")
    p.add_argument("--causal", choices=["both", "on", "off"], default="both")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--modes", default="fwd,bwd")
    p.add_argument("--sustain", type=float, default=0.0,
                   help="seconds of back-to-back calls before each timed set, at the clock its own load settles to")
    p.add_argument("--options", nargs="+", default=["default="], help="name=key=value,... (KernelOptions)")
    p.add_argument("--varlen", action="store_true", help="the varlen calls on the same tokens too")
    p.add_argument("--dtype", default="bf16")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    layouts = ("padded", "varlen") if args.varlen else ("padded",)
    option_sets = dict(B.named_kernel_options(t) for t in args.options)
    for spec in args.pairs.split(","):
        d, dv = (int(x) for x in spec.split(":"))
        for s in B.parse_int_list(args.seqlens):
            for causal in B.causal_options(args.causal):
                cases = {w: B.Case(batch=16384 // s, seqlen_q=s, seqlen_k=s, nheads=2048 // d, nheads_kv=2048 // d,
                                   headdim=d, headdim_v=0 if w == d else w, causal=causal, dtype=args.dtype)
                         for w in (d, dv)}
                runners = {}
                for w, case in cases.items():
                    inp = B.make_forward_inputs(case, 0, "torch")
                    dout = B._random_like(inp.q.new_empty(case.out_shape), 1)
                    for name, opts in option_sets.items():
                        for layout in layouts:
                            varlen = layout == "varlen"
                            if "fwd" in modes:
                                runners[("fwd", w, name, layout)] = B.fa2cupy_runner(inp, varlen, kernel_options=opts)
                            if "bwd" in modes:
                                runners[("bwd", w, name, layout)] = B.fa2cupy_backward_runner(
                                    inp, dout, varlen=varlen, kernel_options=opts)
                best = {}
                for r in range(args.rounds):  # (each round starts at the next runner: none is always timed first)
                    keys = list(runners)
                    for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                        run = runners[key]
                        with run.context():
                            ms = B.time_gpu(run.fn, run.events, warmup=5, repeats=args.repeats,
                                            sustain_seconds=args.sustain).median_ms
                        best[key] = min(best.get(key, float("inf")), ms)
                square = cases[d]
                for name in option_sets:
                    for layout in layouts:
                        line = [f"{square.label:34s} d_v {dv}" + (f" [{name}]" if len(option_sets) > 1 else "")
                                + (" varlen" if layout == "varlen" else "")]
                        for mode in modes:
                            flops = {w: B.attention_flops(square, mode) * (d + w) / (2 * d) for w in (d, dv)}
                            rate = {(w, lay): B.tflops_per_s(flops[w], best[(mode, w, name, lay)])
                                    for w in (d, dv) for lay in layouts}
                            pair, sq = rate[(dv, layout)], rate[(d, layout)]
                            line.append(f"{mode} square {sq:6.1f} pair {pair:6.1f} ratio {pair / sq:.3f}"
                                        + (f" varlen/padded {pair / rate[(dv, 'padded')]:.3f}"
                                           if layout == "varlen" else ""))
                        print("  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
