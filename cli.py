"""The ``fa2cupy`` command: ``check`` (correctness on the GPU), ``bench`` (speed), ``info``.

Installed as the console script ``fa2cupy`` (entry point ``fa2cupy_cli.cli:main``); after
``pip install -e .`` also runnable as ``python cli.py ...`` from the repository root (the
benchmark harness is the installed package ``fa2cupy_bench``, from ``bench/``).

Without a usable CUDA GPU every command prints one line saying why and exits
with status 2; without CuPy it prints one line naming the install extras.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any

import click
import numpy as np

from fa2cupy import testing
from fa2cupy_bench import harness as B

EXIT_NO_GPU = 2

# --------------------------------------------------------------------------- #
# GPU probing
# --------------------------------------------------------------------------- #

def probe_gpu() -> tuple[bool, str]:
    """(True, 'GPU name') if CuPy sees a CUDA device, else (False, one-line reason:
    :func:`fa2cupy.testing.gpu_unavailable_reason`)."""
    reason = testing.gpu_unavailable_reason()
    if reason is not None:
        return False, f"fa2cupy: {reason}"
    import cupy  # noqa: PLC0415

    try:
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:
        return False, " ".join(f"fa2cupy: no usable CUDA GPU ({exc})".split())
    return True, name


def require_gpu() -> str:
    """Return the GPU name, or print one line and exit with status 2."""
    ok, msg = probe_gpu()
    if not ok:
        click.echo(msg, err=True)
        sys.exit(EXIT_NO_GPU)
    return msg


# --------------------------------------------------------------------------- #
# check: correctness sweep against the float64 reference
# --------------------------------------------------------------------------- #

# What passes is decided by fa2cupy.testing (one place, shared with the GPU tests and
# bench/dev/sanitize_case.py): attention_errors for out/lse, gradient_errors for dq/dk/dv.


C = B.Case
# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, dtype[, headdim_v])
CHECK_CASES: tuple[B.Case, ...] = (
    C(1, 128, 128, 1, 1, 64, False, "bf16"),     # 0 baseline, one full tile
    C(2, 63, 63, 2, 2, 64, False, "fp16"),       # tile boundaries -1 / +1
    C(2, 65, 65, 2, 2, 64, True, "bf16"),
    C(1, 127, 129, 2, 2, 128, False, "bf16"),
    C(1, 129, 127, 2, 2, 128, True, "fp16"),     # causal, sq > sk (bottom-right aligned)
    C(1, 255, 257, 2, 2, 96, False, "bf16"),
    C(1, 257, 255, 2, 2, 96, True, "bf16"),
    C(3, 17, 113, 3, 3, 64, False, "fp16"),      # primes
    C(2, 113, 17, 4, 4, 64, True, "bf16"),       # causal sq > sk: fully masked rows
    C(1, 251, 509, 2, 2, 128, True, "bf16"),
    C(1, 1021, 1021, 1, 1, 128, True, "fp16"),
    C(1, 1, 1, 1, 1, 64, False, "bf16"),         # degenerate
    C(2, 1, 509, 4, 4, 128, True, "bf16"),       # one query (decode-like), causal
    C(2, 200, 200, 8, 2, 64, True, "bf16"),      # GQA
    C(1, 333, 190, 6, 3, 128, False, "fp16"),    # GQA, sq > sk
    C(2, 150, 150, 8, 1, 128, True, "bf16"),     # MQA
    C(1, 97, 431, 4, 1, 256, False, "bf16"),     # MQA, d=256
    C(2, 192, 192, 2, 2, 32, False, "bf16"),     # head dims 32 .. 256
    C(2, 177, 177, 2, 2, 32, True, "fp16"),
    C(1, 200, 300, 2, 2, 40, True, "bf16"),
    C(1, 100, 100, 2, 2, 72, False, "bf16"),
    C(1, 300, 200, 2, 2, 80, True, "fp16"),
    C(1, 257, 257, 2, 2, 160, False, "bf16"),
    C(1, 129, 385, 2, 2, 192, True, "bf16"),
    C(1, 100, 100, 2, 2, 224, True, "bf16"),
    C(1, 130, 70, 2, 2, 33, True, "fp16"),       # odd head dims (padded inside the kernel)
    C(2, 90, 90, 3, 3, 200, False, "bf16"),
    C(1, 256, 256, 2, 2, 256, True, "fp16"),
    C(1, 511, 513, 1, 1, 256, False, "bf16"),
    C(1, 2048, 2048, 2, 2, 128, True, "bf16"),   # several tiles each way
    C(2, 1000, 3000, 4, 2, 64, True, "bf16"),
    C(1, 200, 260, 4, 2, 192, True, "bf16", 128),  # v's head dim its own (DeepSeek's 192 / 128)
    C(1, 150, 150, 2, 2, 64, False, "fp16", 128),  # ... wider than q's
)
QUICK_INDICES = (0, 2, 4, 8, 13, 16, 19, 25, 27, 30)
RANDOM_HEADDIMS = (32, 40, 64, 80, 96, 128, 160, 192, 256)

#: The backward is checked on the cases whose float64 reference backward stays cheap
#: (b*h*sq*sk*d at most this: ~0.3 s of NumPy); with --quick, those of the quick set.
BWD_WORK_LIMIT = 6 * 10**7


def random_cases(seed: int, n: int) -> list[B.Case]:
    """``n`` random shapes drawn from ``seed`` (small enough for the float64 reference)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        hkv = int(rng.choice([1, 2, 3]))
        group = int(rng.choice([1, 1, 2, 4]))
        case = B.Case(
            batch=int(rng.integers(1, 4)),
            seqlen_q=int(rng.integers(1, 700)),
            seqlen_k=int(rng.integers(1, 700)),
            nheads=hkv * group, nheads_kv=hkv,
            headdim=int(rng.choice(RANDOM_HEADDIMS)) if rng.random() < 0.5 else int(rng.integers(1, 257)),
            causal=bool(rng.integers(0, 2)),
            dtype=str(rng.choice(["bf16", "fp16"])),
        )
        if rng.random() < 0.25:  # v with a head dim of its own
            dv = int(rng.integers(1, 257))
            case = dataclasses.replace(case, headdim_v=dv if dv != case.headdim else 0)
        out.append(case)
    return out


