"""Error bounds and assertions for checking attention results against the float64 reference, ``numpy.testing`` style.

fa2cupy's tests, ``fa2cupy check`` and the benchmarks accept a result by these rules; use them to validate your own
set-up (a new GPU, driver or CuPy build) the same way. Nothing here needs CuPy or a GPU: device arrays (CuPy,
PyTorch, JAX) are copied to the host with :func:`to_numpy64`, which imports no framework the array does not come
from.

The rules, with ``u`` the unit roundoff of the inputs' dtype (2^-11 for float16, 2^-8 for bfloat16):

* output: ``max|out - ref_out| <= 2^-7 (bf16) or 2^-10 (fp16) * max(1, max|ref_out|)`` (:func:`out_bound`);
  rows that see no key must be exactly 0 (``ref_out`` is 0 there);
* lse: ``|lse - ref_lse| <= 1e-3 * max(1, |ref_lse|)`` on the rows that see a key (:func:`lse_bound`);
* gradients, for g in dq, dk, dv: ``max|g - ref_g| <= 16 u max|ref_g| + floor`` (:func:`gradient_bound`,
  :func:`gradient_floor`), with ``ref_g`` the float64 gradients *for the out the backward was given*
  (:func:`reference_gradients`). The derivation and calibration of the constant 16 are in the docstring of
  tests/test_backward_gpu.py.

Example (any framework's arrays; the reference runs in float64 NumPy)::

    import numpy as np
    import cupy
    import fa2cupy
    from fa2cupy.reference import attention_ref
    from fa2cupy.testing import assert_attention_close, assert_gradients_close, to_numpy64

    q, k, v, dout = (cupy.random.standard_normal((2, 300, 8, 64), dtype=np.float32).astype(np.float16)
                     for _ in range(4))
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref_out, ref_lse = attention_ref(to_numpy64(q), to_numpy64(k), to_numpy64(v), causal=True)
    assert_attention_close(out, ref_out, lse=lse, ref_lse=ref_lse)          # AssertionError if outside the bounds
    grads = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    assert_gradients_close(grads, dout, q, k, v, out, causal=True)
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import _INSTALL_HINT
from .arrays import bf16_bits_to_float
from .reference import attention_probs_ref, attention_ref, attention_ref_backward

__all__ = [
    "UNIT_ROUNDOFF",
    "AttentionErrors",
    "assert_attention_close",
    "assert_gradients_close",
    "attention_errors",
    "dtype_name",
    "gpu_unavailable_reason",
    "gradient_bound",
    "gradient_errors",
    "gradient_floor",
    "lse_bound",
    "out_bound",
    "reference_gradients",
    "to_numpy64",
    "unit_roundoff",
]

# --------------------------------------------------------------------------- #
# dtypes and host copies
# --------------------------------------------------------------------------- #

_DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16"}

#: Unit roundoff (half an ulp of 1) of the kernels' input dtypes, under either spelling: the ``u`` of the bounds.
UNIT_ROUNDOFF: dict[str, float] = {"fp16": 2.0 ** -11, "float16": 2.0 ** -11, "bf16": 2.0 ** -8, "bfloat16": 2.0 ** -8}


def dtype_name(dtype) -> str:
    """``"fp16"`` or ``"bf16"`` for any spelling of float16 / bfloat16: a string (``"float16"``, ``"half"``,
    ``"bfloat16"``, ``"bf16"``, ...), a NumPy, ml_dtypes, CuPy or JAX dtype, or a torch dtype.

    Raises:
        ValueError: any other dtype (the kernels take float16 and bfloat16 inputs only).
    """
    if isinstance(dtype, str):
        key = dtype
    else:
        try:
            key = np.dtype(dtype).name
        except TypeError:  # torch.float16 and the like: not NumPy dtypes, but "torch.float16" as text
            key = str(dtype)
    key = key.strip().lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be float16 or bfloat16 (fp16, bf16), got {dtype!r}")
    return _DTYPE_NAMES[key]


def unit_roundoff(dtype) -> float:
    """Unit roundoff of float16 (2^-11) or bfloat16 (2^-8), any spelling :func:`dtype_name` takes."""
    return UNIT_ROUNDOFF[dtype_name(dtype)]


def to_numpy64(x) -> np.ndarray:
    """A float64 NumPy copy of a CuPy array, torch tensor, JAX array or NumPy array (bfloat16 included).

    Device arrays are copied to the host (a synchronising copy on the array's framework's current stream)."""
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        return x.detach().float().cpu().numpy().astype(np.float64)
    if module == "cupy":
        if x.dtype.name == "bfloat16":
            import cupy  # noqa: PLC0415 -- only reached with a CuPy array in hand

            bits = cupy.ascontiguousarray(x).view(cupy.uint16).get()
            return bf16_bits_to_float(np, bits).astype(np.float64)
        return x.get().astype(np.float64)
    if hasattr(x, "__array__") or isinstance(x, (np.ndarray, np.generic, list, tuple, float, int)):
        a = np.asarray(x)
        if a.dtype.name == "bfloat16":
            return bf16_bits_to_float(np, a.view(np.uint16)).astype(np.float64)
        return a.astype(np.float64)
    raise TypeError(f"cannot convert {type(x).__module__}.{type(x).__qualname__} to a NumPy array")


def _dtype_of(x, what: str) -> str:
    dtype = getattr(x, "dtype", None)
    try:
        return dtype_name(dtype)
    except ValueError:
        raise ValueError(f"pass dtype= (float16 or bfloat16): it cannot be read from {what}, whose dtype is "
                         f"{dtype}") from None


# --------------------------------------------------------------------------- #
# Is there a GPU to test on?
# --------------------------------------------------------------------------- #


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def gpu_unavailable_reason() -> str | None:
    """None when CuPy can run kernels on a CUDA GPU here, else one line saying plainly why not: CuPy missing (with
    the extras that install it), no NVIDIA driver, a driver older than CuPy's CUDA, no device. The reason fa2cupy's
    GPU tests skip and the ``fa2cupy`` command stops; it makes no CUDA context."""
    try:
        import cupy  # noqa: PLC0415
    except ImportError as error:
        if error.name in ("cupy", "cupy_backends"):
            return f"CuPy is not installed; install it with {_INSTALL_HINT}"
        return _one_line(f"CuPy failed to import ({error}); reinstall it with {_INSTALL_HINT}")
    except Exception as error:  # a broken install: CUDA libraries missing, ...
        return _one_line(f"CuPy failed to import ({type(error).__name__}: {error}); reinstall it with "
                         f"{_INSTALL_HINT}")
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except Exception as error:
        return _cuda_error_reason(runtime, _one_line(error))
    if count < 1:
        return "no CUDA GPU found: the NVIDIA driver reports no device (see CUDA_VISIBLE_DEVICES)"
    return None


def _cuda_error_reason(runtime, text: str) -> str:
    """Plain words for the CUDA runtime's error when it looked for devices."""
    if "cudaErrorInsufficientDriver" in text:
        # The runtime says this both when there is no driver at all and when the driver is too old for it; the
        # driver's version, 0 when none is loaded, tells the two apart.
        try:
            driver = int(runtime.driverGetVersion())
        except Exception:
            driver = 0
        if driver == 0:
            return "no GPU or no CUDA driver found (the NVIDIA driver's library, libcuda, is not installed)"
        try:
            needed = f"CUDA {_cuda_version(int(runtime.runtimeGetVersion()))}"
        except Exception:
            needed = "the CUDA version"
        return (f"the NVIDIA driver supports CUDA {_cuda_version(driver)}, older than the {needed} this CuPy was built "
                f"for: update the driver, or install the CuPy for the driver's CUDA ({_INSTALL_HINT})")
    if "cudaErrorNoDevice" in text:
        return "no CUDA GPU found: the NVIDIA driver sees no device (cudaErrorNoDevice; see CUDA_VISIBLE_DEVICES)"
    return f"no usable CUDA GPU ({text})"


