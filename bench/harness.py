"""Benchmark harness behind ``fa2cupy bench``: grids, timing, the implementations compared, tables, JSON, plots.

Installed as ``fa2cupy_bench.harness`` (pyproject.toml maps the package ``fa2cupy_bench`` to ``bench/``), outside
the ``fa2cupy`` package: nothing at run time needs it.

The module is split in two halves:

* pure pieces that need no GPU (the benchmark grid, FLOP counting, rounding of
  host inputs to fp16/bf16, table formatting, JSON naming/writing) -- these are
  covered by CPU unit tests;
* GPU pieces (input creation, CUDA-event timing, the per-implementation runners,
  cold-compile and dispatch-overhead probes, the plot) that import CuPy / torch /
  matplotlib lazily, so importing this module never touches a GPU.

Modes: ``fwd``, ``bwd`` (backward only, given out/lse from one forward) and
``fwdbwd`` (forward + backward).  A mode is an entry in :data:`MODE_RUNNERS`
(a function ``(case, ...) -> record``) plus a FLOP factor in
:data:`FLOP_FACTORS`. ``decode`` is memory-bound and has its own grid (batch x
cache length) and metric (KV-cache bytes read per second): :func:`decode_grid`,
:func:`bench_decode_case`, :func:`decode_table`.

The error bounds that decide whether a result is right live in :mod:`fa2cupy.testing`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from fa2cupy import arrays
from fa2cupy.testing import dtype_name

# --------------------------------------------------------------------------- #
# Grid, dtypes, FLOPs (pure)
# --------------------------------------------------------------------------- #

#: FLOP-counted modes (the CLI also accepts "decode", timed by KV-cache bandwidth: see the decode section).
MODES: tuple[str, ...] = ("fwd", "bwd", "fwdbwd")
CLI_MODES: tuple[str, ...] = MODES + ("decode",)

#: Other spellings accepted by :func:`canonical_mode`.
MODE_ALIASES: dict[str, str] = {"fwd_bwd": "fwdbwd", "fwd+bwd": "fwdbwd", "fwd-bwd": "fwdbwd",
                                "forward": "fwd", "backward": "bwd"}

#: FLOPs of a mode relative to the forward pass (FlashAttention-2 paper
#: convention: backward = 2.5x forward, i.e. 5 matmuls instead of 2;
#: forward + backward = 3.5x).
FLOP_FACTORS: dict[str, float] = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}

#: Implementations compared by ``bench --mode fwd`` (key -> column title).
IMPL_TITLES: dict[str, str] = {
    "fa2cupy": "fa2cupy",
    "sdpa_flash": "SDPA flash",
    "sdpa_cudnn": "SDPA cuDNN",
}


def canonical_mode(name: str) -> str:
    """'fwd' / 'bwd' / 'fwdbwd' (also 'fwd_bwd', 'fwd+bwd', 'forward', 'backward') -> canonical mode."""
    key = str(name).strip().lower()
    key = MODE_ALIASES.get(key, key)
    if key not in MODES:
        raise ValueError(f"unknown mode {name!r}: use one of {', '.join(MODES)}")
    return key


def canonical_dtype(name) -> str:
    """'bfloat16' / 'bf16' -> 'bf16'; 'float16' / 'fp16' / 'half' -> 'fp16' (any dtype spelling
    :func:`fa2cupy.testing.dtype_name` takes); ValueError for others."""
    return dtype_name(name)


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem: q (b, sq, h, d), k (b, sk, hkv, d), v (b, sk, hkv, headdim_v or d)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    causal: bool
    dtype: str = "bf16"
    headdim_v: int = 0  # v's head dim where it differs from headdim (0: the same)

    def __post_init__(self) -> None:
        for f in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_kv", "headdim"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.nheads % self.nheads_kv:
            raise ValueError(f"nheads ({self.nheads}) must be a multiple of nheads_kv ({self.nheads_kv})")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def label(self) -> str:
        s = f"s{self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"sq{self.seqlen_q}/sk{self.seqlen_k}"
        h = f"h{self.nheads}" if self.nheads == self.nheads_kv else f"h{self.nheads}/{self.nheads_kv}"
        c = " causal" if self.causal else ""
        d = f"d{self.headdim}" + (f"/{self.headdim_v}" if self.headdim_v else "")
        return f"b{self.batch} {s} {h} {d}{c} {self.dtype}"

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen_q, self.nheads, self.headdim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen_k, self.nheads_kv, self.headdim)

    @property
    def v_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen_k, self.nheads_kv, self.headdim_v or self.headdim)

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        """The output's (and dout's): q's with v's head dim."""
        return (self.batch, self.seqlen_q, self.nheads, self.headdim_v or self.headdim)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_int_list(text: str | Iterable[int]) -> list[int]:
    """'512, 1024,2k' -> [512, 1024, 2048]; also accepts an iterable of ints."""
    if not isinstance(text, str):
        return [int(x) for x in text]
    out = []
    for tok in text.replace(" ", "").split(","):
        if not tok:
            continue
        mult = 1
        if tok[-1] in "kK":
            tok, mult = tok[:-1], 1024
        try:
            val = int(tok) * mult
        except ValueError:
            raise ValueError(f"not an integer: {tok!r}") from None
        if val < 1:
            raise ValueError(f"values must be positive, got {val}")
        out.append(val)
    if not out:
        raise ValueError("empty list")
    return out


def causal_options(choice: str) -> list[bool]:
    """'both' -> [False, True]; 'on' -> [True]; 'off' -> [False]."""
    table = {"both": [False, True], "on": [True], "off": [False]}
    if choice not in table:
        raise ValueError(f"causal must be one of {sorted(table)}, got {choice!r}")
    return table[choice]


def paper_grid(
    headdims: Sequence[int] = (64, 128),
    causals: Sequence[bool] = (False, True),
    seqlens: Sequence[int] = (512, 1024, 2048, 4096, 8192, 16384),
    dtype: str = "bf16",
    tokens: int = 16384,
    hidden: int = 2048,
) -> list[Case]:
    """The FlashAttention-2 paper grid: ``tokens`` tokens per batch
    (batch = tokens // seqlen, at least 1), model width ``hidden``
    (nheads = hidden // headdim), self-attention (sq == sk, no GQA).

    Ordered by (headdim, causal, seqlen) so each plot panel is contiguous.
    """
    cases = []
    for d in headdims:
        if hidden % d:
            raise ValueError(f"hidden ({hidden}) must be a multiple of headdim ({d})")
        h = hidden // d
        for c in causals:
            for s in seqlens:
                b = max(1, tokens // s)
                cases.append(Case(b, s, s, h, h, d, bool(c), dtype))
    return cases


def attention_flops(case: Case, mode: str = "fwd") -> float:
    """Matmul FLOPs of attention, FlashAttention-2 paper convention.

    Forward: 2 matmuls (QK^T and PV) of 2*sq*sk*d FLOPs per head:
    ``4 * b * h * sq * sk * d``, halved when causal (the paper halves for causal
    regardless of sq != sk; with sq == sk this is exact up to the diagonal).
    Other modes scale by :data:`FLOP_FACTORS`.
    """
    mode = canonical_mode(mode)
    f = 4.0 * case.batch * case.nheads * case.seqlen_q * case.seqlen_k * case.headdim
    if case.causal:
        f /= 2.0
    return f * FLOP_FACTORS[mode]


def band_pairs(seqlen: int, left: int, right: int = 0) -> int:
    """Query-key pairs a (left, right) window sees over ``seqlen`` tokens (query i sees keys max(0, i - left) ..
    min(seqlen - 1, i + right)): forward FLOPs are 4 d of them per head. The square less the two triangles the
    window leaves out."""
    def outside(width):  # pairs more than `width` from the diagonal on one side
        n = max(seqlen - 1 - width, 0)
        return n * (n + 1) // 2
    return seqlen * seqlen - outside(left) - outside(right)


def tflops_per_s(flops: float, ms: float | None) -> float | None:
    """FLOPs and a time in milliseconds -> TFLOPs/s (None if no time)."""
    if ms is None or not ms > 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def backward_work(case: Case) -> int:
    """b * h * sq * sk * d (the larger of q's and v's head dims): the float64 reference backward's cost (~5 such
    einsums)."""
    return case.batch * case.nheads * case.seqlen_q * case.seqlen_k * max(case.headdim, case.headdim_v)


# --------------------------------------------------------------------------- #
# Host-side inputs (pure NumPy): rounding to fp16 / bf16
# --------------------------------------------------------------------------- #


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round-to-nearest-even, NaN kept."""
    return arrays.bf16_bits(np, x)


def bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 values."""
    return arrays.bf16_bits_to_float(np, bits)


def round_host(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Round float32 ``x`` to ``dtype``.

    Returns ``(payload, values64)``: ``payload`` is what to copy to the device
    (float16 array, or uint16 bf16 bit patterns), ``values64`` the rounded
    values as float64 for the reference.
    """
    dtype = canonical_dtype(dtype)
    if dtype == "fp16":
        p = np.asarray(x, dtype=np.float32).astype(np.float16)
        return p, p.astype(np.float64)
    bits = bf16_bits(x)
    return bits, bf16_bits_to_float(bits).astype(np.float64)


def host_inputs(case: Case, seed: int, scale: float = 1.0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Standard-normal q, k, v for ``case`` (times ``scale``), rounded to the case's dtype.

    Returns {"q"|"k"|"v": (payload, values64)}; see :func:`round_host`.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in (("q", case.q_shape), ("k", case.kv_shape), ("v", case.v_shape)):
        x = (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))
        out[name] = round_host(x, case.dtype)
    return out


def host_dout(case: Case, seed: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Standard-normal dout of the output's shape, rounded to the case's dtype: (payload, values64).

    Drawn from its own stream (``seed`` + 1_000_003) so q, k, v match :func:`host_inputs`."""
    rng = np.random.default_rng(seed + 1_000_003)
    return round_host(rng.standard_normal(case.out_shape, dtype=np.float32) * np.float32(scale), case.dtype)


# --------------------------------------------------------------------------- #
# Device arrays (lazy imports)
# --------------------------------------------------------------------------- #


def _torch():
    try:
        import torch  # noqa: PLC0415
    except Exception:  # ImportError, or a broken install
        return None
    return torch


def torch_available() -> bool:
    torch = _torch()
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:
        return False


def to_device(payload: np.ndarray, dtype: str, framework: str = "cupy"):
    """Copy a :func:`round_host` payload to the GPU as a CuPy array or torch tensor.

    For bf16 with CuPy this needs CuPy's ml_dtypes-backed bfloat16 (CuPy >= 14);
    if that is unavailable and torch is importable, a torch tensor is returned.
    """
    dtype = canonical_dtype(dtype)
    if framework == "torch":
        torch = _torch()
        if torch is None:
            raise RuntimeError("torch is not importable")
        if dtype == "fp16":
            return torch.from_numpy(np.ascontiguousarray(payload)).cuda()
        return torch.from_numpy(np.ascontiguousarray(payload).view(np.int16)).cuda().view(torch.bfloat16)
    import cupy  # noqa: PLC0415

    if dtype == "fp16":
        return cupy.asarray(payload)
    try:
        import ml_dtypes  # noqa: PLC0415

        return cupy.asarray(np.ascontiguousarray(payload).view(ml_dtypes.bfloat16))
    except Exception as exc:
        if torch_available():
            return to_device(payload, dtype, "torch")
        raise RuntimeError(f"cannot make a bf16 CuPy array ({exc}); install ml_dtypes or torch") from exc


# --------------------------------------------------------------------------- #
# Timing
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    n: int


class TorchEvents:
    """CUDA events on torch's current stream."""

    name = "torch.cuda.Event"

    def __init__(self):
        self.torch = _torch()

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    @staticmethod
    def elapsed_ms(a, b) -> float:
        return a.elapsed_time(b)

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def hold(self, ms: float):
        """Keeps torch's current stream busy for at least ``ms`` milliseconds (a kernel spinning for as many clock
        cycles as the SM clock's maximum gives in that time), so that the calls enqueued after it wait in the
        queue; returns an event recorded after the spin."""
        import cupy  # noqa: PLC0415

        runtime = cupy.cuda.runtime
        khz = runtime.deviceGetAttribute(runtime.cudaDevAttrClockRate, self.torch.cuda.current_device())
        self.torch.cuda._sleep(int(ms * khz))
        done = self.event()
        done.record()
        return done


class CupyEvents:
    """CUDA events on CuPy's current stream."""

    name = "cupy.cuda.Event"

    def __init__(self):
        import cupy  # noqa: PLC0415

        self.cupy = cupy

    def event(self):
        return self.cupy.cuda.Event()

    def elapsed_ms(self, a, b) -> float:
        return self.cupy.cuda.get_elapsed_time(a, b)

    def sync(self) -> None:
        self.cupy.cuda.runtime.deviceSynchronize()


def add_tree_arguments(parser, tree_help: str, cases, rounds: int, repeats: int, sustain_seconds: float) -> None:
    """The arguments of the kernel-source A/B tools (bench/dev/tree_ab.py, bwd_tree_ab.py): --trees, --cases (default
    ``cases``), --rounds, --repeats and --sustain; :func:`trees_of` reads --trees."""
    parser.add_argument("--trees", nargs="+", required=True, help=tree_help)
    parser.add_argument("--cases", nargs="*", default=cases)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--sustain", type=float, default=sustain_seconds,
                        help="seconds of back-to-back calls before each variant's timed ones, so that each is timed "
                             "at the clock its own load settles to (sustain)")


def kernel_options_of(text: str):
    """KernelOptions with the fields of ``key=value,key=value`` changed (values: ints, 1/0 or true/false for bools,
    none): the option sets of bench/dev/options_ab.py and headdim_v_ab.py and the trees of tree_ab.py."""
    from fa2cupy import KernelOptions

    bools = {"1": True, "0": False, "true": True, "false": False}
    fields = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        kind = str(KernelOptions.__dataclass_fields__[key].type)
        if value.lower() == "none":
            fields[key] = None
        elif "bool" in kind:
            if value.lower() not in bools:
                raise ValueError(f"{item}: {key} takes 1/0, true/false or none")
            fields[key] = bools[value.lower()]
        else:
            fields[key] = int(value)
    return KernelOptions(**fields)


def named_kernel_options(text: str) -> tuple:
    """``NAME=key=value,key=value`` as (NAME, :func:`kernel_options_of` the rest): an option set of the A/B tools."""
    name, _, rest = text.partition("=")
    return name, kernel_options_of(rest)


def trees_of(specs) -> dict:
    """--trees' ``name=spec`` items as {name: spec} (a spec may hold '=' itself)."""
    return dict(item.split("=", 1) for item in specs)


def sustain(fn: Callable[[], Any], sync: Callable[[], None], seconds: float) -> int:
    """Calls ``fn`` back to back for ``seconds`` (synchronising every 8 calls, so the queue stays short) and returns
    how many calls it made. A GPU at its power limit sets its clock by the load it runs within a fraction of a
    second: a kernel timed right after another's load, or after idling, runs at that one's clock, not at the one its
    own load settles to."""
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for _ in range(8):
            fn()
        calls += 8
        sync()
    return calls


def time_gpu(fn: Callable[[], Any], events, *, warmup: int = 10, repeats: int = 30,
             max_seconds: float = 3.0, min_repeats: int = 5, queued: bool = False, batch: int = 1,
             sustain_seconds: float = 0.0) -> Timing:
    """Median GPU time of ``fn`` from CUDA events recorded around each call.

    ``warmup`` untimed calls first (the first one may compile kernels), then ``sustain_seconds`` of untimed calls
    back to back (see ``sustain``), then ``repeats`` timed calls back to back (reduced, down to ``min_repeats``, when
    they would take longer than ``max_seconds``).  One synchronisation at the end.

    ``queued`` (torch events): the timed calls are enqueued behind a spinning kernel that outlasts the host's
    enqueueing, so each event pair times the GPU's work for one call, launch included, and never a GPU idling
    while the host dispatches (what the plain timing measures when a call's host path is slower than its
    kernels). A spin that ended before the host was done is tried again twice as long; RuntimeError after four.
    ``batch``: each timed sample is that many calls back to back between one pair of events (time per call: the
    sample / batch), so that the events' own cost is not in every call's time.
    """
    for _ in range(max(1, warmup)):
        fn()
    events.sync()
    sustain(fn, events.sync, sustain_seconds)
    t0 = time.perf_counter()
    fn()
    events.sync()
    est = max(time.perf_counter() - t0, 1e-6)
    n = repeats
    if est * batch * repeats > max_seconds:
        n = max(min_repeats, int(max_seconds / (est * batch)))
    starts = [events.event() for _ in range(n)]
    ends = [events.event() for _ in range(n)]
    for attempt in range(4 if queued else 1):
        # (enqueueing takes at most the measured call with its synchronisation, per call, plus slack; a host
        # that stalls for longer than that gets a spin twice as long at each new attempt)
        held = events.hold(1e3 * (est * batch * n + 0.005) * 2**attempt) if queued else None
        for i in range(n):
            starts[i].record()
            for _ in range(batch):
                fn()
            ends[i].record()
        if held is None or not held.query():
            break
        events.sync()
    else:
        raise RuntimeError("time_gpu(queued=True): the GPU reached the timed calls before the host had enqueued "
                           "them, four times")
    events.sync()
    ms = [events.elapsed_ms(s, e) / batch for s, e in zip(starts, ends)]
    return Timing(statistics.median(ms), min(ms), max(ms), n)


def host_overhead_us(fn: Callable[[], Any], sync: Callable[[], None], n: int = 1000, warmup: int = 50) -> float:
    """Median host wall time of one call of ``fn`` (microseconds), no sync per call."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    sync()
    return statistics.median(ts) * 1e6


# --------------------------------------------------------------------------- #
# Implementations (forward)
# --------------------------------------------------------------------------- #


class Unavailable(Exception):
    """An implementation cannot run this case (missing library, unsupported shape...)."""


def _first_line(exc: BaseException, limit: int = 160) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass
class ForwardInputs:
    case: Case
    framework: str          # "torch" or "cupy"
    q: Any                  # (b, sq, h, d) contiguous, for fa2cupy
    k: Any
    v: Any
    q_t: Any = None         # (b, h, sq, d) contiguous, for SDPA (torch only)
    k_t: Any = None
    v_t: Any = None


def make_forward_inputs(case: Case, seed: int = 0, framework: str | None = None) -> ForwardInputs:
    """Random-normal inputs on the GPU (never zeros).

    With torch: (b, s, h, d) tensors for fa2cupy and separate contiguous
    (b, h, s, d) copies of the same values for SDPA (its native layout).
    Without torch: CuPy arrays only.
    """
    if framework is None:
        framework = "torch" if torch_available() else "cupy"
    if framework == "torch":
        torch = _torch()
        dt = torch.bfloat16 if case.dtype == "bf16" else torch.float16
        g = torch.Generator(device="cuda")
        g.manual_seed(seed)
        q = torch.randn(case.q_shape, device="cuda", dtype=dt, generator=g)
        k = torch.randn(case.kv_shape, device="cuda", dtype=dt, generator=g)
        v = torch.randn(case.v_shape, device="cuda", dtype=dt, generator=g)
        return ForwardInputs(case, "torch", q, k, v,
                             q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                             v.transpose(1, 2).contiguous())
    import cupy  # noqa: PLC0415

    rs = cupy.random.RandomState(seed)
    arrs = []
    for shape in (case.q_shape, case.kv_shape, case.v_shape):
        x = rs.standard_normal(shape, dtype=cupy.float32)
        if case.dtype == "fp16":
            arrs.append(x.astype(cupy.float16))
        else:
            try:
                import ml_dtypes  # noqa: PLC0415

                arrs.append(x.astype(ml_dtypes.bfloat16))
            except Exception:
                payload, _ = round_host(cupy.asnumpy(x), "bf16")
                arrs.append(to_device(payload, "bf16", "cupy"))
    return ForwardInputs(case, "cupy", *arrs)


@dataclasses.dataclass
class Runner:
    fn: Callable[[], Any]
    events: Any
    context: Callable[[], Any]   # context-manager factory wrapped around the timing loop


def fa2cupy_runner(inp: ForwardInputs, varlen: bool = False, **call_kwargs) -> Runner:
    """fa2cupy's forward on ``inp``. ``varlen``: the batch packed as varlen sequences (:func:`packed_varlen`, torch
    inputs); ``call_kwargs`` go to the call (kernel_options=, softcap=, ...)."""
    try:
        import fa2cupy  # noqa: PLC0415
    except Exception as exc:
        raise Unavailable(_first_line(exc)) from exc
    q, k, v, forward = inp.q, inp.k, inp.v, fa2cupy.flash_attn_func
    if varlen:
        q, k, v, _, forward, _ = packed_varlen(q, k, v, q)
    kw = dict(causal=inp.case.causal, **call_kwargs)

    def fn():
        return forward(q, k, v, **kw)

    if inp.framework == "torch":
        # Run fa2cupy on torch's current stream so torch events bracket it,
        # whichever stream the interface would otherwise pick.
        return Runner(fn, TorchEvents(), _external_stream_ctx())
    return Runner(fn, CupyEvents(), contextlib.nullcontext)


def _sdpa_backend(inp: ForwardInputs, backend_name: str, dropout_p: float = 0.0):
    """(torch, context factory selecting the SDPA backend, sdpa, its keyword arguments for this case, with SDPA's
    own dropout at ``dropout_p``); Unavailable when torch or the backend is missing."""
    if inp.framework != "torch":
        raise Unavailable("torch not importable")
    torch = _torch()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    except Exception as exc:
        raise Unavailable(_first_line(exc)) from exc
    backend = getattr(SDPBackend, backend_name, None)
    if backend is None:
        raise Unavailable(f"SDPBackend.{backend_name} missing in torch {torch.__version__}")
    kwargs = {"is_causal": inp.case.causal}
    if inp.case.nheads != inp.case.nheads_kv:
        kwargs["enable_gqa"] = True
    if dropout_p:
        kwargs["dropout_p"] = dropout_p
    return torch, lambda: sdpa_kernel([backend]), torch.nn.functional.scaled_dot_product_attention, kwargs


def _sdpa_runner(inp: ForwardInputs, backend_name: str, dropout_p: float = 0.0) -> Runner:
    torch, ctx, sdpa, kwargs = _sdpa_backend(inp, backend_name, dropout_p)
    q, k, v = inp.q_t, inp.k_t, inp.v_t

    def fn():
        return sdpa(q, k, v, **kwargs)

    try:
        with ctx():
            fn()
        torch.cuda.synchronize()
    except Exception as exc:
        raise Unavailable(_first_line(exc)) from exc
    return Runner(fn, TorchEvents(), ctx)


def sdpa_flash_runner(inp: ForwardInputs) -> Runner:
    return _sdpa_runner(inp, "FLASH_ATTENTION")


def sdpa_cudnn_runner(inp: ForwardInputs) -> Runner:
    return _sdpa_runner(inp, "CUDNN_ATTENTION")


FORWARD_RUNNERS: dict[str, Callable[[ForwardInputs], Runner]] = {
    "fa2cupy": fa2cupy_runner,
    "sdpa_flash": sdpa_flash_runner,
    "sdpa_cudnn": sdpa_cudnn_runner,
}


def _kernel_config(case: Case) -> dict[str, Any] | None:
    """The forward kernel and tile config fa2cupy would pick for ``case`` (None if unknown): the Hopper forward's
    row where it takes the call, else the mma.sync forward's."""
    try:
        from fa2cupy import forward  # noqa: PLC0415

        dtype = "bfloat16" if case.dtype == "bf16" else "float16"
        cfg = forward.kernel_config(gpu_arch(), case.headdim, dtype, "causal" if case.causal else "none",
                                    seqlen_q=case.seqlen_q)
        return {"family": cfg.family, "block_m": cfg.block_m, **dataclasses.asdict(cfg)}
    except Exception:
        return None