def check_cases(seed: int = 0, quick: bool = False) -> list[B.Case]:
    fixed = [CHECK_CASES[i] for i in QUICK_INDICES] if quick else list(CHECK_CASES)
    return fixed + random_cases(seed, 2 if quick else 8)


def checks_backward(case: B.Case) -> bool:
    """Whether ``fa2cupy check`` also runs and verifies the backward on ``case``."""
    return B.backward_work(case) <= BWD_WORK_LIMIT


@dataclasses.dataclass
class CheckResult:
    case: B.Case
    out_err: float | None = None
    out_bound: float | None = None
    lse_err: float | None = None
    lse_ratio: float | None = None      # max |lse err| / bound  (<= 1 passes)
    masked_rows: int = 0
    seconds: float = 0.0
    error: str | None = None
    grad_ratios: dict[str, float] | None = None   # max|g - ref| / bound per dq, dk, dv (<= 1 passes)
    deterministic: bool | None = None              # the backward's mode, when it ran

    @property
    def passed(self) -> bool:
        return (self.error is None and self.out_err is not None and self.out_err <= self.out_bound
                and (self.lse_ratio is None or self.lse_ratio <= 1.0)
                and (self.grad_ratios is None or all(r <= 1.0 for r in self.grad_ratios.values())))


def gradient_ratios(errors) -> dict[str, float]:
    """{name: max|g - ref_g| / bound} from :func:`fa2cupy.testing.gradient_errors` (inf where g has NaN/inf)."""
    return {name: err / bound if bound > 0 else (0.0 if err == 0 else math.inf) for name, err, bound in errors}


def compare(case: B.Case, out: np.ndarray, lse: np.ndarray, ref_out: np.ndarray,
            ref_lse: np.ndarray) -> CheckResult:
    """Compare kernel output/LSE (float64 NumPy) with the reference (:func:`fa2cupy.testing.attention_errors`).

    Rows with no visible key (causal, sq > sk) have a non-finite reference LSE;
    there the kernel must output zeros (FlashAttention-2 convention) and its
    LSE is not compared.
    """
    e = testing.attention_errors(out, ref_out, case.dtype, lse=lse, ref_lse=ref_lse)
    return CheckResult(case, out_err=e.out_err, out_bound=e.out_bound, lse_err=e.lse_err, lse_ratio=e.lse_ratio,
                       masked_rows=e.masked_rows)