# --------------------------------------------------------------------------- #
# Bounds
# --------------------------------------------------------------------------- #

#: Forward output bound, relative to max(1, max|ref|).
OUT_REL: dict[str, float] = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10}

#: Forward lse bound, relative to max(1, |ref|).
LSE_REL = 1e-3

#: Backward: max|g - ref_g| <= GRAD_C * u * max|ref_g| + floor (see :func:`gradient_bound`).
GRAD_C = 16.0

#: Backward absolute floor, relative to :func:`gradient_floor`'s magnitude.
GRAD_FLOOR_REL = 2.0 ** -20


def out_bound(dtype, ref_absmax: float) -> float:
    """Bound on max |out - ref|: 2^-7 (bf16) or 2^-10 (fp16) times max(1, max |ref|)."""
    return OUT_REL[dtype_name(dtype)] * max(1.0, float(ref_absmax))


def lse_bound(ref_lse: np.ndarray) -> np.ndarray:
    """Elementwise bound on |lse - ref_lse|: 1e-3 * max(1, |ref_lse|)."""
    return LSE_REL * np.maximum(1.0, np.abs(ref_lse))


def gradient_floor(softmax_scale: float, headdim: int, absmax_dout: float, absmax_v: float,
                   absmax_qk: float) -> float:
    """Absolute floor of the backward bound: ``2^-20 * scale * d * max|dO| * max|v| * max(max|q|, max|k|)``.

    It only matters when the exact gradient is ~0 -- e.g. every visible row sees one
    key, so ``dS = P * (dP - D) = 0`` exactly, while the kernel forms ``dP - D`` from
    two fp32 dot products of length d (error <= ~2 d 2^-24 max|dO| max|v|) and
    multiplies by ``scale * k`` (or ``q``).  2^-20 leaves a factor 8 over that
    worst case and is ~2^-9 below an fp16 rounding of the same magnitude.
    """
    return (GRAD_FLOOR_REL * abs(float(softmax_scale)) * int(headdim) * float(absmax_dout)
            * float(absmax_v) * float(absmax_qk))


