"""fa2cupy under several KernelOptions beside SDPA cuDNN and flash, forward and backward, in rounds taking turns:
whether one kernel row beats another (e.g. the Hopper kernels against the mma.sync ones).

    python bench/dev/options_ab.py --headdim 192,256 --seqlens 2048,8192 \
        --options default= mma=hopper_forward=0,hopper_backward=0 [--modes fwd,bwd] [--rounds 2]
    python bench/dev/options_ab.py --headdim 128,256 --mods none,softcap,alibi   # what the modifiers cost

Cases are the bench grid's (16k tokens, nheads = --hidden / headdim, --group of them per kv head, bf16, causal and
not). Each round times every implementation once (CUDA events, median of --repeats after warm-up); an
implementation's figure is its best round (--sustain S: each timed after S seconds of its own calls back to back,
at the clock its load settles to). Every option set's result is compared with the first's (max |difference| / max
|first|) before timing.
--mods times each option set with each modifier (softcap 30, ALiBi slopes in [0, 0.1), dropout 0.1 with a fixed
seed): rows NAME+MOD; with dropout SDPA's backends too (cudnn+dropout, flash+dropout).
--varlen runs fa2cupy's calls on the same tokens packed as batch sequences of seqlen (flash_attn_varlen_func and
flash_attn_varlen_backward; SDPA stays on the padded batch), e.g. the backward's dQ conversion early and late:

    python bench/dev/options_ab.py --varlen --modes bwd --headdim 64,128 --seqlens 1024,2048,8192 \
        --options default= early=hopper_bwd_early_convert=1 late=hopper_bwd_early_convert=0
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import fa2cupy
from fa2cupy_bench import harness as B


DROPOUT_P = 0.1  # (--mods dropout: fa2cupy's and SDPA's)


def modifier_kwargs(mod: str, nheads: int) -> dict:
    torch = B._torch()
    if mod == "softcap":
        return {"softcap": 30.0}
    if mod == "alibi":
        return {"alibi_slopes": torch.rand(nheads, device="cuda", dtype=torch.float32) * 0.1}
    if mod == "dropout":
        return {"dropout_p": DROPOUT_P, "dropout_seed": 1234}
    return {}


def runners(inp, mode: str, option_sets: dict, dout, dout_t, mods=("none",), varlen: bool = False):
    c = inp.case.causal
    q, k, v = inp.q, inp.k, inp.v
    if varlen:
        q, k, v, dout, fwd_fn, bwd_fn = B.packed_varlen(q, k, v, dout)
    else:
        fwd_fn, bwd_fn = fa2cupy.flash_attn_func, fa2cupy.flash_attn_backward
    made = {}
    mod_kw = {mod: modifier_kwargs(mod, inp.case.nheads) for mod in mods}  # (one set of slopes for every row)
    stream = B._external_stream_ctx()  # (fa2cupy on torch's stream, so that torch's events bracket it)
    for (name, opts), mod in ((o, m) for o in option_sets.items() for m in mods):
        kw = dict(causal=c, kernel_options=opts, **mod_kw[mod])
        name = name if mod == "none" else f"{name}+{mod}"
        if mode == "fwd":
            fn = functools.partial(fwd_fn, q, k, v, **kw)
        else:
            with stream():
                out, lse, _ = fwd_fn(q, k, v, return_attn_probs=True, **kw)
            fn = functools.partial(bwd_fn, dout, q, k, v, out, lse, **kw)
        made[name] = B.Runner(fn, B.TorchEvents(), stream)
    for sdpa, backend in (("cudnn", "CUDNN_ATTENTION"), ("flash", "FLASH_ATTENTION")):
        # (with dropout among the modifiers, SDPA's own dropout too, the same p: what it costs the peer)
        for name, p in ((sdpa, 0.0),) + (((f"{sdpa}+dropout", DROPOUT_P),) if "dropout" in mods else ()):
            try:
                made[name] = (B._sdpa_runner(inp, backend, dropout_p=p) if mode == "fwd"
                              else B._sdpa_backward_runner(inp, dout_t, backend, dropout_p=p))
            except B.Unavailable as exc:
                print(f"  {name}: {exc}")
    return made


def max_rel_diff(a, b) -> float:
    torch = B._torch()
    a, b = (a,) if not isinstance(a, tuple) else a, (b,) if not isinstance(b, tuple) else b
    return max(float((x.float() - y.float()).abs().max()) / max(1e-6, float(y.float().abs().max()))
               for x, y in zip(a, b) if torch.is_tensor(x))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--headdim", default="192,256")
    p.add_argument("--seqlens", default="2048,8192")
    p.add_argument("--causal", choices=["both", "on", "off"], default="both")
    p.add_argument("--modes", default="fwd,bwd")
    p.add_argument("--options", nargs="+", default=["default=", "mma=hopper_forward=0,hopper_backward=0"])
    p.add_argument("--mods", default="none", help="comma-separated: none, softcap, alibi, dropout (p = 0.1)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--group", type=int, default=1, help="query heads per key/value head (GQA)")
    p.add_argument("--hidden", type=int, default=2048, help="model width: nheads = hidden // headdim")
    p.add_argument("--varlen", action="store_true", help="fa2cupy's calls on the batch packed as varlen sequences")
    p.add_argument("--sustain", type=float, default=0.0,
                   help="seconds of back-to-back calls before each implementation's timed ones, so that each is "
                        "timed at the clock its own load settles to")
    p.add_argument("--json")
    args = p.parse_args(argv)
    option_sets = dict(B.named_kernel_options(t) for t in args.options)
    first = next(iter(option_sets))
    rows = []
    for mode in args.modes.split(","):
        for d in B.parse_int_list(args.headdim):
            for s in B.parse_int_list(args.seqlens):
                for causal in B.causal_options(args.causal):
                    case = B.Case(batch=16384 // s, seqlen_q=s, seqlen_k=s, nheads=args.hidden // d,
                                  nheads_kv=args.hidden // d // args.group,
                                  headdim=d, causal=causal, dtype="bf16")
                    inp = B.make_forward_inputs(case, 0, "torch")
                    dout = B._random_like(inp.q, 1)
                    dout_t = dout.transpose(1, 2).contiguous()
                    mods = args.mods.split(",")
                    made = runners(inp, mode, option_sets, dout, dout_t, mods, args.varlen)
                    diffs = {}
                    for mod in mods:  # (each modifier's rows against its first option set's)
                        ref = None
                        for name in option_sets:
                            name = name if mod == "none" else f"{name}+{mod}"
                            with made[name].context():
                                got = made[name].fn()
                            ref = got if ref is None else ref
                            diffs[name] = max_rel_diff(got, ref)
                    best: dict[str, float] = {}
                    for _ in range(args.rounds):
                        for name, r in made.items():
                            with r.context():
                                t = B.time_gpu(r.fn, r.events, warmup=3, repeats=args.repeats,
                                               sustain_seconds=args.sustain)
                            best[name] = min(best.get(name, float("inf")), t.median_ms)
                    flops = B.attention_flops(case, mode)
                    tf = {n: B.tflops_per_s(flops, ms) for n, ms in best.items()}
                    label = case.label + (" varlen" if args.varlen else "")
                    row = {"mode": mode, "label": label, "tflops": tf, "diff_vs_" + first: diffs}
                    rows.append(row)
                    ratios = "  ".join(f"{n}/cudnn {tf[n] / tf['cudnn']:.2f}" for n in option_sets if "cudnn" in tf)
                    ratios += "".join(f"  {n}/{n.split('+')[0]} {tf[n] / tf[n.split('+')[0]]:.2f}" for n in tf
                                      if "+" in n and n.split("+")[0] in tf)
                    print(f"{mode} {label:30s} " + " ".join(f"{n} {v:6.1f}" for n, v in tf.items()) +
                          f"  | {ratios}  | diff {max(diffs.values()):.1e}", flush=True)
                    del made, inp, dout, dout_t
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