def bench_forward_case(case: Case, *, warmup: int = 10, repeats: int = 30, seed: int = 0,
                       impls: Sequence[str] = tuple(FORWARD_RUNNERS), max_seconds: float = 3.0,
                       framework: str | None = None, sustain_seconds: float = 0.0) -> dict[str, Any]:
    """Time every implementation in ``impls`` on ``case``; returns a JSON-able record.

    ``sustain_seconds``: each implementation's timed calls follow that long of its own calls back to back (see
    :func:`sustain`), so that each is timed at the clock its own load settles to, not at the one the implementation
    timed before it left (at the power cap a light kernel leaves a high clock to the next).

    The record also holds ``max_abs_diff``: max |fa2cupy - SDPA| over the
    output (a sanity check that the fast thing is also the right thing).
    """
    inp = make_forward_inputs(case, seed, framework)
    flops = attention_flops(case, "fwd")
    rec: dict[str, Any] = {"label": case.label, "case": case.to_dict(), "mode": "fwd",
                           "flops": flops, "framework": inp.framework, "results": {},
                           "config": _kernel_config(case), "max_abs_diff": None, "diff_vs": None}
    outputs = {}
    for name in impls:
        entry: dict[str, Any] = {"tflops": None, "median_ms": None, "min_ms": None, "max_ms": None,
                                 "n": 0, "error": None}
        try:
            runner = FORWARD_RUNNERS[name](inp)
            with runner.context():
                t = time_gpu(runner.fn, runner.events, warmup=warmup, repeats=repeats,
                             max_seconds=max_seconds, sustain_seconds=sustain_seconds)
                outputs[name] = runner.fn()
            runner.events.sync()
            entry.update(median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms, n=t.n,
                         tflops=tflops_per_s(flops, t.median_ms))
        except Unavailable as exc:
            entry["error"] = f"unavailable: {exc}"
        except Exception as exc:  # keep going: one failure must not lose the whole grid
            entry["error"] = _first_line(exc)
        rec["results"][name] = entry
    ref_name = next((n for n in ("sdpa_flash", "sdpa_cudnn") if n in outputs), None)
    if "fa2cupy" in outputs and ref_name is not None:
        try:
            a = outputs["fa2cupy"]
            if type(a).__module__.split(".")[0] != "torch":
                a = _torch().from_dlpack(a)
            b = outputs[ref_name].transpose(1, 2)
            rec["max_abs_diff"] = float((a.float() - b.float()).abs().max().item())
            rec["diff_vs"] = ref_name
        except Exception as exc:
            rec["diff_vs"] = f"error: {_first_line(exc)}"
    del inp, outputs
    return rec