def gradient_bound(dtype, ref_absmax: float, floor: float = 0.0) -> float:
    """Bound on max |g - ref_g| for g in dq, dk, dv: ``16 * u * max|ref_g| + floor``.

    u is the unit roundoff (fp16 2^-11, bf16 2^-8); ``ref_g`` is
    :func:`reference_gradients` (the float64 gradients *for the out that the
    backward was given*); ``floor`` is :func:`gradient_floor`.  Derivation and
    calibration: tests/test_backward_gpu.py's docstring.
    """
    return GRAD_C * unit_roundoff(dtype) * max(0.0, float(ref_absmax)) + max(0.0, float(floor))


# --------------------------------------------------------------------------- #
# Forward: output and lse
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class AttentionErrors:
    """How far a forward result is from the reference, against the bounds (see :func:`attention_errors`)."""

    out_err: float                    #: max |out - ref_out| (inf when out has a NaN or inf)
    out_bound: float                  #: :func:`out_bound` for this dtype and max |ref_out|
    out_worst: tuple[int, ...] | None  #: index of the largest output error (None for empty arrays)
    lse_err: float | None = None      #: max |lse - ref_lse| on rows that see a key (None: lse not compared)
    lse_ratio: float | None = None    #: max of |lse - ref_lse| / :func:`lse_bound` (passes when <= 1)
    lse_worst: tuple[int, ...] | None = None  #: index of the largest lse ratio
    masked_rows: int = 0              #: rows (query, head) that see no key: out must be 0 there

    @property
    def passed(self) -> bool:
        return self.out_err <= self.out_bound and (self.lse_ratio is None or self.lse_ratio <= 1.0)


