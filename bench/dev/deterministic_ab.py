"""What deterministic=True costs: the backward with and without it on the same inputs, in rounds taking turns
(CUDA events, median of --repeats after warm-up; a figure is its best round), bf16, 16k tokens per batch.

    python bench/dev/deterministic_ab.py                                  # d = 64 (MHA and GQA 32/8), 128, 256
    python bench/dev/deterministic_ab.py --cases 128:16:16 --seqlens 8192 --causal on

Cases are HEADDIM:NHEADS:NHEADS_KV. Prints TFLOPs/s (2.5x the forward's FLOPs) of each mode and their ratio.
--varlen runs the same tokens packed as batch sequences of seqlen (flash_attn_varlen_backward); --mods softcap or
alibi gives every call that score modifier (options_ab.py's: softcap 30, ALiBi slopes in [0, 0.1)).
"""

from __future__ import annotations

import argparse
import sys

from fa2cupy_bench import harness as B
from options_ab import modifier_kwargs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="64:32:32,128:16:16,64:32:8,256:8:8", help="HEADDIM:NHEADS:NHEADS_KV, ...")
    p.add_argument("--seqlens", default="2048,8192")
    p.add_argument("--causal", choices=["both", "on", "off"], default="both")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--varlen", action="store_true", help="the batch packed as varlen sequences")
    p.add_argument("--mods", default="none", choices=["none", "softcap", "alibi"])
    args = p.parse_args(argv)
    for spec in args.cases.split(","):
        d, h, hkv = (int(x) for x in spec.split(":"))
        for s in B.parse_int_list(args.seqlens):
            for causal in B.causal_options(args.causal):
                case = B.Case(batch=16384 // s, seqlen_q=s, seqlen_k=s, nheads=h, nheads_kv=hkv, headdim=d,
                              causal=causal)
                inp = B.make_forward_inputs(case, 0, "torch")
                dout = B._random_like(inp.q, 1)
                kw = modifier_kwargs(args.mods, h)  # (one set of ALiBi slopes for both modes)
                runners = {det: B.fa2cupy_backward_runner(inp, dout, deterministic=det, varlen=args.varlen, **kw)
                           for det in (False, True)}
                best = {}
                for _ in range(args.rounds):
                    for det, r in runners.items():
                        with r.context():
                            ms = B.time_gpu(r.fn, r.events, warmup=5, repeats=args.repeats).median_ms
                        best[det] = min(best.get(det, float("inf")), ms)
                flops = B.attention_flops(case, "bwd")
                label = " ".join([case.label] + ["varlen"] * args.varlen + [args.mods] * (args.mods != "none"))
                print(f"{label:44s} default {B.tflops_per_s(flops, best[False]):6.1f}  deterministic "
                      f"{B.tflops_per_s(flops, best[True]):6.1f}  ratio {best[False] / best[True]:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