# --------------------------------------------------------------------------- #
# Implementations (backward, forward + backward)
# --------------------------------------------------------------------------- #

#: Largest normalised difference max|a - b| / max(1, max|b|) between fa2cupy and
#: SDPA before the table marks a case '!' (gradients of long sequences carry more
#: rounding than the forward output).
DIFF_LIMITS: dict[str, float] = {"fwd": 0.05, "bwd": 0.1, "fwdbwd": 0.1}


def _random_like(x, seed: int):
    """Standard-normal array of x's shape/dtype in x's framework (dout for the backward)."""
    if type(x).__module__.split(".")[0] == "torch":
        torch = _torch()
        g = torch.Generator(device=x.device)
        g.manual_seed(seed)
        return torch.randn(x.shape, device=x.device, dtype=x.dtype, generator=g)
    import cupy  # noqa: PLC0415

    return cupy.random.RandomState(seed).standard_normal(x.shape, dtype=cupy.float32).astype(x.dtype)


def _external_stream_ctx():
    """A context factory making torch's current stream CuPy's current stream (as :func:`fa2cupy_runner`)."""
    import warnings  # noqa: PLC0415

    import cupy  # noqa: PLC0415

    ptr = _torch().cuda.current_stream().cuda_stream
    with warnings.catch_warnings():   # CuPy 14 deprecates ExternalStream (still works)
        warnings.simplefilter("ignore", DeprecationWarning)
        stream = cupy.cuda.ExternalStream(ptr)
    return lambda: stream


