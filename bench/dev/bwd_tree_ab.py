"""A/B timing of backward kernel sources: the same backward calls built from several copies of cuda/ (say, HEAD's
sources unpacked by `git archive` beside the edited ones), timed in turns within one process, as tree_ab.py does for
the forward (each variant run back to back for --sustain seconds before its timed calls, and each round starting at
the next variant). Each variant keeps its best round's median; dQ, dK and dV are compared with the first variant's.

    mkdir -p ab_trees/base && git archive HEAD cuda | tar -x -C ab_trees/base
    python bench/dev/bwd_tree_ab.py --trees base=ab_trees/base/cuda new=cuda --cases bwd80:none:8192 bwd128:causal:2048

A tree may name the Hopper dQ accumulator's pad after an @ (``new8=path/cuda@pad=8``: rows of head dim + 8 floats,
for sources whose HopperBwdTraits::kDqPitch differs from this package's configs.HopperBwdConfig.dq_pitch): its calls
are planned with that pitch.

A case is ``bwd<d>:<mask>:<seqlen>[:det][:softcap][:alibi][:dropout][:varlen][:v<d_v>]`` with mask none or causal,
``det`` for deterministic=True, ``v<d_v>`` for v (and dout, out) of a head dim of their own (192 / 128:
``bwd192:none:8192:v128``), ``softcap`` for a softcap of 30, ``alibi`` for ALiBi slopes in [0, 0.1), ``dropout`` for
dropout_p = 0.1 (a fixed seed), ``varlen`` for the batch packed as varlen sequences of the seqlen
(flash_attn_varlen_backward's kernels); bf16, 16k tokens per batch, 2048 / d heads (head dims without a Hopper row
at the width the library picks). The kernel parameter structs are this package's: a tree must take the same fields,
or a prefix of them (a field added at a struct's end is ignored by sources that do not read it). Timing: random q,
k, v and dO with a fixed lse (P = exp(logit - 10 - softcap), small and finite), so nothing is checked against a
reference: run the GPU tests for that.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cupy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fa2cupy_bench import harness as B  # noqa: E402
from fa2cupy import arrays, backward, build, configs  # noqa: E402
from fa2cupy.options import KernelOptions  # noqa: E402

SOFTCAP = 30.0
DROPOUT_P, DROPOUT_SEED = 0.1, (1234, 0)  # (the seed and offset of every dropout call)
DEFAULT_CASES = ("bwd64:none:2048", "bwd80:none:8192", "bwd96:none:8192", "bwd128:none:8192", "bwd128:causal:2048")


def parse_case(case: str):
    """(head dim, causal, seqlen, deterministic, softcap, alibi, dropout_p, varlen, v's head dim) of
    ``bwd<d>:<mask>:<seqlen>[:det][:softcap][:alibi][:dropout][:varlen][:v<d_v>]``."""
    fields = case.split(":")
    own_v = [f for f in fields[3:] if f[:1] == "v" and f[1:].isdigit()]
    extra = set(fields[3:]) - set(own_v)
    if (not fields[0].startswith("bwd") or len(fields) < 3 or fields[1] not in ("none", "causal")
            or not extra <= {"det", "softcap", "alibi", "dropout", "varlen"} or len(own_v) > 1):
        raise SystemExit(f"{case}: expected bwd<d>:none|causal:<seqlen>[:det][:softcap][:alibi][:dropout][:varlen]"
                         "[:v<d_v>]")
    softcap = SOFTCAP if "softcap" in extra else 0.0
    d = int(fields[0][3:])
    return (d, fields[1] == "causal", int(fields[2]), "det" in extra, softcap, "alibi" in extra,
            DROPOUT_P if "dropout" in extra else 0.0, "varlen" in extra, int(own_v[0][1:]) if own_v else d)


def shape_of(d: int, seqlen: int):
    return max(1, 16384 // seqlen), seqlen, 2048 // d, d


def plans_for(tree: str, cases):
    """Each case planned against the kernels of the sources in ``tree`` (compiled now, kept by the plans)."""
    tree, _, extra = tree.partition("@")
    build.use_sources(tree)
    plans = {}
    own_pitch = configs.HopperBwdConfig.__dict__["dq_pitch"]  # (the staticmethod itself, to put back)
    if extra:
        pad = int(extra.removeprefix("pad="))
        configs.HopperBwdConfig.dq_pitch = staticmethod(lambda headdim: headdim + pad)
    try:
        for case in cases:
            plans[case] = plan_case(case)
    finally:
        configs.HopperBwdConfig.dq_pitch = own_pitch
    return plans


def plan_case(case: str):
    d, causal, seqlen, det, softcap, alibi, dropout_p, varlen, dv = parse_case(case)
    shape = shape_of(d, seqlen)
    # (varlen: (batch * seqlen, heads, d) arrays, the batch stride unused; v, dout and out at v's head dim, the
    # gradients at the wider of the two)
    strides = {name: (0 if varlen else shape[1] * shape[2] * w, shape[2] * w, w, 1)
               for names, w in ((("q", "k", "dq", "dk", "dv"), max(d, dv)), (("v", "dout", "out"), dv))
               for name in names}
    mask = "causal" if causal else "none"
    mods = bool(softcap) or alibi or dropout_p > 0
    width = configs.padded_call_width(90, d, "bfloat16", True, mask, mods, varlen, seqlen_q=seqlen,
                                      options=KernelOptions(), dropout=dropout_p > 0)
    totals = (shape[0] * seqlen,) * 2 if varlen else None
    return backward.plan_backward(shape, shape, strides, "bfloat16", d ** -0.5, causal, det, 90, width=width,
                                  softcap=softcap, alibi_batch_stride=0 if alibi else None, varlen_totals=totals,
                                  dropout_p=dropout_p, headdim_v=None if dv == d else dv)


def main():
    parser = argparse.ArgumentParser()
    B.add_tree_arguments(parser, "name=path/to/cuda[@pad=N] ...", DEFAULT_CASES, rounds=3, repeats=10,
                         sustain_seconds=1.0)
    args = parser.parse_args()
    trees = B.trees_of(args.trees)
    variants = {name: plans_for(path, args.cases) for name, path in trees.items()}
    rng = cupy.random.default_rng(1)
    stream = cupy.cuda.get_current_stream()
    bits = lambda shape: arrays.bf16_bits(cupy, rng.standard_normal(shape, dtype=cupy.float32))  # noqa: E731
    for case in args.cases:
        d, causal, seqlen, det, softcap, alibi, dropout_p, varlen, dv = parse_case(case)
        seed = DROPOUT_SEED if dropout_p else (0, 0)
        shape = shape_of(d, seqlen)
        v_shape = shape[:3] + (dv,)
        q, k = bits(shape), bits(shape)
        v, out, dout = (bits(v_shape) for _ in range(3))
        slopes = rng.uniform(0, 0.1, shape[2], dtype=cupy.float32) if alibi else None
        # (P = exp(logit - lse): small and finite, the softcap's logits up to 30; varlen: (heads, total) rows)
        lse_shape = (shape[2], shape[0] * seqlen) if varlen else shape[:1] + shape[2:3] + shape[1:2]
        lse = cupy.full(lse_shape, 10.0 + softcap, cupy.float32)
        cu = cupy.arange(0, (shape[0] + 1) * seqlen, seqlen, dtype=cupy.int32)
        outs, best = {}, {}
        calls = {}
        for name, plans in variants.items():
            plan = plans[case]
            grads = [cupy.full(shape[:3] + (max(d, dv),), 0x7FC0, cupy.uint16) for _ in range(3)]  # NaN
            dsum = cupy.empty(plan.dsum_shape, cupy.float32)
            accum = cupy.empty(plan.dq_accum_shape or (1,), cupy.float32)  # (None: the plan takes none, as 0)
            pointers = dict(backward.NO_POINTERS, q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, out=out.data.ptr,
                            dout=dout.data.ptr, softmax_lse=lse.data.ptr, dsum=dsum.data.ptr,
                            dq_accum=accum.data.ptr if plan.dq_accum_shape else 0, dq=grads[0].data.ptr,
                            dk=grads[1].data.ptr, dv=grads[2].data.ptr, alibi_slopes=0 if slopes is None else slopes.data.ptr,
                            cu_seqlens_q=cu.data.ptr if varlen else 0, cu_seqlens_k=cu.data.ptr if varlen else 0)
            calls[name] = (lambda plan=plan, pointers=pointers: backward.run_backward(plan, pointers, seed,
                                                                                         stream.ptr))
            calls[name]()
            outs[name] = [arrays.bf16_bits_to_float(cupy, g) for g in grads]
            calls[name].keep = (grads, dsum, accum, slopes)
        first = next(iter(outs.values()))
        diffs = {name: max(float(cupy.abs(a - b).max()) for a, b in zip(o, first)) for name, o in outs.items()}
        names = list(calls)
        for r in range(args.rounds):  # (each round starts at the next variant: none is always timed first)
            for name in names[r % len(names):] + names[:r % len(names)]:
                ms = B.time_gpu(calls[name], B.CupyEvents(), warmup=3, repeats=args.repeats,
                                sustain_seconds=args.sustain).median_ms
                best[name] = min(best.get(name, ms), ms)
        flops = 2.5 * 2 * shape[0] * shape[2] * seqlen * seqlen * (d + dv) / (2 if causal else 1)
        base = next(iter(best.values()))
        print(f"{case:22s} " + "  ".join(f"{name} {flops / ms / 1e9:6.1f} TFLOPs/s ({base / ms:5.3f}x, "
                                          f"max|diff| {diffs[name]:.2g})" for name, ms in best.items()), flush=True)


if __name__ == "__main__":
    main()