def _row_mask_like_out(valid: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:
    """The (query, head) mask ``valid`` in lse's layout, broadcastable against out."""
    if len(out_shape) == 4:   # out (b, sq, h, d), lse (b, h, sq)
        return np.transpose(valid, (0, 2, 1))[..., None]
    if len(out_shape) == 3:   # varlen: out (total_q, h, d), lse (h, total_q)
        return np.transpose(valid)[..., None]
    raise ValueError(f"out must be (batch, seqlen_q, nheads, headdim) or varlen (total_q, nheads, headdim), "
                     f"got shape {out_shape}")


def attention_errors(out, ref_out, dtype=None, *, lse=None, ref_lse=None) -> AttentionErrors:
    """Errors of a forward result (``out`` and optionally ``lse``) against the float64 reference.

    Args:
        out: the output, any framework's array: ``(batch, seqlen_q, nheads, headdim)``, or varlen
            ``(total_q, nheads, headdim)``.
        ref_out: the reference output of the same shape (:func:`fa2cupy.reference.attention_ref`).
        dtype: the inputs' dtype (float16 / bfloat16, any spelling); None reads it from ``out``.
        lse, ref_lse: the log-sum-exp and its reference, ``(batch, nheads, seqlen_q)`` (varlen ``(nheads,
            total_q)``), both or neither. Rows whose ``ref_lse`` is not finite see no key: the reference output is 0
            there and their lse is not compared.

    Raises:
        ValueError: shapes that differ, only one of ``lse`` / ``ref_lse``, or a dtype that cannot be told.
    """
    if (lse is None) != (ref_lse is None):
        raise ValueError("pass both lse and ref_lse, or neither")
    dtype = _dtype_of(out, "out") if dtype is None else dtype_name(dtype)
    out, ref_out = to_numpy64(out), to_numpy64(ref_out)
    if out.shape != ref_out.shape:
        raise ValueError(f"out has shape {out.shape}, ref_out {ref_out.shape}: they must match")
    valid = None
    if ref_lse is not None:
        lse, ref_lse = to_numpy64(lse), to_numpy64(ref_lse)
        if lse.shape != ref_lse.shape:
            raise ValueError(f"lse has shape {lse.shape}, ref_lse {ref_lse.shape}: they must match")
        valid = np.isfinite(ref_lse)
        ref_out = np.where(_row_mask_like_out(valid, out.shape), np.nan_to_num(ref_out), 0.0)
    diff = np.abs(out - ref_out)
    out_worst = tuple(int(i) for i in np.unravel_index(np.argmax(diff), diff.shape)) if diff.size else None
    out_err = float(diff.max()) if diff.size else 0.0
    if not np.all(np.isfinite(out)):
        out_err = math.inf
    errors = AttentionErrors(out_err, out_bound(dtype, float(np.abs(ref_out).max(initial=0.0))), out_worst)
    if valid is None:
        return errors
    lse_err = lse_ratio = lse_worst = None
    if valid.any():
        ratio = np.full(lse.shape, -np.inf)
        with np.errstate(invalid="ignore"):
            ratio[valid] = np.abs(lse[valid] - ref_lse[valid]) / lse_bound(ref_lse[valid])
        ratio[valid & ~np.isfinite(ratio)] = math.inf   # a NaN or inf lse where the reference is finite
        lse_worst = tuple(int(i) for i in np.unravel_index(np.argmax(ratio), ratio.shape))
        lse_ratio = float(ratio[lse_worst])
        ld = np.abs(lse[valid] - ref_lse[valid])
        lse_err = float(ld.max()) if np.all(np.isfinite(ld)) else math.inf
    return dataclasses.replace(errors, lse_err=lse_err, lse_ratio=lse_ratio, lse_worst=lse_worst,
                               masked_rows=int((~valid).sum()))


def assert_attention_close(out, ref_out, dtype=None, *, lse=None, ref_lse=None) -> None:
    """Raise AssertionError, saying where and by how much, when a forward result is outside the bounds.

    Arguments as for :func:`attention_errors`: ``max|out - ref_out| <= out_bound(dtype, max|ref_out|)`` and, with
    ``lse``/``ref_lse``, ``|lse - ref_lse| <= lse_bound(ref_lse)`` on every row that sees a key.
    """
    e = attention_errors(out, ref_out, dtype, lse=lse, ref_lse=ref_lse)
    if e.passed:
        return
    dtype = _dtype_of(out, "out") if dtype is None else dtype_name(dtype)
    problems = []
    if not e.out_err <= e.out_bound:
        problems.append(f"max|out - ref_out| = {e.out_err:.3e} at index {e.out_worst} exceeds the bound "
                        f"{e.out_bound:.3e} ({OUT_REL[dtype]:.3g} * max(1, max|ref_out|), {dtype})")
    if e.lse_ratio is not None and not e.lse_ratio <= 1.0:
        problems.append(f"|lse - ref_lse| is {e.lse_ratio:.3g} times its bound (1e-3 * max(1, |ref_lse|)) at index "
                        f"{e.lse_worst}; max|lse - ref_lse| = {e.lse_err:.3e}")
    raise AssertionError("attention output not close to the reference: " + "; ".join(problems))


# --------------------------------------------------------------------------- #
# Backward: gradients
# --------------------------------------------------------------------------- #


def reference_gradients(dout, q, k, v, out, softmax_scale: float | None = None, causal: bool = False,
                        ref_out: np.ndarray | None = None, window_size=(-1, -1)):
    """Float64 (dq, dk, dv) of attention for the ``out`` the backward is *given*.

    FlashAttention-2's backward takes ``out`` as an input and uses it only in
    ``D = rowsum(dO * out)``.  The kernel's out is the rounded forward result, not
    the exact one, and where the softmax is peaked (large scale) ``dP - D`` cancels,
    so that difference can dominate dq/dk while owing nothing to the backward.
    This is :func:`fa2cupy.reference.attention_ref_backward` (exact out) plus the
    exact first-order term for ``dD = rowsum(dO * (out - ref_out))``, which is
    linear in D:  dq -= scale dD_i (P K)_i,  dk_j -= scale sum_i P_ij dD_i q_i
    (summed over each kv head's query heads); dv does not depend on D.
    All arrays float64-convertible host arrays, flash-attn layout; ``out`` is what the kernel
    returned (rows with no visible key are 0 there and in the reference); ``ref_out``, the exact output, is
    computed when not given.
    """
    dout, q, k, v, out = (np.asarray(x, dtype=np.float64) for x in (dout, q, k, v, out))
    dq, dk, dv = attention_ref_backward(dout, q, k, v, softmax_scale=softmax_scale, causal=causal,
                                        window_size=window_size)
    if ref_out is None:
        ref_out, _ = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    dD = np.einsum("bqhd,bqhd->bhq", dout, out - np.asarray(ref_out, np.float64))
    if not np.any(dD):
        return dq, dk, dv
    p = attention_probs_ref(q, k, scale, causal, window_size)          # (b, h, sq, sk)
    kr = np.repeat(k, h // hkv, axis=2).transpose(0, 2, 1, 3)          # (b, h, sk, d)
    dq = dq - scale * (dD[..., None] * np.matmul(p, kr)).transpose(0, 2, 1, 3)
    x = dD[..., None] * q.transpose(0, 2, 1, 3)                          # (b, h, sq, d)
    ptx = np.matmul(p.transpose(0, 1, 3, 2), x)                          # (b, h, sk, d)
    dk = dk - scale * ptx.reshape(b, hkv, h // hkv, sk, d).sum(axis=2).transpose(0, 2, 1, 3)
    return dq, dk, dv


GRAD_NAMES = ("dq", "dk", "dv")


def gradient_errors(grads, dout, q, k, v, out, dtype=None, softmax_scale: float | None = None, causal: bool = False,
                    window_size=(-1, -1), *, ref_grads=None) -> list[tuple[str, float, float]]:
    """``[(name, max|g - ref_g|, bound)]`` for g in (dq, dk, dv): the one backward acceptance rule.

    Args:
        grads: (dq, dk, dv), any framework's arrays, flash-attn layout.
        dout, q, k, v: the backward's inputs; ``out``: the forward output the backward was given.
        dtype: the inputs' dtype (float16 / bfloat16, any spelling); None reads it from ``q``.
        softmax_scale, causal, window_size: as passed to the forward and backward.
        ref_grads: the reference gradients when already computed, else :func:`reference_gradients`.

    The error is ``inf`` where g has a NaN or inf; the bound is :func:`gradient_bound` with :func:`gradient_floor`.

    Raises:
        ValueError: a gradient whose shape is not its reference's, or a dtype that cannot be told.
    """
    dtype = _dtype_of(q, "q") if dtype is None else dtype_name(dtype)
    dout, q, k, v, out = (to_numpy64(x) for x in (dout, q, k, v, out))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if ref_grads is None:
        ref_grads = reference_gradients(dout, q, k, v, out, softmax_scale=scale, causal=causal,
                                        window_size=window_size)

    def amax(x):
        return float(np.abs(x).max(initial=0.0))

    # (the dot products' length: q's head dim or v's, the longer)
    floor = gradient_floor(scale, max(q.shape[-1], v.shape[-1]), amax(dout), amax(v), max(amax(q), amax(k)))
    result = []
    for name, g, ref in zip(GRAD_NAMES, grads, ref_grads):
        g, ref = to_numpy64(g), np.asarray(ref, dtype=np.float64)
        if g.shape != ref.shape:
            raise ValueError(f"{name} has shape {g.shape}, expected {ref.shape}")
        err = float(np.abs(g - ref).max(initial=0.0)) if np.isfinite(g).all() else math.inf
        result.append((name, err, gradient_bound(dtype, amax(ref), floor)))
    return result


def assert_gradients_close(grads, dout, q, k, v, out, dtype=None, *, softmax_scale: float | None = None,
                           causal: bool = False, window_size=(-1, -1), ref_grads=None) -> None:
    """Raise AssertionError, naming each gradient outside its bound, by how much; arguments as for
    :func:`gradient_errors`."""
    bad = [f"max|{name} - ref| = {err:.3e} exceeds the bound {bound:.3e}"
           for name, err, bound in gradient_errors(grads, dout, q, k, v, out, dtype, softmax_scale, causal,
                                                   window_size, ref_grads=ref_grads)
           if not err <= bound]
    if bad:
        raise AssertionError("gradients not close to the reference (16 u max|ref| + floor): " + "; ".join(bad))