def packed_varlen(q, k, v, dout):
    """The batch's rows packed as varlen sequences ((batch * seqlen, heads, d) views, one sequence per batch row),
    with fa2cupy's varlen forward and backward bound to their cu_seqlens: (q, k, v, dout, forward, backward)."""
    import fa2cupy  # noqa: PLC0415

    batch, seqlen = q.shape[:2]
    cu = _torch().arange(0, (batch + 1) * seqlen, seqlen, device=q.device, dtype=_torch().int32)
    q, k, v, dout = (x.reshape(batch * seqlen, *x.shape[2:]) for x in (q, k, v, dout))
    fwd_fn, bwd_fn = (functools.partial(f, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seqlen, max_seqlen_k=seqlen)
                      for f in (fa2cupy.flash_attn_varlen_func, fa2cupy.flash_attn_varlen_backward))
    return q, k, v, dout, fwd_fn, bwd_fn


def fa2cupy_backward_runner(inp: ForwardInputs, dout, mode: str = "bwd", deterministic: bool = False,
                            varlen: bool = False, **call_kwargs) -> Runner:
    """fa2cupy's backward (``bwd``: out/lse from one forward, timed call = backward only)
    or forward + backward (``fwdbwd``).  The call returns (dq, dk, dv). ``varlen``: the batch packed as varlen
    sequences (:func:`packed_varlen`, torch inputs); ``call_kwargs`` go to both calls (softcap=, alibi_slopes=)."""
    try:
        import fa2cupy  # noqa: PLC0415

        forward, backward = fa2cupy.flash_attn_func, fa2cupy.flash_attn_backward
    except Exception as exc:
        raise Unavailable(_first_line(exc)) from exc
    q, k, v = inp.q, inp.k, inp.v
    if varlen:
        q, k, v, dout, forward, backward = packed_varlen(q, k, v, dout)
    kw = dict(causal=inp.case.causal, **call_kwargs)
    ctx = _external_stream_ctx() if inp.framework == "torch" else contextlib.nullcontext
    events = TorchEvents() if inp.framework == "torch" else CupyEvents()
    if mode == "bwd":
        with ctx():
            out, lse, _ = forward(q, k, v, return_attn_probs=True, **kw)

        def fn():
            return backward(dout, q, k, v, out, lse, deterministic=deterministic, **kw)
    else:
        def fn():
            o, l_, _ = forward(q, k, v, return_attn_probs=True, **kw)
            return backward(dout, q, k, v, o, l_, deterministic=deterministic, **kw)
    return Runner(fn, events, ctx)


