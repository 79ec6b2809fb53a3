"""A/B timing of kernel sources: the same forward calls built from several copies of cuda/ (say, HEAD's sources
unpacked by `git archive` beside the edited ones), timed in turns within one process so that clock drift and the
machine's spread fall on every variant alike. Each variant keeps its best round's median; outputs are compared
with the first variant's. ``--sustain S`` runs each variant back to back for S seconds before its timed calls: at the
power cap a variant timed straight after a lighter case runs at a higher clock (a 64k window forward read 9.7% apart
between two trees without it, 0.5% with 2 s: docs/design.md, "How figures are measured").

    python bench/dev/tree_ab.py --trees base=ab_trees/base/cuda new=cuda new1q=cuda@128,3,3,1 [--cases fwd128:causal:2048 ...]
    ncu --clock-control none --profile-from-start off -k regex:flash_fwd \
        --metrics sm__cycles_elapsed.max,smsp__inst_executed.sum \
        python bench/dev/tree_ab.py --ncu --trees ...     # each case once per tree, in the order printed: SM cycles
    (from the repository root, after ``pip install -e .``: the harness is the installed package ``fa2cupy_bench``)

A tree may name KernelOptions fields after a + (``general=cuda+hopper_alibi_only=0``: values ints, 1/0 for bools,
none) and a Hopper row after an @ (HopperFwdConfig's fields after the head dim, for d=128 or, as
``@64:128,4,4,2,3``, another head dim; consumer_wgs may be left out: 2), which then runs every case of that head dim;
otherwise each tree plans with this package's tables. Make the trees on the
machine that sends the command: a remote machine's copy of the repository may not have the commit to unpack.

A case is ``fwd<d>:<mask>:<seqlen>[:<mods>]`` with mask none, causal, window<left> (left, 0) or
window<left>_<right> (window100000_100000: a call without a mask on the window kernels) and mods softcap
(30), alibi (slopes in [0, 0.1)), alibi0 (slopes 0: the modifier kernel with nothing switched on, what the kernel
itself costs beside the plain one), dropout (p = 0.1, seed 0) or a ``+``-joined set of them (``softcap+alibi``);
bf16, 16k tokens per batch (at least one sequence), hidden 2048.
"""

import argparse
import statistics
import sys
from pathlib import Path

import cupy
import cupy.cuda.profiler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fa2cupy_bench import harness as B  # noqa: E402
from fa2cupy import arrays, build, configs, forward  # noqa: E402

DEFAULT_CASES = ("fwd128:none:2048", "fwd128:causal:1024", "fwd128:causal:2048", "fwd128:none:16384",
                 "fwd128:causal:16384", "fwd64:none:8192", "fwd64:causal:8192", "fwd128:causal:65536",
                 "fwd128:window4096:65536")


SOFTCAP = 30.0
DROPOUT_P = 0.1


def parse_case(case: str):
    """(head dim, mask, seqlen, set of modifiers) of ``fwd<d>:<mask>:<seqlen>[:<mods>]``; alibi0 counts as alibi
    too (its slopes are zeros)."""
    fields = case.split(":")
    mods = set(fields[3].split("+")) if len(fields) > 3 else set()
    unknown = mods - {"softcap", "alibi", "alibi0", "dropout"}
    if unknown:
        raise SystemExit(f"{case}: unknown modifiers {sorted(unknown)}")
    return int(fields[0][3:]), fields[1], int(fields[2]), mods | ({"alibi"} if "alibi0" in mods else set())


def window_of(mask: str) -> tuple[int, int]:
    """A case's window_size: (left, right) of window<left>[_<right>] (right 0 when left out), else (-1, -1)."""
    if not mask.startswith("window"):
        return -1, -1
    left, _, right = mask[6:].partition("_")
    return int(left), int(right or 0)


