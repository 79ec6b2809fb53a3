"""The backward's launches timed apart: the preprocess (D = rowsum(dO o O) and the zeroed fp32 dQ accumulator), the
dK/dV kernel, the dQ conversion, and the three as one call (the conversion after the whole kernel, and early: tile by
tile, KernelOptions.hopper_bwd_early_convert), with the Hopper backward's programmatic launches
(KernelOptions.hopper_bwd_programmatic) and without. Timing only: fp16 inputs, a fixed lse, nothing checked.

    python bench/dev/bwd_parts.py                                    # 2k, b = 8: d 64 (32 heads), 96, 128
    python bench/dev/bwd_parts.py --cases 2x8192x16x128 --causal on

A case is BATCHxSEQLENxHEADSxHEADDIM (head dims without a Hopper row run at the width the library picks). Each
figure is the median over --repeats of a 5-launch mean, in microseconds; "main alone" launches the dK/dV kernel back
to back, so with programmatic launches each overlaps the one before (its start and its last wave).
"""

from __future__ import annotations

import argparse
import sys

from fa2cupy import backward, configs
from fa2cupy.options import KernelOptions
from fa2cupy_bench import harness as B


def time_us(fn, repeats: int) -> float:
    return B.time_gpu(fn, B.CupyEvents(), warmup=3, repeats=repeats, batch=5).median_ms * 1000


def run_case(cp, batch: int, seqlen: int, heads: int, headdim: int, causal: bool, programmatic: bool,
             repeats: int) -> str:
    shape = (batch, seqlen, heads, headdim)
    strides = dict.fromkeys(("q", "k", "v", "dout", "out", "dq", "dk", "dv"),
                            (seqlen * heads * headdim, heads * headdim, headdim, 1))
    mask = "causal" if causal else "none"
    plans = {}
    for early in (False, True):  # (the parts timed apart: the plan whose conversion waits for the whole kernel)
        options = KernelOptions(hopper_bwd_programmatic=programmatic, hopper_bwd_early_convert=early)
        width = configs.padded_call_width(90, headdim, "float16", True, mask, seqlen_q=seqlen, options=options)
        plans[early] = backward.plan_backward(shape, shape, strides, "float16", headdim ** -0.5, causal, False, 90,
                                              options=options, width=width)
    plan = plans[False]
    rand = cp.random.default_rng(0)
    q, k, v, out, dout = (rand.standard_normal(shape, dtype=cp.float32).astype(cp.float16) for _ in range(5))
    lse = cp.full((batch, heads, seqlen), 10.0, cp.float32)  # (P = exp(s - 10): small, finite)
    dq, dk, dv = (cp.empty_like(q) for _ in range(3))
    dsum, accum = cp.empty(plan.dsum_shape, cp.float32), cp.empty(plan.dq_accum_shape, cp.float32)
    stream = cp.cuda.get_current_stream().ptr
    ptr = {name: x.data.ptr for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout))}
    maps = backward.maps_writer(plan, ptr["q"], ptr["k"], ptr["v"], ptr["dout"], accum.data.ptr)
    main_args = (ptr["q"], ptr["k"], ptr["v"], ptr["dout"], lse.data.ptr, dsum.data.ptr, accum.data.ptr,
                 dk.data.ptr, dv.data.ptr, 0, 0, 0, 0, 7, 0)
    pointers = dict(backward.NO_POINTERS, softmax_lse=lse.data.ptr, dsum=dsum.data.ptr, dq_accum=accum.data.ptr,
                    dq=dq.data.ptr, dk=dk.data.ptr, dv=dv.data.ptr, **ptr)

    def pre():
        plan.preprocess(stream, (ptr["dout"], ptr["out"], dsum.data.ptr, accum.data.ptr, 0))

    def dkdv():
        plan.main(stream, main_args, maps)

    def convert():
        plan.convert(stream, (accum.data.ptr, dq.data.ptr, 0, 0))

    def call(early):
        return lambda: backward.run_backward(plans[early], pointers, (7, 0), stream)

    t = {name: time_us(fn, repeats) for name, fn in (("pre", pre), ("main", dkdv), ("convert", convert),
                                                         ("call", call(False)), ("early", call(True)))}
    flops = 2.5 * 4 * batch * heads * seqlen * seqlen * headdim / (2 if causal else 1)
    return (f"b{batch} s{seqlen} h{heads} d{headdim} {'causal' if causal else 'full  '} "
            f"{'programmatic' if programmatic else 'plain       '}: preprocess {t['pre']:7.1f}  main alone "
            f"{t['main']:8.1f}  conversion {t['convert']:6.1f}  call {t['call']:8.1f} us, with the early "
            f"conversion {t['early']:8.1f} us | call {flops / t['call'] / 1e6:4.0f} / {flops / t['early'] / 1e6:4.0f} "
            f"TFLOPs/s, preprocess + conversion {(t['pre'] + t['convert']) / t['call'] * 100:.1f}%")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="8x2048x32x64,8x2048x21x96,8x2048x16x128")
    p.add_argument("--causal", choices=["both", "on", "off"], default="both")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    import cupy as cp

    for spec in args.cases.split(","):
        batch, seqlen, heads, headdim = (int(x) for x in spec.split("x"))
        for causal in B.causal_options(args.causal):
            for programmatic in (True, False):
                print(run_case(cp, batch, seqlen, heads, headdim, causal, programmatic, args.repeats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