def _sdpa_backward_runner(inp: ForwardInputs, dout_t, backend_name: str, mode: str = "bwd",
                          dropout_p: float = 0.0) -> Runner:
    """SDPA with one backend; ``bwd`` times ``torch.autograd.grad`` of an output computed
    once (retain_graph), ``fwdbwd`` the SDPA call plus its gradient.  Returns
    (dq, dk, dv) in SDPA's (b, h, s, d) layout."""
    torch, ctx, sdpa, kwargs = _sdpa_backend(inp, backend_name, dropout_p)
    q, k, v = (x.detach().requires_grad_(True) for x in (inp.q_t, inp.k_t, inp.v_t))
    try:
        if mode == "bwd":
            with ctx():
                out = sdpa(q, k, v, **kwargs)

            def fn():
                return torch.autograd.grad(out, (q, k, v), dout_t, retain_graph=True)
        else:
            def fn():
                return torch.autograd.grad(sdpa(q, k, v, **kwargs), (q, k, v), dout_t)
        with ctx():
            fn()
        torch.cuda.synchronize()
    except Exception as exc:
        raise Unavailable(_first_line(exc)) from exc
    return Runner(fn, TorchEvents(), ctx)


def peak_memory_bytes(runner: Runner) -> int | None:
    """Peak torch-allocator memory of one call above what was allocated before it
    (inputs, out/lse, a retained SDPA graph), results included; None without torch.

    fa2cupy called with torch tensors allocates dq/dk/dv and its workspaces through
    torch, so the figure compares like with like."""
    torch = _torch()
    if torch is None or not torch_available():
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with runner.context():
        res = runner.fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del res
    return int(peak)


def _grad_diff(a_grads, b_grads_bhsd) -> float:
    """max over dq, dk, dv of max|a - b| / max(1, max|b|); b in (b, h, s, d) layout."""
    torch = _torch()
    worst = 0.0
    for a, b in zip(a_grads, b_grads_bhsd):
        if type(a).__module__.split(".")[0] != "torch":
            a = torch.from_dlpack(a)
        b = b.transpose(1, 2).float()
        worst = max(worst, float((a.float() - b).abs().max().item()) / max(1.0, float(b.abs().max().item())))
    return worst


def bench_backward_case(case: Case, *, mode: str = "bwd", warmup: int = 10, repeats: int = 30, seed: int = 0,
                        impls: Sequence[str] = tuple(IMPL_TITLES), max_seconds: float = 3.0,
                        framework: str | None = None, deterministic: bool = False,
                        memory: bool = True, sustain_seconds: float = 0.0) -> dict[str, Any]:
    """Time the backward (``mode='bwd'``) or forward + backward (``'fwdbwd'``) of every
    implementation in ``impls`` on ``case`` (``sustain_seconds`` as in :func:`bench_forward_case`);
    returns a JSON-able record like :func:`bench_forward_case`'s, plus ``peak_mib`` per implementation (see
    :func:`peak_memory_bytes`) and ``max_abs_diff`` = max over dq/dk/dv of
    max|fa2cupy - SDPA| / max(1, max|SDPA|)."""
    mode = canonical_mode(mode)
    if mode == "fwd":
        raise ValueError("bench_backward_case times bwd or fwdbwd; use bench_forward_case for fwd")
    inp = make_forward_inputs(case, seed, framework)
    dout = _random_like(inp.q, seed + 1)
    dout_t = dout.transpose(1, 2).contiguous() if inp.framework == "torch" else None
    flops = attention_flops(case, mode)
    rec: dict[str, Any] = {"label": case.label, "case": case.to_dict(), "mode": mode, "flops": flops,
                           "framework": inp.framework, "deterministic": bool(deterministic), "results": {},
                           "config": _kernel_config(case), "max_abs_diff": None, "diff_vs": None,
                           "diff_kind": "max over dq,dk,dv of max|fa2cupy - ref| / max(1, max|ref|)",
                           "diff_limit": DIFF_LIMITS[mode]}
    makers = {
        "fa2cupy": lambda: fa2cupy_backward_runner(inp, dout, mode, deterministic),
        "sdpa_flash": lambda: _sdpa_backward_runner(inp, dout_t, "FLASH_ATTENTION", mode),
        "sdpa_cudnn": lambda: _sdpa_backward_runner(inp, dout_t, "CUDNN_ATTENTION", mode),
    }
    outputs = {}
    for name in impls:
        entry: dict[str, Any] = {"tflops": None, "median_ms": None, "min_ms": None, "max_ms": None,
                                 "n": 0, "peak_mib": None, "error": None}
        try:
            runner = makers[name]()
            with runner.context():
                t = time_gpu(runner.fn, runner.events, warmup=warmup, repeats=repeats,
                             max_seconds=max_seconds, sustain_seconds=sustain_seconds)
                outputs[name] = runner.fn()
            runner.events.sync()
            entry.update(median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms, n=t.n,
                         tflops=tflops_per_s(flops, t.median_ms))
            if memory:
                try:
                    peak = peak_memory_bytes(runner)
                    entry["peak_mib"] = None if peak is None else peak / 2**20
                except Exception as exc:
                    entry["peak_error"] = _first_line(exc)
            del runner
        except Unavailable as exc:
            entry["error"] = f"unavailable: {exc}"
        except Exception as exc:  # keep going: one failure must not lose the whole grid
            entry["error"] = _first_line(exc)
        rec["results"][name] = entry
    ref_name = next((n for n in ("sdpa_flash", "sdpa_cudnn") if n in outputs), None)
    if "fa2cupy" in outputs and ref_name is not None:
        try:
            rec["max_abs_diff"] = _grad_diff(outputs["fa2cupy"], outputs[ref_name])
            rec["diff_vs"] = ref_name
        except Exception as exc:
            rec["diff_vs"] = f"error: {_first_line(exc)}"
    makers.clear()
    outputs.clear()
    inp = dout = dout_t = None   # noqa: F841  (free the GPU memory before the next case)
    return rec


def bench_bwd_case(case: Case, **kw) -> dict[str, Any]:
    return bench_backward_case(case, mode="bwd", **kw)


def bench_fwdbwd_case(case: Case, **kw) -> dict[str, Any]:
    return bench_backward_case(case, mode="fwdbwd", **kw)


#: mode -> function(case, **options) -> record
MODE_RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "fwd": bench_forward_case, "bwd": bench_bwd_case, "fwdbwd": bench_fwdbwd_case,
}


# --------------------------------------------------------------------------- #
# Decode (flash_attn_with_kvcache): KV-cache bandwidth
# --------------------------------------------------------------------------- #

#: The decode grid: batch x cache length with batch * length <= 1M tokens.
DECODE_BATCHES: tuple[int, ...] = (1, 8, 64)
DECODE_SEQLENS: tuple[int, ...] = (1024, 4096, 16384, 65536)
DECODE_MAX_TOKENS = 1 << 20


