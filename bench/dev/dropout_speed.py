"""What dropout costs on the mma.sync kernels: forward and backward with and without it, in one process.

    python bench/dev/dropout_speed.py                      # d 64/128 x 8k (batch 2) / 32k (batch 1) x causal or not
    python bench/dev/dropout_speed.py --dtype both --p 0.1 --rounds 3 --json /tmp/dropout.json
    python bench/dev/dropout_speed.py --baseline /tmp/base/cuda   # also time an older copy of cuda/ (see below)

Every call runs on the mma.sync kernel family, the one dropout calls run on (``use_mma_sync_kernels``: the Hopper
kernels off), so that each row's "plain" is the same call without dropout on the same family. Hidden size 2048
(32 heads of 64, 16 of 128). Rows, per case and direction:

  plain    no dropout
  drop     dropout_p = P: the bar is drop / plain >= 0.8 at 8k and 32k, d 64 and 128, causal and not
  variant  no dropout, on the kernel that dropout runs on (the modifier variant, switched on by ALiBi slopes of
           zero, which then change nothing): drop / variant is dropout's own cost, variant / plain the variant's
           (its modifier code; non-causal calls: the window mask's run-time bounds)
  softcap  (with --softcap) softcap 30, no dropout: the other calls of the modifier variant, whose code dropout's
           changes share
  base     with --baseline DIR (a copy of an older cuda/, e.g. ``git archive 9573e27 cuda | tar -x -C /tmp/base``):
           dropout_p = P on those kernels, in the same rounds (older kernels read the keep threshold as a 16-bit
           one, so they drop nearly everything; their time does not depend on what they drop); with --softcap also
           softcap-base, the softcap row on them

The rows of a case are timed in alternating rounds (CUDA events around each call, median of all samples), so clock
drift (an H200 at its power limit) hits them alike. The kernels every case needs are compiled first, in parallel.
Prints one table per direction: TFLOPs/s (FlashAttention's convention: backward = 2.5x forward FLOPs, half for
causal) and each row's ratio to plain. About a minute on an H200 with bf16 alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

HIDDEN = 2048
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
SHORT = {v: k for k, v in DTYPES.items()}
CASES = ("d128:8k:causal", "d128:8k:none", "d128:32k:causal", "d128:32k:none",
         "d64:8k:causal", "d64:8k:none", "d64:32k:causal", "d64:32k:none")


def use_mma_sync_kernels():
    """The KernelOptions that put every call on the mma.sync family (the Hopper kernels off). The one place that
    knows how the kernel family is chosen."""
    from fa2cupy.options import KernelOptions

    return KernelOptions(hopper_forward=False, hopper_backward=False)


#: Set by main(): the options every call passes.
OPTIONS = None


class Setup:
    """Kernel sources (None: the package's own), so that rows built from different copies of cuda/ are timed in
    alternating rounds: activate() makes its kernels the ones calls use (and drops the plans made under another
    setup)."""

    def __init__(self, directory=None):
        self.directory = directory

    def activate(self, active: list) -> None:
        from fa2cupy import build, pipeline

        if active and active[0] is self:
            return
        pipeline.forget_plans()
        if not active or active[0].directory != self.directory:
            build.use_sources(self.directory)
        active[:] = [self]


def parse_case(text: str) -> tuple[int, int, int, bool]:
    """'d128:8k:causal' -> (headdim, seqlen, batch, causal): batch 2 at 8k, 1 at 32k (the same tokens per step)."""
    d, length, mask = text.split(":")
    seqlen = int(length.rstrip("k")) * 1024
    return int(d.lstrip("d")), seqlen, max(1, 16384 // seqlen), mask == "causal"


def flops(batch: int, seqlen: int, nheads: int, d: int, causal: bool, direction: str) -> float:
    f = 4.0 * batch * nheads * seqlen * seqlen * d * (0.5 if causal else 1.0)
    return f * (2.5 if direction == "bwd" else 1.0)


def kernels_needed(cases, dtypes, p: float, arch: int, plain: bool = True) -> list[tuple[str, str, int]]:
    """(family, name expression, shared memory) of every kernel the rows run (with `plain`, the plain kernels too),
    for the parallel compile."""
    from fa2cupy import configs, forward

    needed = set()
    for d, seqlen, _, causal in cases:
        for dtype in dtypes:
            tag = configs.DTYPE_TAGS[dtype]
            # no dropout, dropout, and the variant (whose kernel the softcap rows share)
            for dropout_p, alibi in ((0.0, False), (p, False), (0.0, True)) if plain else ((p, False),):
                mask, mods, _, _ = forward.kernel_variant(causal, (-1, -1), 0.0, alibi, dropout_p, causal_mods=True)
                fc = forward.kernel_config(arch, d, dtype, mask, mods, False, seqlen, options=OPTIONS,
                                           dropout=dropout_p > 0)
                needed.add((fc.family, fc.name_expression(dtype, mask, mods), fc.smem_bytes))
                bc = configs.backward_config(arch, d, dtype, mask, mods)
                needed.add((bc.family, bc.name_expression(dtype, mask, True, mods), bc.smem_bytes(True)))
            needed.add(("bwd", f"fa2::bwd_preprocess<{tag}>", 0))
            needed.add(("bwd", f"fa2::bwd_convert_dq<{tag}>", 0))
    return sorted(needed)


def compile_all(setup: Setup, needed, active) -> None:
    """Compiles `needed` under `setup` with NVRTC in threads (it releases the GIL): the first calls then find them.
    (A failure here only costs time: the calls compile what they miss.)"""
    import cupy

    from fa2cupy import build

    setup.activate(active)
    device = cupy.cuda.runtime.getDevice()

    def compile_one(kernel):
        cupy.cuda.runtime.setDevice(device)  # (makes the device's context current in this thread)
        build.get_kernel(*kernel)

    try:
        with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
            list(pool.map(compile_one, needed))
    except Exception as error:  # noqa: BLE001
        print(f"(compiling ahead failed, the calls compile instead: {type(error).__name__}: {error})", flush=True)


def time_rows(rows: dict, rounds: int, reps: int) -> dict:
    """{row: (activate, call)} -> {row: median ms}: each round times every row `reps` times, in turn."""
    import cupy

    samples = {name: [] for name in rows}
    for _ in range(rounds):
        for name, (activate, call) in rows.items():
            activate()
            call()  # (a call of the row's own kind first: the GPU settles on its load)
            starts = [cupy.cuda.Event() for _ in range(reps)]
            ends = [cupy.cuda.Event() for _ in range(reps)]
            for start, end in zip(starts, ends):
                start.record()
                call()
                end.record()
            end.synchronize()
            samples[name] += [cupy.cuda.get_elapsed_time(s, e) for s, e in zip(starts, ends)]
    return {name: statistics.median(ms) for name, ms in samples.items()}


def run_case(case, dtype: str, p: float, setups: dict, active: list, rounds: int, reps: int,
             softcap: bool) -> dict:
    import cupy

    import fa2cupy

    d, seqlen, batch, causal = case
    nheads = HIDDEN // d
    rng = np.random.default_rng(0)
    q, k, v, dout = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, d), dtype=np.float32)).astype(dtype)
                     for _ in range(4))
    zeros = cupy.zeros((nheads,), dtype=cupy.float32)
    new = setups["new"]
    new.activate(active)
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, kernel_options=OPTIONS)
    drop = dict(dropout_p=p, dropout_seed=1234, dropout_offset=0)
    rows = {"plain": (new, {}), "drop": (new, drop), "variant": (new, dict(alibi_slopes=zeros))}
    if softcap:
        rows["softcap"] = (new, dict(softcap=30.0))
    if "base" in setups:
        rows["base"] = (setups["base"], drop)
        if softcap:
            rows["softcap-base"] = (setups["base"], dict(softcap=30.0))
    result = {}
    for direction in ("fwd", "bwd"):
        chosen = dict(rows)
        calls = {}
        for name, (setup, kw) in chosen.items():
            if direction == "fwd":
                call = (lambda kw=kw: fa2cupy.flash_attn_func(q, k, v, causal=causal, kernel_options=OPTIONS, **kw))
            else:  # (the undropped out and lse stand in for each row's own: the kernels' time does not depend on them)
                call = (lambda kw=kw: fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=causal,
                                                                  kernel_options=OPTIONS, **kw))
            calls[name] = ((lambda setup=setup: setup.activate(active)), call)
        ms = time_rows(calls, rounds, reps)
        f = flops(batch, seqlen, nheads, d, causal, direction)
        result[direction] = {name: {"ms": t, "tflops": f / (t * 1e-3) / 1e12} for name, t in ms.items()}
    return result


def print_table(results, direction: str) -> None:
    """TFLOPs/s of each row and the ratios that matter: drop/plain (the bar), variant/plain, drop/variant, and
    where timed base/plain (the same call on the older kernels) and softcap/softcap-base."""
    present = {n for rec in results for n in rec["result"][direction]}
    names = [n for n in ("plain", "drop", "variant", "base", "softcap", "softcap-base") if n in present]
    ratios = [(a, b) for a, b in (("drop", "plain"), ("variant", "plain"), ("drop", "variant"),
                                  ("base", "plain"), ("softcap", "softcap-base"))
              if a in present and b in present]
    print(f"{direction:<4} {'case':<26}" + "".join(f"{n:>11}" for n in names) + "".join(
        f"{a + '/' + b:>22}" for a, b in ratios))
    for rec in results:
        r = rec["result"][direction]
        line = f"{'':<4} {rec['label']:<26}" + "".join(
            f"{r[n]['tflops']:>11.1f}" if n in r else f"{'-':>11}" for n in names)
        line += "".join(f"{r[a]['tflops'] / r[b]['tflops']:>22.3f}" if a in r and b in r else f"{'-':>22}"
                        for a, b in ratios)
        bar = r["drop"]["tflops"] / r["plain"]["tflops"]
        print(line + ("" if bar >= 0.85 else "  (< 0.85)" if bar >= 0.8 else "  (BELOW 0.8)"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bf16", "fp16", "both"), default="bf16")
    parser.add_argument("--p", type=float, default=0.1, help="dropout probability [0.1]")
    parser.add_argument("--cases", default=",".join(CASES), help="d<headdim>:<seqlen>k:<causal|none>, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per case [3]")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per row and round [3]")
    parser.add_argument("--baseline", help="a copy of an older cuda/ whose dropout kernels to time as 'base'")
    parser.add_argument("--softcap", action="store_true", help="also time softcap calls (no dropout)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    import cupy

    from fa2cupy import forward

    device = cupy.cuda.Device()
    arch = int(device.compute_capability)
    global OPTIONS
    OPTIONS = use_mma_sync_kernels()
    dtypes = [DTYPES[args.dtype]] if args.dtype != "both" else list(DTYPES.values())
    cases = [parse_case(c) for c in args.cases.split(",")]
    active = []
    setups = {"new": Setup()}
    if args.baseline:
        setups["base"] = Setup(str(Path(args.baseline).resolve()))
    for name, setup in setups.items():
        setup.activate(active)
        compile_all(setup, kernels_needed(cases, dtypes, args.p, arch, plain=name == "new"), active)
    print(f"{cupy.cuda.runtime.getDeviceProperties(device.id)['name'].decode()}, sm_{arch}, dropout_p {args.p} "
          f"(realised {forward.realised_dropout_p(args.p):.6f}), hidden {HIDDEN}, mma.sync kernels, "
          f"{args.rounds} rounds x {args.reps} calls per row", flush=True)
    results = []
    for dtype in dtypes:
        for case, text in zip(cases, args.cases.split(",")):
            d, seqlen, batch, causal = case
            label = f"{text} b{batch} h{HIDDEN // d} {SHORT[dtype]}"
            result = run_case(case, dtype, args.p, setups, active, args.rounds, args.reps, args.softcap)
            results.append({"label": label, "case": text, "dtype": dtype, "batch": batch, "result": result})
            print(f"  {label}: fwd drop/plain {result['fwd']['drop']['tflops'] / result['fwd']['plain']['tflops']:.3f}"
                  f", bwd {result['bwd']['drop']['tflops'] / result['bwd']['plain']['tflops']:.3f}", flush=True)
    print()
    for direction in ("fwd", "bwd"):
        print_table(results, direction)
        print()
    worst = min(rec["result"][dr]["drop"]["tflops"] / rec["result"][dr]["plain"]["tflops"]
                for rec in results for dr in ("fwd", "bwd"))
    print(f"worst drop/plain: {worst:.3f} (bar 0.8, aim 0.85)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": arch, "p": args.p, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
