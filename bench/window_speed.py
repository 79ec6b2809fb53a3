"""Sliding-window speed: a (4096, 0) window over 64k tokens against full causal attention over the same tokens
(target: >= 8x faster), forward and backward, fp16, 16 heads of 128.

    python bench/window_speed.py [--seqlen 65536] [--window 4096] [--rounds 5] [--sustain 2] [--candidates]
    (from the repository root, after ``pip install -e .``: the harness is the installed package ``fa2cupy_bench``)

Same timer as ``fa2cupy bench`` (CUDA events per call, calls back to back, median), in rounds that time the
causal and the window runs back to back; the speed-ups are the ratios of the medians over rounds. Each timing
follows ``--sustain`` seconds of the same call back to back (default 2; 0 for short bursts), so that each run is
timed at its own steady clock: at the power cap a window run timed straight after a lighter load reads up to 10%
fast (docs/design.md, "How figures are measured"). With ``--candidates`` the
window forward and backward are also timed on each tile of WINDOW_FORWARD_CANDIDATES / WINDOW_BACKWARD_CANDIDATES
in bench/dev/candidates.py (checked against the shipped rows' results first), as speed-ups over the same full
causal runs.
"""

import argparse
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import cupy

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402
from fa2cupy_bench import harness as B  # noqa: E402
from fa2cupy import backward, forward  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "dev"))
import candidates  # noqa: E402  (bench/dev/candidates.py: the window tile candidates)


def launches(q, k, v, dout, window):
    """The backward's three launches for one call, each a function: (what they use, kept alive; preprocess, dK/dV
    with the dQ reductions, dQ conversion)."""
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=True, window_size=window, return_attn_probs=True)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    strides = {n: tuple(s // x.itemsize for s in x.strides)
               for n, x in zip(("q", "k", "v", "dout", "out", "dq", "dk", "dv"), (q, k, v, dout, out, *grads))}
    plan = backward.plan_backward(q.shape, k.shape, strides, str(q.dtype), q.shape[-1] ** -0.5, True, False,
                                  int(cupy.cuda.Device().compute_capability), window_size=window)
    dsum = cupy.empty(plan.dsum_shape, cupy.float32)
    dq_accum = cupy.empty(plan.dq_accum_shape, cupy.float32)
    stream = cupy.cuda.get_current_stream().ptr
    keep = SimpleNamespace(plan=plan, out=out, lse=lse, grads=grads, dsum=dsum, dq_accum=dq_accum)
    # Each launch's per-call fields by name (build.Launch.per_call), as backward.run_backward fills them; 0 where
    # not given: no varlen, ALiBi or dropout.
    fields = {name: x.data.ptr for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out), ("lse", lse),
                                               ("dsum", dsum), ("dq_accum", dq_accum), ("dq", grads[0]),
                                               ("dk", grads[1]), ("dv", grads[2]))}

    def call(launch, *maps):
        values = tuple(fields.get(name.rpartition(".")[2], 0) for name in launch.per_call)
        return lambda: launch(stream, values, *maps)

    pre, conv = call(plan.preprocess), call(plan.convert)
    main = call(plan.main, backward.maps_writer(plan, fields["q"], fields["k"], fields["v"], fields["dout"],
                                                      fields["dq_accum"]))
    return keep, pre, main, conv


def time_candidate(name, launch, results, shipped, tol, full_causal_ms, events):
    """Checks a candidate launch's (NaN-poisoned) results against the shipped kernels' within ``tol``, then times
    it and prints its speed-up over the full causal run."""
    for x in results:
        x.fill(float("nan"))
    launch()
    diff = max(float(cupy.abs(x.astype(cupy.float32) - y.astype(cupy.float32)).max()) for x, y in zip(results, shipped))
    if not diff <= tol:
        print(f"candidate {name}: WRONG (max |result - shipped| = {diff})", flush=True)
        return
    ms = B.time_gpu(launch, events, warmup=3, repeats=10).median_ms
    print(f"candidate {name}: window {ms:.2f} ms, speed-up over full causal {full_causal_ms / ms:.2f}x "
          f"(max |result - shipped| = {diff:.1e})", flush=True)