def plans_for(tree: str, cases):
    """Each case planned against the kernels of the sources in ``tree`` (compiled now, kept by the plans), with the
    KernelOptions named after a ``+``."""
    tree, _, options = tree.partition("+")
    options = B.kernel_options_of(options)
    tree, _, row = tree.partition("@")
    config = None
    if row:  # [d:]block_n,k_stages,v_stages,q_buffers[,consumer_wgs] (d=128 when no head dim is named)
        d, _, fields = row.rpartition(":")
        config = configs.HopperFwdConfig(int(d or 128), *map(int, fields.split(",")))
    build.use_sources(tree)
    plans = {}
    for case in cases:
        d, mask, seqlen, mods = parse_case(case)
        heads = 2048 // d
        shape = (max(1, 16384 // seqlen), seqlen, heads, d)
        window = window_of(mask)
        causal = mask == "causal" or window[1] == 0
        strides = (shape[1] * heads * d, heads * d, d, 1)
        plans[case] = forward.plan_forward(shape, shape, (strides,) * 4, "bfloat16", d ** -0.5, causal, 90,
                                           window_size=window, softcap=SOFTCAP if "softcap" in mods else 0.0,
                                           alibi_batch_stride=0 if "alibi" in mods else None,
                                           dropout_p=DROPOUT_P if "dropout" in mods else 0.0,
                                           config=config if config and config.headdim == d else None,
                                           options=options)
    return plans


def main():
    parser = argparse.ArgumentParser()
    B.add_tree_arguments(parser, "name=path/to/cuda[@row] ...", DEFAULT_CASES, rounds=4, repeats=20,
                         sustain_seconds=0.0)
    parser.add_argument("--ncu", action="store_true",
                        help="no timing: each case once per tree inside cudaProfilerStart/Stop, for Nsight Compute")
    args = parser.parse_args()
    trees = B.trees_of(args.trees)
    variants = {name: plans_for(path, args.cases) for name, path in trees.items()}
    rng = cupy.random.default_rng(1)
    stream = cupy.cuda.get_current_stream()
    for case in args.cases:
        d, mask, seqlen, mods = parse_case(case)
        heads = 2048 // d
        batch = max(1, 16384 // seqlen)
        shape = (batch, seqlen, heads, d)
        # bf16 bit patterns (CuPy has no bfloat16 type)
        q, k, v = (arrays.bf16_bits(cupy, rng.standard_normal(shape, dtype=cupy.float32)) for _ in range(3))
        lse = cupy.empty((batch, heads, seqlen), cupy.float32)
        slopes = None
        if "alibi" in mods:
            slopes = (cupy.zeros(heads, cupy.float32) if "alibi0" in mods
                      else rng.uniform(0, 0.1, heads, dtype=cupy.float32))
        inputs = dict(q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, softmax_lse=lse.data.ptr,
                      alibi_slopes=0 if slopes is None else slopes.data.ptr)
        outs = {}
        for name, plans in variants.items():
            out = cupy.full(shape, 0x7FC0, cupy.uint16)  # NaN
            forward.run_forward(plans[case], dict(forward.NO_POINTERS, **inputs, out=out.data.ptr), (0, 0),
                                stream.ptr)
            outs[name] = out
        first = arrays.bf16_bits_to_float(cupy, next(iter(outs.values())))
        diffs = {name: float(cupy.abs(arrays.bf16_bits_to_float(cupy, o) - first).max()) for name, o in outs.items()}
        out = cupy.empty(shape, cupy.uint16)
        best = {name: float("inf") for name in variants}
        rounds = {name: [] for name in variants}
        names = list(variants)
        if args.ncu:  # (launched once above each, so compiled and warm)
            for name in names:
                print(f"profiled: {case} {name} (diff {diffs[name]:.1e})", flush=True)
                cupy.cuda.runtime.deviceSynchronize()
                cupy.cuda.profiler.start()
                forward.run_forward(variants[name][case], dict(forward.NO_POINTERS, **inputs, out=out.data.ptr),
                                    (0, 0), stream.ptr)
                cupy.cuda.runtime.deviceSynchronize()
                cupy.cuda.profiler.stop()
            continue
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                plan = variants[name][case]
                pointers = dict(forward.NO_POINTERS, **inputs, out=out.data.ptr)
                launch = lambda: forward.run_forward(plan, pointers, (0, 0), stream.ptr)  # noqa: E731
                for _ in range(3):
                    launch()
                B.sustain(launch, stream.synchronize, args.sustain)
                times = []
                for _ in range(args.repeats):
                    start, end = cupy.cuda.Event(), cupy.cuda.Event()
                    start.record(stream)
                    launch()
                    end.record(stream)
                    end.synchronize()
                    times.append(cupy.cuda.get_elapsed_time(start, end))
                best[name] = min(best[name], statistics.median(times))
                rounds[name].append(statistics.median(times))
        if mask == "none":
            flops = 4 * batch * heads * seqlen * seqlen * d
        elif mask == "causal":
            flops = 2 * batch * heads * seqlen * (seqlen + 1) * d
        else:
            flops = 4 * batch * heads * B.band_pairs(seqlen, *window_of(mask)) * d
        base = best[names[0]]
        cells = "  ".join(f"{n} {best[n]:.3f} ms {flops / best[n] / 1e9:.0f} TF/s ({best[n] / base:.3f}, "
                          f"diff {diffs[n]:.1e})" for n in names)
        print(f"{case:<26} {cells}", flush=True)
        print(" " * 27 + "  ".join(f"{n} rounds " + " ".join(f"{t:.3f}" for t in rounds[n]) for n in names),
              flush=True)


if __name__ == "__main__":
    main()