def decode_grid(batches: Iterable[int], seqlens: Iterable[int],
                max_tokens: int = DECODE_MAX_TOKENS) -> list[tuple[int, int]]:
    """(batch, seqlen_k) pairs with batch * seqlen_k <= max_tokens, batch-major."""
    return [(b, s) for b in batches for s in seqlens if b * s <= max_tokens]


def kv_cache_bytes(batch: int, seqlen_k: int, nheads_kv: int, headdim: int, itemsize: int = 2) -> int:
    """Bytes of K and V one decode step must read (the roofline's numerator)."""
    return 2 * batch * seqlen_k * nheads_kv * headdim * itemsize


def graph_ms_per_call(fn: Callable[[], Any], events, *, calls: int = 16, context=None, repeats: int = 15) -> float:
    """GPU time per call of ``fn`` (torch work) replayed from a CUDA graph of ``calls`` calls (median of
    ``repeats`` replays): no host dispatch in it. ``context``: a context factory in force while capturing (an SDPA
    backend choice)."""
    torch = _torch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with context() if context is not None else contextlib.nullcontext():
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up (and any compilation) outside the capture
                fn()
        side.synchronize()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    return time_gpu(graph.replay, events, warmup=3, repeats=repeats).median_ms / calls


def paged_copy(torch, gen, k_cache, v_cache, page_size: int, shuffled: bool = True):
    """(k_pages, v_pages, block_table) holding the same keys and values as the contiguous ``(batch, seqlen_k,
    nheads_kv, d)`` caches, cut into pages of ``page_size`` keys (a divisor of seqlen_k) stored in a random order,
    or in order (``shuffled`` False: the contiguous caches' own layout, read through the table)."""
    batch, seqlen_k = k_cache.shape[:2]
    pages = seqlen_k // page_size
    order = (torch.randperm(batch * pages, device="cuda", generator=gen) if shuffled
             else torch.arange(batch * pages, device="cuda"))
    k_pages = torch.empty_like(k_cache).reshape(batch * pages, page_size, *k_cache.shape[2:])
    v_pages = torch.empty_like(v_cache).reshape(batch * pages, page_size, *v_cache.shape[2:])
    k_pages[order] = k_cache.reshape(k_pages.shape)
    v_pages[order] = v_cache.reshape(v_pages.shape)
    return k_pages, v_pages, order.to(torch.int32).reshape(batch, pages).contiguous()