def run_check_case(case: B.Case, seed: int, backward: bool | None = None,
                   deterministic: bool = False) -> CheckResult:
    """Forward (and, when ``backward`` -- default :func:`checks_backward` -- the backward,
    with out/lse from that forward and a random dout) against the float64 reference."""
    import fa2cupy  # noqa: PLC0415
    from fa2cupy.reference import attention_ref  # noqa: PLC0415

    if backward is None:
        backward = checks_backward(case)
    t0 = time.perf_counter()
    try:
        host = B.host_inputs(case, seed)
        dev = {n: B.to_device(p, case.dtype, "cupy") for n, (p, _) in host.items()}
        out, lse, _ = fa2cupy.flash_attn_func(dev["q"], dev["k"], dev["v"], causal=case.causal,
                                              return_attn_probs=True)
        grads = None
        if backward:
            dout_p, dout64 = B.host_dout(case, seed)
            dout = B.to_device(dout_p, case.dtype, "cupy")
            grads = fa2cupy.flash_attn_backward(dout, dev["q"], dev["k"], dev["v"], out, lse, causal=case.causal,
                                                deterministic=deterministic)
            grads = [testing.to_numpy64(g) for g in grads]
        out64, lse64 = testing.to_numpy64(out), testing.to_numpy64(lse)
        seconds = time.perf_counter() - t0
        q64, k64, v64 = host["q"][1], host["k"][1], host["v"][1]
        ref_out, ref_lse = attention_ref(q64, k64, v64, causal=case.causal)
        res = compare(case, out64, lse64, np.asarray(ref_out, np.float64), np.asarray(ref_lse, np.float64))
        if backward:
            ref_grads = testing.reference_gradients(dout64, q64, k64, v64, out64, causal=case.causal,
                                                    ref_out=ref_out)
            res.grad_ratios = gradient_ratios(testing.gradient_errors(grads, dout64, q64, k64, v64, out64, case.dtype,
                                                                      causal=case.causal, ref_grads=ref_grads))
            res.deterministic = bool(deterministic)
        res.seconds = seconds
        return res
    except Exception as exc:
        return CheckResult(case, seconds=time.perf_counter() - t0, error=B._first_line(exc))


CHECK_HEADERS = ("#", "case", "out err", "bound", "lse err", "lse/bnd", "dq/bnd", "dk/bnd", "dv/bnd", "s",
                 "result")
CHECK_WIDTHS = (3, 38, 9, 9, 9, 7, 6, 6, 6, 6, 6)