def breakdown(name, q, k, v, dout, window, events):
    """Times the backward's launches one by one: the O(N) passes (preprocess, dQ conversion) do not shrink with the
    window, the dK/dV kernel does."""
    _keep, *each = launches(q, k, v, dout, window)
    times = {n: B.time_gpu(f, events, warmup=2, repeats=10).median_ms
             for n, f in zip(("preprocess", "dK/dV + dQ reductions", "dQ conversion"), each)}
    total = sum(times.values())
    print(f"{name} backward by launch: " + ", ".join(f"{n} {t:.3f} ms ({100 * t / total:.1f}%)"
                                                      for n, t in times.items()), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=65536)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="alternating causal/window timing rounds")
    parser.add_argument("--sustain", type=float, default=2.0,
                        help="seconds of back-to-back calls before each timing, so that each run is timed at the "
                             "clock its own load settles to (fa2cupy_bench.harness.sustain), not the one before it")
    parser.add_argument("--candidates", action="store_true", help="also time the window tile candidates (bench/dev/candidates.py)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the backward's launches one by one (preprocess, dK/dV, dQ conversion)")
    args = parser.parse_args()
    rng = cupy.random.default_rng(0)
    shape = (1, args.seqlen, args.heads, args.headdim)
    q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    events = B.CupyEvents()
    cases = (("causal", (-1, -1)), (f"window ({args.window}, 0)", (args.window, 0)))
    runs = {}
    for name, window in cases:
        out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=True, window_size=window, return_attn_probs=True)
        runs[name] = (lambda w=window: fa2cupy.flash_attn_func(q, k, v, causal=True, window_size=w),
                      lambda w=window, o=out, l=lse: fa2cupy.flash_attn_backward(dout, q, k, v, o, l, causal=True,
                                                                                window_size=w))
    # Rounds that take turns (causal, window, causal, window, ...): a 7 ms window run and a 52 ms causal run
    # timed minutes apart see different clocks (the window forward moves by +-5% between runs), so each round
    # times both back to back, and the bar is read from the medians over rounds.
    times = {name: ([], []) for name, _ in cases}
    for r in range(args.rounds):
        for name, _ in cases:
            for kind in (0, 1):
                times[name][kind].append(B.time_gpu(runs[name][kind], events, warmup=2, repeats=10,
                                                    sustain_seconds=args.sustain).median_ms)
        (cf, cb), (wf, wb) = ((times[n][0][-1], times[n][1][-1]) for n, _ in cases)
        print(f"round {r + 1}: causal {cf:.2f} / {cb:.2f} ms, window {wf:.2f} / {wb:.2f} ms (fwd / bwd): "
              f"speed-up {cf / wf:.2f}x / {cb / wb:.2f}x", flush=True)
    med = {name: tuple(statistics.median(t) for t in times[name]) for name, _ in cases}
    for name, _ in cases:
        print(f"{name}: forward {med[name][0]:.2f} ms, backward {med[name][1]:.2f} ms (median of "
              f"{args.rounds} rounds)", flush=True)
    (cf, cb), (wf, wb) = med.values()
    print(f"speed-up of the window over full causal, seqlen {args.seqlen}: forward {cf / wf:.2f}x, "
          f"backward {cb / wb:.2f}x (bar: >= 8x)", flush=True)
    if args.breakdown:
        for name, window in (("causal", (-1, -1)), (f"window ({args.window}, 0)", (args.window, 0))):
            breakdown(name, q, k, v, dout, window, events)
    if not args.candidates:
        return
    window = (args.window, 0)
    shipped = fa2cupy.flash_attn_func(q, k, v, causal=True, window_size=window)
    out = cupy.empty_like(q)
    lse = cupy.empty((1, args.heads, args.seqlen), cupy.float32)
    arch = int(cupy.cuda.Device().compute_capability)
    stream = cupy.cuda.get_current_stream()
    strides = tuple(tuple(s // x.itemsize for s in x.strides) for x in (q, k, v, out))
    for config in candidates.WINDOW_FORWARD_CANDIDATES.get(args.headdim, ()):
        plan = forward.plan_forward(q.shape, k.shape, strides, "float16", args.headdim ** -0.5, True, arch,
                                    config=config, window_size=window)
        pointers = dict(forward.NO_POINTERS, q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, out=out.data.ptr,
                        softmax_lse=lse.data.ptr)
        launch = lambda: forward.run_forward(plan, pointers, (0, 0), stream.ptr)  # noqa: E731
        time_candidate(f"forward {config.block_m}x{config.block_n} {config.warps} warps {config.min_blocks} "
                       f"blocks/SM", launch, (out,), (shipped,), 1e-2, cf, events)
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=True, window_size=window, return_attn_probs=True)
    shipped = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=True, window_size=window)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    grad_strides = {n: tuple(s // x.itemsize for s in x.strides)
                    for n, x in zip(("q", "k", "v", "dout", "out", "dq", "dk", "dv"), (q, k, v, dout, out, *grads))}
    for config in candidates.WINDOW_BACKWARD_CANDIDATES.get(args.headdim, ()):
        plan = backward.plan_backward(q.shape, k.shape, grad_strides, "float16", args.headdim ** -0.5, True, False,
                                      arch, config=config, window_size=window)
        dsum = cupy.empty(plan.dsum_shape, cupy.float32)
        dq_accum = cupy.empty(plan.dq_accum_shape, cupy.float32)
        pointers = dict(backward.NO_POINTERS, q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, dout=dout.data.ptr,
                        out=out.data.ptr,
                        softmax_lse=lse.data.ptr, dq=grads[0].data.ptr, dk=grads[1].data.ptr, dv=grads[2].data.ptr,
                        dsum=dsum.data.ptr, dq_accum=dq_accum.data.ptr)
        time_candidate(f"backward {config.block_m}x{config.block_n} {config.warps} warps ({config.warps_keys} "
                       f"along keys)", lambda: backward.run_backward(plan, pointers, (0, 0), stream.ptr), grads,
                       shipped, 5e-2, cb, events)


if __name__ == "__main__":
    main()