def bench_decode_case(batch: int, seqlen_k: int, *, nheads: int = 32, nheads_kv: int = 8, headdim: int = 128,
                      dtype: str = "bf16", page_size: int | None = 256, warmup: int = 10, repeats: int = 50,
                      rounds: int = 3, seed: int = 0) -> dict[str, Any]:
    """One decode step (seqlen_q = 1, a full cache of ``seqlen_k`` keys per row, no append) timed for fa2cupy
    (contiguous cache; paged too when ``page_size``) and torch SDPA flash / cuDNN on the same keys and values in
    SDPA's own (batch, heads, seqlen, d) layout. Median of CUDA-event times per call, calls back to back; the
    implementations take turns for ``rounds`` rounds and each keeps its best median.

    Returns the record: microseconds and TB/s (KV bytes / time) per implementation, and the largest
    difference of fa2cupy's outputs from SDPA flash's (paged must equal contiguous bitwise)."""
    import fa2cupy  # noqa: PLC0415

    torch = _torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    tdtype = torch.bfloat16 if canonical_dtype(dtype) == "bf16" else torch.float16
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=tdtype, generator=gen)

    q = randn(batch, 1, nheads, headdim)
    k_cache, v_cache = randn(batch, seqlen_k, nheads_kv, headdim), randn(batch, seqlen_k, nheads_kv, headdim)
    lens = torch.full((batch,), seqlen_k, device="cuda", dtype=torch.int32)
    nbytes = kv_cache_bytes(batch, seqlen_k, nheads_kv, headdim, q.element_size())
    rec: dict[str, Any] = {"batch": batch, "seqlen_k": seqlen_k, "nheads": nheads, "nheads_kv": nheads_kv,
                           "headdim": headdim, "dtype": canonical_dtype(dtype), "kv_bytes": nbytes,
                           "label": f"b{batch} sk{seqlen_k}"}
    events = TorchEvents()
    runners = []  # (name, fn, context factory or None)

    def ours():
        return fa2cupy.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)

    runners.append(("fa2cupy", ours, None))
    out = ours().float()
    if page_size and seqlen_k % page_size == 0:
        k_pages, v_pages, table = paged_copy(torch, gen, k_cache, v_cache, page_size)

        def ours_paged():
            return fa2cupy.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens, block_table=table)

        runners.append(("fa2cupy_paged", ours_paged, None))
        rec["paged_equals_contiguous"] = bool(torch.equal(ours_paged().float(), out))
    qt = q.transpose(1, 2)
    kt, vt = k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run_sdpa():
            return sdpa(qt, kt, vt, enable_gqa=nheads != nheads_kv)

        try:
            with sdpa_kernel([backend]):
                ref = run_sdpa().transpose(1, 2).float()
        except Exception as exc:  # a backend that cannot run this case gets an empty cell
            rec[name + "_us"] = rec[name + "_tbps"] = None
            rec[name + "_error"] = _first_line(exc)
            continue
        if name == "sdpa_flash":
            rec["max_abs_diff"] = float((out - ref).abs().max())
        runners.append((name, run_sdpa, lambda backend=backend: sdpa_kernel([backend])))
    # Rounds that take turns, best median per implementation: the host side of small cases is noisy (a shared
    # CPU), and taking turns gives every implementation the same chances.
    # Each also queued: 8 calls back to back per pair of events, enqueued behind a spinning kernel, so the GPU time
    # per eager call, launch included, without the host's dispatch (which the plain eager timing of small caches
    # measures) or the events' own cost (~3 us a call on both sides).
    best_ms: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn, context in runners:
            for suffix, queued in (("", False), ("_queued", True)):
                with context() if context is not None else contextlib.nullcontext():
                    timing = time_gpu(fn, events, warmup=warmup, repeats=repeats, queued=queued,
                                      batch=8 if queued else 1)
                best_ms[name + suffix] = min(best_ms.get(name + suffix, math.inf), timing.median_ms)
    for name, ms in best_ms.items():
        rec[name + "_us"] = ms * 1e3
        rec[name + "_tbps"] = nbytes / (ms * 1e-3) / 1e12
    # The same calls replayed from a CUDA graph (how serving stacks run decode steps): GPU time per call without
    # the host's dispatch cost, which dominates caches of a few MB in the eager timing above.
    for name, fn, context in runners:
        try:
            ms = graph_ms_per_call(fn, events, context=context, repeats=max(5, repeats // 4))
            rec[name + "_graph_us"] = ms * 1e3
            rec[name + "_graph_tbps"] = nbytes / (ms * 1e-3) / 1e12
        except Exception as exc:
            rec[name + "_graph_tbps"] = None
            rec[name + "_graph_error"] = _first_line(exc)
    for suffix in ("", "_queued", "_graph"):
        best = max((rec.get(n + suffix + "_tbps") or 0.0) for n in ("sdpa_flash", "sdpa_cudnn"))
        ours_tbps = rec.get("fa2cupy" + suffix + "_tbps")
        rec["ratio" + suffix + "_vs_best_sdpa"] = ours_tbps / best if best and ours_tbps else None
    return rec



def decode_table(records: Sequence[dict[str, Any]]) -> str:
    """The decode results as a text table: TB/s per implementation and fa2cupy's ratio to the better SDPA."""
    def tb(x):
        return None if x is None else f"{x:.2f}"

    def ratio(x):
        return None if x is None else f"{x:.2f}x"

    def timing(r, suffix):  # fa2cupy, paged, SDPA flash, SDPA cuDNN and the ratio, for one way of timing
        names = ("fa2cupy", "fa2cupy_paged", "sdpa_flash", "sdpa_cudnn")
        return [tb(r.get(name + suffix + "_tbps")) for name in names] + [
            ratio(r.get("ratio" + suffix + "_vs_best_sdpa"))]

    rows = []
    for r in records:
        rows.append([r["batch"], r["seqlen_k"], f"{r['kv_bytes'] / 2**20:.0f}", *timing(r, ""),
                     None if r.get("fa2cupy_us") is None else f"{r['fa2cupy_us']:.1f}",
                     *timing(r, "_queued"), *timing(r, "_graph"),
                     None if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:.1e}"])
    return format_table(["batch", "seqlen_k", "KV MiB", "fa2cupy TB/s", "paged TB/s", "SDPA flash", "SDPA cuDNN",
                         "vs best SDPA", "fa2cupy us", "queued: fa2cupy", "paged", "flash", "cuDNN", "vs best",
                         "graph: fa2cupy", "paged", "flash", "cuDNN", "vs best", "max|diff|"], rows)


# --------------------------------------------------------------------------- #
# Cold compile and dispatch overhead
# --------------------------------------------------------------------------- #

_COLD_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import cupy
import fa2cupy
from fa2cupy_bench import harness as B
t_import = time.perf_counter() - t0
spec = json.loads(sys.argv[1])
cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))   # create the context outside the timings
res = {"import_s": t_import, "variants": []}
for d, causal in spec["variants"]:
    case = B.Case(1, spec["seqlen"], spec["seqlen"], spec["nheads"], spec["nheads"], d, causal, spec["dtype"])
    inp = {n: B.to_device(p, case.dtype, "cupy") for n, (p, _) in B.host_inputs(case, 0).items()}
    cupy.cuda.runtime.deviceSynchronize()
    t1 = time.perf_counter()
    fa2cupy.flash_attn_func(inp["q"], inp["k"], inp["v"], causal=causal)
    cupy.cuda.runtime.deviceSynchronize()
    t2 = time.perf_counter()
    fa2cupy.flash_attn_func(inp["q"], inp["k"], inp["v"], causal=causal)
    cupy.cuda.runtime.deviceSynchronize()
    t3 = time.perf_counter()
    res["variants"].append({"headdim": d, "causal": causal, "first_call_s": t2 - t1, "second_call_s": t3 - t2})
print("FA2CUPY_COLD " + json.dumps(res))
"""


def _package_root() -> str:
    """The folder holding the fa2cupy package: the repository root in a source checkout."""
    import fa2cupy  # noqa: PLC0415 -- needs no CuPy

    return str(Path(fa2cupy.__file__).resolve().parent.parent)


def _run_cold_child(spec: dict[str, Any], cache_dir: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    env["CUPY_CACHE_DIR"] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH", "")) if p)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _COLD_CHILD, json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith("FA2CUPY_COLD "):
            res = json.loads(line[len("FA2CUPY_COLD "):])
            res["process_wall_s"] = wall
            return res
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    raise RuntimeError(f"child exited {proc.returncode}: {tail[0]}")


def cold_compile(variants: Sequence[tuple[int, bool]], dtype: str = "bf16", seqlen: int = 1024,
                 nheads: int = 16, timeout: float = 600.0) -> dict[str, Any]:
    """Wall time of the first fa2cupy call per (headdim, causal) variant in a fresh process.

    Run twice in subprocesses sharing one new, empty ``CUPY_CACHE_DIR``: the
    first run pays NVRTC compilation ("cold"), the second only loads the
    kernels from the on-disk cache ("disk_cached").  ``second_call_s`` is the
    in-process cached call (kernel already loaded).
    """
    spec = {"variants": [[int(d), bool(c)] for d, c in variants], "dtype": canonical_dtype(dtype),
            "seqlen": seqlen, "nheads": nheads}
    out: dict[str, Any] = {"spec": spec}
    with tempfile.TemporaryDirectory(prefix="fa2cupy-cold-") as tmp:
        for key in ("cold", "disk_cached"):
            try:
                out[key] = _run_cold_child(spec, tmp, timeout)
            except Exception as exc:
                out[key] = {"error": _first_line(exc)}
    return out


def dispatch_overhead(dtype: str = "bf16", n: int = 1000) -> dict[str, Any]:
    """Host wall time per call (median of ``n``, microseconds) for a tiny problem
    (b=1, s=128, h=1, d=64): fa2cupy from torch tensors, from CuPy arrays, and SDPA
    flash for comparison.  Kernels are warm (cached) before timing.
    """
    case = Case(1, 128, 128, 1, 1, 64, False, dtype)
    res: dict[str, Any] = {"case": case.label, "n": n}
    try:
        import fa2cupy  # noqa: PLC0415
    except Exception as exc:
        return {**res, "error": _first_line(exc)}

    def probe(key, fn, sync):
        try:
            res[key] = host_overhead_us(fn, sync, n=n)
        except Exception as exc:
            res[key] = None
            res[key + "_error"] = _first_line(exc)

    import cupy  # noqa: PLC0415

    ci = make_forward_inputs(case, 0, "cupy")
    probe("fa2cupy_cupy_us", lambda: fa2cupy.flash_attn_func(ci.q, ci.k, ci.v),
          cupy.cuda.runtime.deviceSynchronize)
    if torch_available():
        torch = _torch()
        ti = make_forward_inputs(case, 0, "torch")
        probe("fa2cupy_torch_us", lambda: fa2cupy.flash_attn_func(ti.q, ti.k, ti.v), torch.cuda.synchronize)
        try:
            r = sdpa_flash_runner(ti)
            with r.context():
                probe("sdpa_flash_torch_us", r.fn, torch.cuda.synchronize)
        except Unavailable as exc:
            res["sdpa_flash_torch_us"] = None
            res["sdpa_flash_torch_us_error"] = str(exc)
    return res


# --------------------------------------------------------------------------- #
# Environment
# --------------------------------------------------------------------------- #


def gpu_arch(device: int = 0) -> int:
    """Compute capability as an int, e.g. 90 for sm_90 (via CuPy)."""
    import cupy  # noqa: PLC0415

    props = cupy.cuda.runtime.getDeviceProperties(device)
    return int(props["major"]) * 10 + int(props["minor"])


def cuda_version_str(v: int | None) -> str | None:
    """12040 -> '12.4'."""
    if not v:
        return None
    return f"{v // 1000}.{(v % 1000) // 10}"


def _installed_version(name: str) -> str | None:
    """A distribution's version from its metadata (None when not installed), without importing it."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_info() -> dict[str, Any]:
    """GPU / library versions for the JSON and ``fa2cupy info`` (every field best-effort: without a GPU or a driver
    the versions are still there, and ``gpu_error`` says why there is no GPU)."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "numpy": np.__version__,
    }
    try:
        import cupy  # noqa: PLC0415
    except Exception as exc:
        env["cupy_error"] = _first_line(exc)
        cupy = None
    if cupy is not None:
        env["cupy"] = cupy.__version__
        # Which wheel provides it (cupy-cuda12x, cupy-cuda13x); more than one is a broken install.
        env["cupy_package"] = ", ".join(sorted(set(importlib.metadata.packages_distributions().get("cupy", []))))
        rt = cupy.cuda.runtime
        versions = {
            "cuda_runtime": lambda: cuda_version_str(rt.runtimeGetVersion()),   # the CUDA CuPy was built for
            "cuda_driver": lambda: cuda_version_str(rt.driverGetVersion()),     # None: no driver
            "nvrtc": lambda: ".".join(map(str, cupy.cuda.nvrtc.getVersion())),
        }
        for key, version in versions.items():
            try:
                env[key] = version()
            except Exception as exc:
                env[key] = f"error: {_first_line(exc)}"
        try:
            props = rt.getDeviceProperties(0)
            name = props["name"]
            env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
            env["compute_capability"] = f"{props['major']}.{props['minor']}"
            env["sm_count"] = int(props["multiProcessorCount"])
            env["gpu_memory_gib"] = round(props["totalGlobalMem"] / 2**30, 1)
        except Exception as exc:
            env["gpu_error"] = _first_line(exc)
    jax = _installed_version("jax")
    if jax is not None:
        env["jax"] = jax
    torch = _torch()
    if torch is not None:
        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        try:
            env["cudnn"] = torch.backends.cudnn.version()
        except Exception:
            pass
    try:
        import fa2cupy  # noqa: PLC0415

        env["fa2cupy"] = getattr(fa2cupy, "__version__", None)
    except Exception as exc:
        env["fa2cupy_error"] = _first_line(exc)
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_package_root(),
                             capture_output=True, text=True, timeout=5)
        if sha.returncode == 0:
            env["git_commit"] = sha.stdout.strip()
            # The kernels timed are the sources on disk: say so when they are not that commit's.
            changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "cuda", "fa2cupy"],
                                     cwd=_package_root(), capture_output=True, text=True, timeout=5)
            if changed.returncode == 0 and changed.stdout.strip():
                env["git_commit"] += "+modified"
    except Exception:
        pass
    return env


# --------------------------------------------------------------------------- #
# Output: tables, JSON, plot
# --------------------------------------------------------------------------- #


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """Plain-text table. ``align``: one char per column, 'l' or 'r' (default: first
    column left, the rest right).  None cells print as 'n/a'."""
    ncol = len(headers)
    if align is None:
        align = "l" + "r" * (ncol - 1)
    if len(align) != ncol:
        raise ValueError("align must have one character per column")
    cells = [[str(h) for h in headers]]
    for r in rows:
        if len(r) != ncol:
            raise ValueError(f"row has {len(r)} cells, expected {ncol}: {r!r}")
        cells.append(["n/a" if c is None else str(c) for c in r])
    widths = [max(len(row[i]) for row in cells) for i in range(ncol)]

    def line(row):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(row, widths, align)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def _fmt_tflops(x: float | None) -> str | None:
    return None if x is None else f"{x:.1f}"


def _ratio(a: float | None, b: float | None) -> str | None:
    if a is None or b is None or b == 0:
        return None
    return f"{a / b:.2f}x"


def results_table(records: Sequence[dict[str, Any]]) -> str:
    """Table of TFLOPs/s: case, fa2cupy, SDPA flash, SDPA cuDNN, ratio vs flash, ratio vs cuDNN.

    A '!' after the fa2cupy figure marks a difference from SDPA above the record's
    ``diff_limit`` (default 0.05: max |fa2cupy - SDPA| of the forward output), i.e. a wrong result.
    """
    headers = ["case", "fa2cupy", "SDPA flash", "SDPA cuDNN", "vs flash", "vs cuDNN"]
    rows = []
    for rec in records:
        r = rec["results"]
        t = {k: (r.get(k) or {}).get("tflops") for k in IMPL_TITLES}
        fa = _fmt_tflops(t["fa2cupy"])
        diff = rec.get("max_abs_diff")
        if fa is not None and diff is not None and diff > rec.get("diff_limit", DIFF_LIMITS["fwd"]):
            fa += "!"
        rows.append([rec["label"], fa, _fmt_tflops(t["sdpa_flash"]), _fmt_tflops(t["sdpa_cudnn"]),
                     _ratio(t["fa2cupy"], t["sdpa_flash"]), _ratio(t["fa2cupy"], t["sdpa_cudnn"])])
    return format_table(headers, rows)


def _fmt_mib(x: float | None) -> str | None:
    return None if x is None else f"{x:.0f}"


def memory_table(records: Sequence[dict[str, Any]]) -> str | None:
    """Table of peak extra memory (MiB, torch allocator, see :func:`peak_memory_bytes`) per
    implementation, with fa2cupy's ratio to SDPA flash; None when no record measured any."""
    if not any((e or {}).get("peak_mib") is not None for r in records for e in r["results"].values()):
        return None
    headers = ["case"] + [f"{t} MiB" for t in IMPL_TITLES.values()] + ["vs flash"]
    rows = []
    for rec in records:
        m = {k: (rec["results"].get(k) or {}).get("peak_mib") for k in IMPL_TITLES}
        rows.append([rec["label"], *(_fmt_mib(m[k]) for k in IMPL_TITLES), _ratio(m["fa2cupy"], m["sdpa_flash"])])
    return format_table(headers, rows)


def flops_description(mode: str) -> str:
    """The FLOP convention of ``mode`` in words (for the JSON)."""
    mode = canonical_mode(mode)
    f = FLOP_FACTORS[mode]
    base = "4*b*h*sq*sk*d, halved when causal"
    return base if f == 1.0 else f"{f:g} x ({base}) (FlashAttention-2 paper accounting)"


def errors_summary(records: Sequence[dict[str, Any]]) -> list[str]:
    """One line per distinct (implementation, error) pair."""
    seen: dict[tuple[str, str], int] = {}
    for rec in records:
        for impl, entry in rec["results"].items():
            if entry.get("error"):
                seen[(impl, entry["error"])] = seen.get((impl, entry["error"]), 0) + 1
    return [f"{IMPL_TITLES.get(i, i)}: {e} ({n} case{'s' if n != 1 else ''})" for (i, e), n in seen.items()]


def slug(text: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (letters, digits, '-')."""
    s = re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-")
    return s or "unknown"


def result_basename(mode: str, gpu: str, when: _dt.datetime | None = None) -> str:
    """'fwd_nvidia-h100-80gb-hbm3_20261117-1432' (no extension)."""
    when = when or _dt.datetime.now()
    return f"{mode}_{slug(gpu)}_{when.strftime('%Y%m%d-%H%M%S')}"


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    return path


def plot_results(records: Sequence[dict[str, Any]], path: str | os.PathLike, title: str = "") -> str | None:
    """PNG: one panel per (headdim, causal), x = seqlen, y = TFLOPs/s, one line per
    implementation.  Returns None on success, else a one-line reason it was skipped."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except Exception as exc:
        return f"plot skipped: matplotlib unavailable ({_first_line(exc)})"
    panels: dict[tuple[int, bool], list[dict[str, Any]]] = {}
    for rec in records:
        c = rec["case"]
        panels.setdefault((c["headdim"], c["causal"]), []).append(rec)
    if not panels:
        return "plot skipped: no results"
    keys = sorted(panels)
    ncols = min(2, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        recs = sorted(panels[key], key=lambda r: r["case"]["seqlen_q"])
        xs = [r["case"]["seqlen_q"] for r in recs]
        for impl, title_ in IMPL_TITLES.items():
            ys = [(r["results"].get(impl) or {}).get("tflops") for r in recs]
            if all(y is None for y in ys):
                continue
            ax.plot(xs, [np.nan if y is None else y for y in ys], marker="o", label=title_)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x) for x in xs])
        ax.set_title(f"headdim {key[0]}, {'causal' if key[1] else 'non-causal'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOPs/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