def _fmt_e(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else ("inf" if not math.isfinite(x) else f"{x:.2f}")


def check_row(i: int, r: CheckResult) -> str:
    if r.error is not None:
        cells = (str(i), r.case.label, "-", "-", "-", "-", "-", "-", "-", f"{r.seconds:.1f}", "FAIL")
        return "  ".join(c.rjust(w) if j not in (1,) else c.ljust(w)
                         for j, (c, w) in enumerate(zip(cells, CHECK_WIDTHS))) + f"  {r.error}"
    cells = (str(i), r.case.label, _fmt_e(r.out_err), _fmt_e(r.out_bound), _fmt_e(r.lse_err),
             "-" if r.lse_ratio is None else f"{r.lse_ratio:.2f}",
             *(("-" if r.grad_ratios is None else _fmt_ratio(r.grad_ratios.get(g))) for g in testing.GRAD_NAMES),
             f"{r.seconds:.1f}", "PASS" if r.passed else "FAIL")
    line = "  ".join(c.ljust(w) if j == 1 else c.rjust(w) for j, (c, w) in enumerate(zip(cells, CHECK_WIDTHS)))
    notes = []
    if r.masked_rows:
        notes.append(f"{r.masked_rows} fully masked rows")
    if r.deterministic:
        notes.append("deterministic bwd")
    return line + (f"  ({'; '.join(notes)})" if notes else "")


def check_header() -> str:
    line = "  ".join(h.ljust(w) if j == 1 else h.rjust(w) for j, (h, w) in enumerate(zip(CHECK_HEADERS, CHECK_WIDTHS)))
    return line + "\n" + "  ".join("-" * w for w in CHECK_WIDTHS)


# --------------------------------------------------------------------------- #
# info
# --------------------------------------------------------------------------- #


def _row_text(config) -> tuple[str, str]:
    """(kernel, tile) of a tile-table row, as ``fa2cupy info`` prints them."""
    from fa2cupy import configs  # noqa: PLC0415

    if isinstance(config, configs.HopperFwdConfig):
        return "hopper (wgmma)", (f"{config.block_m}x{config.block_n}, {config.consumer_wgs} consumer warpgroups, "
                                  f"K/V ring {config.k_stages}/{config.v_stages}")
    if isinstance(config, configs.HopperBwdConfig):
        return "hopper (wgmma)", (f"{config.block_m}x{config.block_n}, 2 consumer warpgroups, "
                                  f"{config.stages} stage{'s' if config.stages > 1 else ''}")
    slices = f", {config.dslices} head-dim slices" if getattr(config, "dslices", 1) > 1 else ""
    stages = f"{config.stages} stage{'s' if config.stages > 1 else ''}"
    return "mma.sync", f"{config.block_m}x{config.block_n}, {config.warps} warps, {stages}{slices}"


def _dims(dims) -> str:
    """"128, 192 and 256"."""
    dims = [str(d) for d in dims]
    return dims[0] if len(dims) == 1 else f"{', '.join(dims[:-1])} and {dims[-1]}"


def tile_table_text(arch: int | None) -> str:
    """The kernel and tile each case runs on a GPU of compute capability ``arch`` (e.g. 90): for every head dim of
    the tile table, causal or not, the forward's and the backward's row as fa2cupy's planners choose it
    (configs.padded_call_width and configs.kernel_rows, default KernelOptions). Needs no GPU."""
    if arch is None:
        return "kernel table unavailable (no compute capability)"
    try:
        from fa2cupy import configs  # noqa: PLC0415

        def chosen(d, mask, backward, seqlen_q=None):
            """(the row, its text): the kernel and tile the planners pick, and the width if wider than d."""
            width = configs.padded_call_width(arch, d, "bfloat16", backward, mask, seqlen_q=seqlen_q)
            rows = configs.kernel_rows(arch, width, "bfloat16", mask, seqlen_q=seqlen_q)
            config = rows.backward if backward else rows.forward
            kernel, tile = _row_text(config)
            return config, [kernel + (f", at width {width}" if width != d else ""), tile]

        rows = []
        for d in configs.HEADDIMS:
            for causal in (False, True):
                mask = "causal" if causal else "none"
                forward, forward_text = chosen(d, mask, False)
                _, backward_text = chosen(d, mask, True)
                shortest = configs.HOPPER_MASKED_MIN_SEQLEN.get(forward.headdim, 0)
                hopper_from = causal and isinstance(forward, configs.HopperFwdConfig) and shortest
                rows.append([d, f"yes, seqlen_q >= {shortest}" if hopper_from else "yes" if causal else "no",
                             *forward_text, *backward_text])
                if hopper_from:  # shorter masked calls: the mma.sync forward
                    rows.append([d, f"yes, seqlen_q < {shortest}", *chosen(d, mask, False, shortest - 1)[1],
                                 *backward_text])
        table = B.format_table(("headdim", "causal", "forward", "forward tile (rows x keys)", "backward",
                                "backward tile (rows x keys)"), rows, "rlllll")
    except Exception as exc:
        return f"kernel table unavailable for sm_{arch} ({B._first_line(exc)})"
    hopper = arch == 90
    return (f"kernels for sm_{arch} (float16 and bfloat16 alike; a head dim runs on the next width of the table"
            + (f", from {configs.HOPPER_PAD_MIN_HEADDIM} on at the next Hopper width where the Hopper kernels take "
               "the call" if hopper else "")
            + f"):\n{table}\n"
            + (f"Softcap, ALiBi and dropout run on the Hopper rows above: the forward's at d = "
               f"{_dims(configs.HOPPER_MODS_HEADDIMS)} (padded calls only at "
               f"{_dims(configs.HOPPER_MODS_PADDED_ONLY)}"
               + "".join(f"; at d = {d} on {row.consumer_wgs} consumer warpgroups"
                         for d, row in configs.FORWARD_HOPPER_MODS_TABLE.items())
               + f"), the backward's at d = "
               f"{_dims(configs.HOPPER_BWD_MODS_HEADDIMS)} (padded calls only at "
               f"{_dims(configs.HOPPER_BWD_MODS_PADDED_ONLY)}; dropout not at "
               f"{_dims(configs.HOPPER_BWD_NO_DROPOUT)}); elsewhere modifiers run "
               if hopper else "Calls with softcap, ALiBi or dropout run ")
            + "the mma.sync rows of their modifier variant (sliding windows those of configs.FORWARD_MASKED_TABLE "
            "where it has one); the deterministic backward runs "
            + ("the Hopper backward row above, its dQ additions in turns, where it has one, and elsewhere "
               if hopper else "")
            + "the mma.sync backward and its dQ kernel.")


# --------------------------------------------------------------------------- #
# Commands
# --------------------------------------------------------------------------- #


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """fa2cupy: FlashAttention-2 kernels compiled at run time by CuPy (NVRTC)."""


@main.command()
@click.option("--seed", default=0, show_default=True, help="Seed for inputs and the random shapes.")
@click.option("--quick", is_flag=True, help="A short subset of the cases.")
def check(seed: int, quick: bool) -> None:
    """Randomized correctness sweep on the GPU against the float64 reference.

    Forward bounds: max|out - ref| <= 2^-7 (bf16) / 2^-10 (fp16) * max(1, max|ref|);
    |lse - ref| <= 1e-3 * max(1, |ref|).  On the cases small enough for the float64
    reference backward, also flash_attn_backward (deterministic on every other one):
    max|g - ref_g| <= 16 u max|ref_g| + floor for g in dq, dk, dv (columns g/bnd, <= 1
    passes; u = 2^-11 fp16, 2^-8 bf16).  Exit status 1 on any failure.
    """
    gpu = require_gpu()
    cases = check_cases(seed, quick)
    n_bwd = sum(checks_backward(c) for c in cases)
    click.echo(f"fa2cupy check on {gpu}: {len(cases)} cases ({n_bwd} with backward), seed {seed}"
               " (time s includes first-call compilation)")
    click.echo(check_header())
    failures = 0
    for i, case in enumerate(cases):
        r = run_check_case(case, seed * 1000 + i, deterministic=bool(i % 2))
        failures += not r.passed
        click.echo(check_row(i, r))
    click.echo(f"{len(cases) - failures}/{len(cases)} passed")
    if failures:
        sys.exit(1)


def _int_list(ctx, param, value):
    if value is None:
        return None
    try:
        return B.parse_int_list(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@main.command()
@click.option("--mode", type=click.Choice(B.CLI_MODES), default="fwd", show_default=True)
@click.option("--headdim", "headdims", default=None, callback=_int_list,
              help="Comma-separated head dims.  [default: 64,128; decode: 128]")
@click.option("--causal", type=click.Choice(["both", "on", "off"]), default="both", show_default=True)
@click.option("--seqlens", default=None, callback=_int_list,
              help="Comma-separated sequence lengths (batch = tokens // seqlen; decode: cache lengths).  "
                   "[default: 512,1024,2048,4096,8192,16384; decode: 1024,4096,16384,65536]")
@click.option("--batches", default="1,8,64", show_default=True, callback=_int_list,
              help="decode: comma-separated batch sizes (pairs with batch * seqlen > 1M are skipped).")
@click.option("--nheads", default=32, show_default=True, help="decode: query heads.")
@click.option("--nheads-kv", default=8, show_default=True, help="decode: key/value heads.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True)
@click.option("--tokens", default=16384, show_default=True, help="Tokens per batch.")
@click.option("--hidden", default=2048, show_default=True, help="Model width (nheads = hidden // headdim).")
@click.option("--out", "out_dir", default="bench/out", show_default=True, type=click.Path(file_okay=False),
              help="Folder for the JSON and PNG.")
@click.option("--repeats", default=30, show_default=True, help="Timed runs per implementation (median).")
@click.option("--warmup", default=10, show_default=True, help="Untimed runs first.")
@click.option("--skip-cold", is_flag=True, help="Skip the cold-compile measurement (subprocesses).")
@click.option("--skip-overhead", is_flag=True, help="Skip the dispatch-overhead measurement.")
@click.option("--no-plot", is_flag=True, help="Write no PNG.")
@click.option("--deterministic", is_flag=True,
              help="bwd/fwdbwd: run fa2cupy's backward with deterministic=True (bit-reproducible, slower).")
@click.option("--no-memory", is_flag=True, help="bwd/fwdbwd: skip the peak-memory measurement.")
@click.option("--sustain", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="fwd/bwd/fwdbwd: seconds of each implementation's calls back to back before its timed ones, "
                   "so that each is timed at its own steady clock (at the power cap a light kernel leaves a high "
                   "clock to the one timed after it).")
def bench(mode, headdims, causal, seqlens, batches, nheads, nheads_kv, dtype, tokens, hidden, out_dir, repeats,
          warmup, skip_cold, skip_overhead, no_plot, deterministic, no_memory, sustain) -> None:
    """TFLOPs/s of fa2cupy beside torch SDPA (flash, cuDNN) on the FlashAttention-2 paper grid.

    --mode fwd times the forward; bwd the backward alone (out/lse from one forward;
    SDPA: torch.autograd.grad of an output computed once), counting 2.5x the forward
    FLOPs; fwdbwd both, 3.5x.  bwd/fwdbwd also report the peak extra memory of one call
    (torch allocator, inputs excluded) of each implementation.
    """
    import os  # noqa: PLC0415

    if mode == "decode":
        if sustain:
            raise click.BadParameter("applies to --mode fwd, bwd and fwdbwd, not decode", param_hint="--sustain")
        _bench_decode(headdims or [128], seqlens or list(B.DECODE_SEQLENS), batches, nheads, nheads_kv, dtype,
                      out_dir, repeats, warmup)
        return
    headdims = headdims or [64, 128]
    seqlens = seqlens or [512, 1024, 2048, 4096, 8192, 16384]
    mode = B.canonical_mode(mode)
    gpu = require_gpu()
    try:
        cases = B.paper_grid(headdims, B.causal_options(causal), seqlens, dtype, tokens, hidden)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    env = B.environment_info()
    runner = B.MODE_RUNNERS[mode]
    click.echo(f"fa2cupy bench --mode {mode} on {gpu}: {len(cases)} cases, {dtype}, "
               f"median of {repeats} (CUDA events"
               f"{f', each after {sustain:g} s of its calls back to back' if sustain else ''}), framework "
               f"{'torch' if B.torch_available() else 'cupy (torch not importable: no SDPA columns)'}")
    records = []
    options: dict[str, Any] = {"warmup": warmup, "repeats": repeats, "sustain_seconds": sustain}
    if mode != "fwd":
        options.update(deterministic=deterministic, memory=not no_memory)
        click.echo(f"backward: fa2cupy deterministic={deterministic}; TFLOPs/s count "
                   f"{B.FLOP_FACTORS[mode]:g}x the forward FLOPs")
    with click.progressbar(cases, label="benchmarking", file=sys.stderr,
                           item_show_func=lambda c: c.label if c else "") as bar:
        for case in bar:
            records.append(runner(case, **options))
    click.echo(B.results_table(records))
    mem = B.memory_table(records) if mode != "fwd" else None
    if mem:
        click.echo("\npeak extra memory of one call (torch allocator, MiB, inputs excluded):")
        click.echo(mem)
    for line in B.errors_summary(records):
        click.echo(f"note: {line}")
    limit = B.DIFF_LIMITS[mode]
    bad = [r for r in records if r.get("max_abs_diff") is not None and r["max_abs_diff"] > limit]
    if bad:
        what = "output" if mode == "fwd" else "gradients"
        click.echo(f"WARNING: fa2cupy {what} differ from SDPA by > {limit} in {len(bad)} case(s) (marked '!')")

    extra: dict[str, Any] = {}
    if mode != "fwd" and not (skip_cold and skip_overhead):
        click.echo("cold compile / dispatch overhead: measured for the forward only (run --mode fwd); skipped")
        skip_cold = skip_overhead = True
    if not skip_cold:
        variants = sorted({(c.headdim, c.causal) for c in cases})
        click.echo(f"cold compile: first call in a fresh process, empty CUPY_CACHE_DIR, {len(variants)} variant(s)...")
        extra["cold_compile"] = cold = B.cold_compile(variants, dtype)
        for key in ("cold", "disk_cached"):
            r = cold.get(key, {})
            if "error" in r:
                click.echo(f"  {key}: error: {r['error']}")
                continue
            per = ", ".join(f"d{v['headdim']}{' causal' if v['causal'] else ''} {v['first_call_s']:.2f} s"
                            for v in r["variants"])
            click.echo(f"  {key:11s}: import {r['import_s']:.2f} s; first call {per}")
    if not skip_overhead:
        extra["dispatch_overhead"] = ov = B.dispatch_overhead(dtype)
        names = {"fa2cupy_torch_us": "fa2cupy (torch tensors)", "fa2cupy_cupy_us": "fa2cupy (CuPy arrays)",
                 "sdpa_flash_torch_us": "SDPA flash"}
        parts = [f"{title} {ov[k]:.1f} us" for k, title in names.items() if ov.get(k) is not None]
        errs = [f"{k}: {v}" for k, v in ov.items() if k.endswith("error")]
        click.echo(f"dispatch overhead ({ov['case']}, median of {ov['n']} calls, host wall time per call): "
                   + (", ".join(parts) or "n/a") + ("; " + "; ".join(errs) if errs else ""))

    base = B.result_basename(mode + ("-det" if mode != "fwd" and deterministic else ""), env.get("gpu", gpu))
    payload = {"mode": mode, "environment": env,
               "settings": {"dtype": dtype, "tokens": tokens, "hidden": hidden, "repeats": repeats,
                            "warmup": warmup, "sustain_seconds": sustain,
                            "timing": "median of CUDA-event times per call",
                            "flops": B.flops_description(mode),
                            **({"deterministic": deterministic} if mode != "fwd" else {})},
               "records": records, **extra}
    path = B.write_json(os.path.join(out_dir, base + ".json"), payload)
    click.echo(f"wrote {path}")
    if not no_plot:
        png = os.path.join(out_dir, base + ".png")
        why = B.plot_results(records, png, title=f"fa2cupy {mode}, {dtype}, {env.get('gpu', gpu)}")
        click.echo(why or f"wrote {png}")


def _bench_decode(headdims, seqlens, batches, nheads, nheads_kv, dtype, out_dir, repeats, warmup) -> None:
    """bench --mode decode: KV-cache bandwidth of one decode step beside SDPA flash and cuDNN."""
    import os  # noqa: PLC0415

    gpu = require_gpu()
    if not B.torch_available():
        click.echo("bench --mode decode needs torch (the SDPA baselines and the inputs)", err=True)
        sys.exit(EXIT_NO_GPU)
    if nheads % nheads_kv:
        raise click.BadParameter(f"--nheads {nheads} must be a multiple of --nheads-kv {nheads_kv}")
    env = B.environment_info()
    pairs = B.decode_grid(batches, seqlens)
    click.echo(f"fa2cupy bench --mode decode on {gpu}: hq={nheads} hkv={nheads_kv} d={','.join(map(str, headdims))} "
               f"{dtype}, seqlen_q=1, full caches, {len(pairs)} (batch, seqlen_k) pairs; median of {repeats} "
               f"CUDA-event times per call, calls back to back (queued: 8 calls per pair of events, enqueued "
               f"behind a spinning kernel, so no host dispatch in them), best of 3 rounds taking turns; graph: 16 "
               f"calls per CUDA graph; "
               f"TB/s = K+V bytes / time")
    records = []
    for headdim in headdims:
        for batch, seqlen_k in pairs:
            records.append(B.bench_decode_case(batch, seqlen_k, nheads=nheads, nheads_kv=nheads_kv, headdim=headdim,
                                               dtype=dtype, warmup=warmup, repeats=repeats))
            click.echo(B.decode_table(records[-1:]).splitlines()[-1], err=True)
    click.echo(B.decode_table(records))
    for r in records:
        for key, value in r.items():
            if key.endswith("_error"):
                click.echo(f"note: {r['label']}: {key[:-6]} failed: {value}")
        if r.get("paged_equals_contiguous") is False:
            click.echo(f"WARNING: {r['label']}: paged output differs from contiguous")
    base = B.result_basename("decode", env.get("gpu", gpu))
    payload = {"mode": "decode", "environment": env,
               "settings": {"dtype": dtype, "nheads": nheads, "nheads_kv": nheads_kv, "repeats": repeats,
                            "warmup": warmup,
                            "timing": "median of CUDA-event times per call, back to back (queued: 8 calls per "
                                      "pair of events behind a spinning kernel); best of 3 rounds taking turns; "
                                      "graph: 16 calls per CUDA graph",
                            "metric": "2 * batch * seqlen_k * nheads_kv * headdim * itemsize / time"},
               "records": records}
    path = B.write_json(os.path.join(out_dir, base + ".json"), payload)
    click.echo(f"wrote {path}")


def info_rows(env: dict[str, Any], gpu: str | None, arch: int | None) -> list[tuple[str, Any]]:
    """``fa2cupy info``'s (name, value) rows from :func:`fa2cupy_bench.harness.environment_info`: the versions and
    the kernel cache folder, known without a GPU, then the GPU (``gpu``: its name, or why there is none)."""
    from fa2cupy import build  # noqa: PLC0415 -- needs no CuPy

    def version(key: str, note: str | None = None) -> str:
        value = env.get(key)
        return f"{value} ({note})" if value and note else str(value)

    rows = [
        ("fa2cupy", env.get("fa2cupy")),
        ("CuPy", version("cupy", env.get("cupy_package"))),
        ("NVRTC", env.get("nvrtc")),
        ("CUDA runtime", version("cuda_runtime", "the CUDA CuPy was built for")),
        ("CUDA driver", env.get("cuda_driver") or "none found"),
    ]
    if env.get("torch"):
        rows.append(("torch", version("torch", f"CUDA {env['torch_cuda']}" if env.get("torch_cuda") else None)))
    if env.get("jax"):
        rows.append(("JAX", env["jax"]))
    rows.append(("kernel cache", build.cache_dir()))
    if arch is None:
        return rows + [("GPU", gpu)]
    return rows + [
        ("GPU", gpu),
        ("compute capability", f"{env.get('compute_capability')} (sm_{arch})"),
        ("SMs", env.get("sm_count")),
        ("GPU memory", f"{env.get('gpu_memory_gib')} GiB"),
    ]


@main.command()
@click.option("--arch", "table_arch", type=int, default=None,
              help="Only print the kernels each case runs on this compute capability (e.g. 90), no GPU needed.")
def info(table_arch: int | None) -> None:
    """Versions (fa2cupy, CuPy, NVRTC, CUDA, torch, JAX), kernel cache folder, GPU and the kernels each case runs.

    Without a GPU it prints what it can know without one and exits with status 2; without CuPy, one line naming
    the install extras. ``--arch N`` prints the kernel table of compute capability N alone, without a GPU.
    """
    if table_arch is not None:
        click.echo(tile_table_text(table_arch))
        return
    ok, gpu = probe_gpu()
    try:
        import cupy  # noqa: F401, PLC0415
    except Exception:   # nothing else is worth reading: the line says which extra to install
        click.echo(gpu, err=True)
        sys.exit(EXIT_NO_GPU)
    env = B.environment_info()
    arch = None
    if ok:
        try:
            arch = B.gpu_arch()
        except Exception as exc:
            ok, gpu = False, f"fa2cupy: no usable CUDA GPU ({B._first_line(exc)})"
    rows = info_rows(env, gpu if ok else gpu.removeprefix("fa2cupy: "), arch)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k.ljust(width)}  {v}")
    if not ok:
        sys.exit(EXIT_NO_GPU)
    click.echo("")
    click.echo(tile_table_text(arch))


if __name__ == "__main__":
    main()
