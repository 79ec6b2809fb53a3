"""Argument validation for the attention entry points (flash-attn 2.x semantics).

Everything here works on :class:`fa2cupy.arrays.ArrayInfo` metadata only, so it
runs without a GPU and every rejected call fails before any memory is touched.
Each message names the offending argument and says what is allowed.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .arrays import ArrayInfo, same_framework

SUPPORTED_DTYPES = ("float16", "bfloat16")
MAX_HEADDIM = 256
#: batch and nheads index grid axes y and z, which CUDA caps at 65535 blocks.
MAX_GRID_YZ = 65535
#: Row strides travel as 32-bit ints (the kernels step K/V rows with them); the entry points copy anything wider.
MAX_ROW_STRIDE = 1 << 24


@dataclass(frozen=True)
class AttnShape:
    """Problem size of one forward call, as validated by :func:`check_forward_args`."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int  # q's and k's
    dtype: str
    headdim_v: int = 0  # v's (and the output's) where it differs from headdim; 0: the same

    @property
    def dv(self) -> int:
        """v's head dim: the output's, dout's and dv's."""
        return self.headdim_v or self.headdim


def default_scale(headdim: int) -> float:
    """flash-attn's default softmax scale, ``1 / sqrt(headdim)``.

    Raises:
        ValueError: headdim is not a positive integer.
    """
    if isinstance(headdim, bool) or not isinstance(headdim, numbers.Integral) or headdim < 1:
        raise ValueError(f"headdim must be a positive integer, got {headdim!r}")
    return 1.0 / math.sqrt(int(headdim))


_AXES_Q = ("batch", "seqlen_q", "nheads", "headdim")
_AXES_KV = ("batch", "seqlen_k", "nheads_kv", "headdim")


def _is_bool_like(value) -> bool:
    # bool, numpy.bool_ and the ints 0/1; not floats, strings or None, which are
    # almost always a misplaced positional argument.
    if isinstance(value, bool):
        return True
    t = type(value)
    if t.__module__ == "numpy" and t.__name__ in ("bool", "bool_"):  # numpy.bool_ (1.x/2.x)
        return True
    return isinstance(value, numbers.Integral) and value in (0, 1)


def _check_bool(value, name: str) -> None:
    if not _is_bool_like(value):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")


def _real(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def _check_window(window_size) -> None:
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(
            isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size
        )
    ):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if any(int(w) < -1 for w in window_size):
        raise ValueError(
            f"window_size must be (left, right) with each side >= 0 (keys before / after the diagonal) or -1 "
            f"(no limit), got {tuple(window_size)!r}"
        )


#: A window side without a limit, as the kernels take it (kUnlimitedWindow in cuda/attention/masks.cuh).
UNLIMITED_WINDOW = 1 << 30


def window_bounds(causal: bool, window_size) -> tuple[str, int, int]:
    """``(mask, left, right)`` for the kernels from a validated ``causal`` and ``window_size``.

    flash-attn semantics: query ``i`` sees key ``j`` iff ``i + sk - sq - left <= j <= i + sk - sq + right``, -1 meaning
    no limit on that side; ``causal`` sets ``right`` to 0. ``mask`` (see configs.MASKS) is "none" when neither side
    is limited, "causal" for the window (unlimited, 0), else "window"; an unlimited side becomes
    :data:`UNLIMITED_WINDOW`."""
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    if left < 0 and right < 0:
        mask = "none"
    elif left < 0 and right == 0:
        mask = "causal"
    else:
        mask = "window"
    return mask, (left if left >= 0 else UNLIMITED_WINDOW), (right if right >= 0 else UNLIMITED_WINDOW)


def _check_layout(info: ArrayInfo, axes: tuple) -> None:
    if len(info.shape) != 4:
        raise ValueError(
            f"{info.name} must be 4-D {'(' + ', '.join(axes) + ')'}, got {len(info.shape)}-D "
            f"shape {info.shape}"
        )
    for axis, n in zip(axes, info.shape):
        if n < 1:
            raise ValueError(
                f"{info.name} has zero-length axis {axis} (shape {info.shape}); every axis "
                f"must have length >= 1"
            )


def check_forward_args(
    q: ArrayInfo,
    k: ArrayInfo,
    v: ArrayInfo,
    *,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
) -> AttnShape:
    """Validate the arguments of ``flash_attn_func`` and return the problem size.

    Shapes: q ``(batch, seqlen_q, nheads, headdim)``, k ``(batch, seqlen_k, nheads_kv, headdim)`` and v
    ``(batch, seqlen_k, nheads_kv, headdim_v)`` with ``nheads % nheads_kv == 0`` (MQA/GQA), ``1 <= headdim,
    headdim_v <= 256`` (v's head dim may differ from q's and k's: the output takes v's), dtype float16 or
    bfloat16 shared by all three, last axis contiguous (stride 1; other axes may have any stride), one
    framework and one device.

    Args:
        q, k, v: ArrayInfo from :func:`fa2cupy.arrays.describe`.
        dropout_p: in [0, 1); > 0 drops entries of P (see :func:`check_dropout_rng` for its seed).
        softmax_scale: None (use 1/sqrt(headdim)) or a finite real number.
        causal: bool; causal mask aligned to the bottom-right corner.
        window_size: (left, right), each an int >= -1 (-1: no limit on that side).
        softcap: a finite number >= 0; > 0 caps the scores at ``softcap * tanh(s / softcap)``.
        alibi_slopes: None, or an ArrayInfo of float32 ``(nheads,)`` or ``(batch, nheads)`` ALiBi slopes from q's
            framework and device (see :func:`check_alibi`).
        deterministic: bool; accepted and ignored (the forward pass is always
            deterministic).
        return_attn_probs: bool.

    Returns:
        AttnShape.

    Raises:
        TypeError: wrong dtype, or an option of the wrong type.
        ValueError: wrong rank, mismatched or zero-length axes, bad head grouping,
            headdim out of range, last axis not contiguous, arrays on different
            frameworks/devices, or a non-finite/out-of-range option value.
        NotImplementedError: never for these options.
    """
    # Options first: they are independent of the arrays.
    _check_attention_options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)
    shape = _check_qkv(q, k, v)
    if alibi_slopes is not None:
        check_alibi(alibi_slopes, q, shape.batch, shape.nheads)
    return shape


def _check_attention_options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                             return_attn_probs) -> None:
    """check_forward_args' scalar options. Each has a fast path for the common spellings (this runs on every
    checked call; the numbers ABCs are slow)."""
    if causal is not True and causal is not False:
        _check_bool(causal, "causal")
    if deterministic is not True and deterministic is not False:
        _check_bool(deterministic, "deterministic")
    if return_attn_probs is not True and return_attn_probs is not False:
        _check_bool(return_attn_probs, "return_attn_probs")

    if not (type(dropout_p) is float and dropout_p == 0.0):
        p = _real(dropout_p, "dropout_p")
        if not 0.0 <= p < 1.0:  # also rejects NaN
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")

    if softmax_scale is not None and not (
        type(softmax_scale) is float and -math.inf < softmax_scale < math.inf
    ):
        scale = _real(softmax_scale, "softmax_scale")
        if not math.isfinite(scale):
            raise ValueError(
                f"softmax_scale must be None or a finite number, got {softmax_scale!r}"
            )

    if not (
        type(window_size) is tuple
        and window_size == (-1, -1)
        and type(window_size[0]) is int
        and type(window_size[1]) is int
    ):
        _check_window(window_size)

    if not (type(softcap) is float and softcap == 0.0):
        cap = _real(softcap, "softcap")
        if not (math.isfinite(cap) and cap >= 0.0):
            raise ValueError(f"softcap must be a finite number >= 0, got {softcap!r}")


def _check_qkv(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo) -> AttnShape:
    """check_forward_args' rules for q, k and v (layouts, shapes, grouping, dtypes, one framework and device)."""
    _check_layout(q, _AXES_Q)
    _check_layout(k, _AXES_KV)
    _check_layout(v, _AXES_KV)
    same_framework([q, k, v])

    batch, seqlen_q, nheads, headdim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    for axis, kn, vn in zip(_AXES_KV[:3], k.shape, v.shape):
        if kn != vn:
            raise ValueError(
                f"v has {axis}={vn} but k has {axis}={kn}; k and v must have the same "
                f"shape but for the head dim (got k {k.shape}, v {v.shape})"
            )
    if k.shape[0] != batch:
        raise ValueError(
            f"k has batch={k.shape[0]} but q has batch={batch}; q, k and v must share "
            f"the batch size"
        )
    if k.shape[3] != headdim:
        raise ValueError(
            f"k has headdim={k.shape[3]} but q has headdim={headdim}; q, k and v must "
            f"share the head dimension"
        )
    if nheads % nheads_kv:
        raise ValueError(
            f"q has nheads={nheads}, which is not a multiple of nheads_kv={nheads_kv} of "
            f"k and v; each kv head must serve a whole group of query heads (MQA/GQA)"
        )
    if batch > MAX_GRID_YZ or nheads > MAX_GRID_YZ:
        raise ValueError(
            f"q has batch={batch} and nheads={nheads}; each must be at most {MAX_GRID_YZ} "
            f"(a CUDA grid dimension); split the call along that axis"
        )
    if headdim > MAX_HEADDIM:
        raise ValueError(
            f"q has headdim={headdim}; fa2cupy supports head dimensions 1..{MAX_HEADDIM}"
        )
    headdim_v = v.shape[3]
    if headdim_v > MAX_HEADDIM:
        raise ValueError(
            f"v has headdim={headdim_v}; fa2cupy supports head dimensions 1..{MAX_HEADDIM} (v's may differ from "
            f"q's and k's)"
        )

    for info in (q, k, v):
        if info.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"fa2cupy computes in float16 or bfloat16; got {info.dtype} for {info.name} "
                f"(cast with .half() / .to(torch.bfloat16) / astype)"
            )
    for info in (k, v):
        if info.dtype != q.dtype:
            raise TypeError(
                f"{info.name} has dtype {info.dtype} but q has {q.dtype}; q, k and v must "
                f"share one dtype (float16 or bfloat16)"
            )

    for info in (q, k, v):
        if info.strides[3] != 1 and info.shape[3] != 1:
            raise ValueError(
                f"{info.name} must be contiguous in its last (headdim) axis, got strides "
                f"{info.strides} (in elements); the other axes may have any stride, so "
                f"e.g. a (b, h, s, d) array transposed to (b, s, h, d) is fine, but pass "
                f"a copy if the last axis is strided"
            )

    return AttnShape(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, q.dtype,
                     headdim_v if headdim_v != headdim else 0)


def check_dropout_rng(dropout_p, dropout_seed, dropout_offset, rng_state: ArrayInfo | None = None) -> tuple[int, int]:
    """(seed, offset) of dropout as ints; with ``dropout_p > 0`` the seed must be given (an int in [0, 2**64)): the
    backward regenerates the forward's keep mask from the same seed and offset. Without dropout both are ignored.
    ``rng_state`` (a device array uint32 (4,): seed lo, seed hi, offset lo, offset hi) replaces both."""
    if not dropout_p:
        return 0, 0
    if rng_state is not None:
        if tuple(rng_state.shape) != (4,) or rng_state.dtype != "uint32":
            raise ValueError(f"dropout_rng_state must be a uint32 array (4,) = (seed lo, seed hi, offset lo, offset hi), "
                             f"got {rng_state.dtype} {tuple(rng_state.shape)}")
        return 0, 0
    for name, value in (("dropout_seed", dropout_seed), ("dropout_offset", dropout_offset)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < 1 << 64:
            hint = (" (dropout_p > 0 needs it so that the backward can regenerate the same mask; fa2cupy.torch "
                    "draws it from torch's generator)") if name == "dropout_seed" and value is None else ""
            raise ValueError(f"{name} must be an int in [0, 2**64), got {value!r}{hint}")
    return int(dropout_seed), int(dropout_offset)


def check_alibi(slopes: ArrayInfo, q: ArrayInfo, batch: int, nheads: int) -> None:
    """ALiBi slopes: float32 ``(nheads,)`` or ``(batch, nheads)``, from q's framework and on q's device."""
    if tuple(slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads}), got "
            f"{tuple(slopes.shape)}"
        )
    if slopes.dtype != "float32":
        raise TypeError(f"alibi_slopes must be float32 (as flash-attn takes them), got {slopes.dtype}")
    same_framework([q, slopes])


def check_varlen_args(
    q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, cu_seqlens_q: ArrayInfo, cu_seqlens_k: ArrayInfo, max_seqlen_q,
    max_seqlen_k, **options,
) -> tuple[AttnShape, int, int]:
    """Validate ``flash_attn_varlen_func``'s arguments; returns (AttnShape with batch = number of sequences and
    the maximum lengths, total_q, total_k).

    q ``(total_q, nheads, headdim)``, k and v ``(total_k, nheads_kv, headdim)``; cu_seqlens_q/k int32
    ``(batch + 1,)`` arrays of the same length from q's framework and device; max_seqlen_q/k ints >= 0. The
    options and the per-array rules are :func:`check_forward_args`'s (applied to the arrays as one batch). The
    values inside cu_seqlens live on the GPU: the kernels check them (see fa2cupy.device_errors).

    Paged K/V (option ``block_table``, an ArrayInfo): k and v are ``(num_pages, page_size, nheads_kv, headdim)``
    and block_table int32 ``(batch, max_pages)`` with ``max_seqlen_k <= max_pages * page_size``; total_k is then
    the pages' capacity ``num_pages * page_size``. Page indices are checked on the GPU."""
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be an int >= 0 (the longest sequence), got {value!r}")
    block_table = options.pop("block_table", None)
    for info in (q,) if block_table is not None else (q, k, v):
        if len(info.shape) != 3:
            raise ValueError(
                f"{info.name} must be 3-D (total_tokens, heads, headdim) for the varlen functions, got shape "
                f"{info.shape}"
            )
    for info in (cu_seqlens_q, cu_seqlens_k):
        if len(info.shape) != 1 or info.shape[0] < 2:
            raise ValueError(f"{info.name} must be 1-D (batch + 1,) with batch >= 1, got shape {info.shape}")
        if info.dtype != "int32":
            raise TypeError(f"{info.name} must be int32 (cumulative sequence lengths), got {info.dtype}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q {cu_seqlens_q.shape} and cu_seqlens_k {cu_seqlens_k.shape} must have the same length "
            f"(batch + 1)"
        )
    batch = cu_seqlens_q.shape[0] - 1
    if batch > MAX_GRID_YZ:
        raise ValueError(f"cu_seqlens_q describes {batch} sequences; at most {MAX_GRID_YZ} are supported per call")
    same_framework([q, cu_seqlens_q, cu_seqlens_k])
    alibi = options.pop("alibi_slopes", None)
    if block_table is not None:
        same_framework([q, block_table])
        return _check_paged_varlen(q, k, v, block_table, batch, max_seqlen_q, max_seqlen_k, alibi, options)
    total_q, total_k = q.shape[0], k.shape[0]
    if total_q < 1 or total_k < 1:
        raise ValueError(f"q has {total_q} tokens and k {total_k}; the packed arrays must not be empty")

    shape = check_forward_args(_as_batch(q), _as_batch(k), _as_batch(v), **options)
    if alibi is not None:
        check_alibi(alibi, q, batch, shape.nheads)
    return (AttnShape(batch, int(max_seqlen_q), int(max_seqlen_k), shape.nheads, shape.nheads_kv, shape.headdim,
                      shape.dtype, shape.headdim_v), total_q, total_k)


def _as_batch(info: ArrayInfo, drop: int = 0) -> ArrayInfo:
    """A packed (total, h, d) array (after dropping ``drop`` leading axes) seen as one batch entry (1, total, h, d)
    with batch stride 0, for check_forward_args's rules."""
    return ArrayInfo(name=info.name, framework=info.framework, shape=(1,) + tuple(info.shape[drop:]),
                     dtype=info.dtype, strides=(0,) + tuple(info.strides[drop:]), device=info.device)


def _check_paged_varlen(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, block_table: ArrayInfo, batch: int,
                        max_seqlen_q, max_seqlen_k, alibi, options) -> tuple[AttnShape, int, int]:
    for info in (k, v):
        if len(info.shape) != 4:
            raise ValueError(f"{info.name} must be 4-D (num_pages, page_size, nheads_kv, headdim) with block_table, "
                             f"got shape {info.shape}")
    if len(block_table.shape) != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table must be 2-D (batch, max_pages) = ({batch}, >= 1) (one row of page indices per "
                         f"sequence of cu_seqlens), got shape {block_table.shape}")
    if block_table.dtype != "int32":
        raise TypeError(f"block_table must be int32 (page indices), got {block_table.dtype}")
    num_pages, page_size = k.shape[0], k.shape[1]
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"k has shape {k.shape}; with block_table it needs at least one page of at least one row")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v has shape {v.shape} but k has {k.shape}; with block_table they must agree on every "
                         f"axis but the last (v's head dim may differ)")
    capacity = block_table.shape[1] * page_size
    if max_seqlen_k > capacity:
        raise ValueError(f"max_seqlen_k = {max_seqlen_k} exceeds what block_table can address: max_pages "
                         f"{block_table.shape[1]} x page_size {page_size} = {capacity} keys per sequence")
    if q.shape[0] < 1:
        raise ValueError(f"q has {q.shape[0]} tokens; the packed arrays must not be empty")

    # the layout rules apply within a page
    shape = check_forward_args(_as_batch(q), _as_batch(k, drop=1), _as_batch(v, drop=1), **options)
    if alibi is not None:
        check_alibi(alibi, q, batch, shape.nheads)
    return (AttnShape(batch, int(max_seqlen_q), int(max_seqlen_k), shape.nheads, shape.nheads_kv, shape.headdim,
                      shape.dtype, shape.headdim_v), q.shape[0], num_pages * page_size)


def check_varlen_backward_args(dout: ArrayInfo, out: ArrayInfo, softmax_lse: ArrayInfo, q: ArrayInfo,
                               nheads: int, headdim_v: int | None = None) -> None:
    """dout and out ``(total_q, nheads, headdim_v)`` (q's rows and heads, v's head dim; q's dtype, contiguous last
    axis); softmax_lse float32 ``(nheads, total_q)`` as the varlen forward returns it; one framework."""
    same_framework([q, dout, out, softmax_lse])
    want = tuple(q.shape[:2]) + (headdim_v or q.shape[2],)
    for info in (dout, out):
        if tuple(info.shape) != want:
            raise ValueError(f"{info.name} has shape {info.shape}, expected {want}: q's (total_q, nheads) and v's "
                             f"head dim (the forward's output shape)")
        if info.dtype != q.dtype:
            raise TypeError(f"{info.name} has dtype {info.dtype} but q has {q.dtype}; it must have q's dtype")
        if info.strides[-1] != 1 and info.shape[-1] != 1:
            raise ValueError(f"{info.name} must be contiguous in its last (headdim) axis, got strides {info.strides}")
    expected = (nheads, q.shape[0])
    if tuple(softmax_lse.shape) != expected:
        raise ValueError(f"softmax_lse has shape {softmax_lse.shape}, expected (nheads, total_q) = {expected}; pass "
                         f"the softmax_lse that flash_attn_varlen_func returned")
    if softmax_lse.dtype != "float32":
        raise TypeError(f"softmax_lse must be float32 (as the forward returns it), got {softmax_lse.dtype}")


def _c_contiguous(info: ArrayInfo) -> bool:
    # Axes of length 1 may have any stride (frameworks disagree on what to put there).
    step = 1
    for n, s in zip(reversed(info.shape), reversed(info.strides)):
        if n != 1 and s != step:
            return False
        step *= n
    return True


def check_backward_args(
    dout: ArrayInfo,
    q: ArrayInfo,
    k: ArrayInfo,
    v: ArrayInfo,
    out: ArrayInfo,
    softmax_lse: ArrayInfo,
    *,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    deterministic=False,
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
) -> AttnShape:
    """Validate the arguments of ``flash_attn_backward`` and return the problem size.

    q, k, v and the options are checked exactly as by :func:`check_forward_args` (same messages, including
    the ``window_size`` rules). On top of that: ``dout`` and ``out`` have q's shape
    and dtype and a contiguous last axis (other axes may have any stride); ``softmax_lse`` is float32
    ``(batch, nheads, seqlen_q)`` and C-contiguous (as the forward returns it); all six arrays come from one
    framework and live on one device.

    Args:
        dout, q, k, v, out, softmax_lse: ArrayInfo from :func:`fa2cupy.arrays.describe`.
        softmax_scale, causal, window_size, deterministic, softcap, alibi_slopes: as for
            :func:`check_forward_args`.

    Returns:
        AttnShape.

    Raises:
        TypeError: wrong dtype, or an option of the wrong type.
        ValueError: wrong rank or shape, non-contiguous layout, arrays on different frameworks/devices, or a
            bad option value.
        NotImplementedError: never for the options the backward takes.
    """
    shape = check_forward_args(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, deterministic=deterministic,
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
    )
    for info in (dout, out):
        if len(info.shape) != 4:
            raise ValueError(
                f"{info.name} must be 4-D (batch, seqlen_q, nheads, headdim) like q, got "
                f"{len(info.shape)}-D shape {info.shape}"
            )
    lse_shape = (shape.batch, shape.nheads, shape.seqlen_q)
    if len(softmax_lse.shape) != 3:
        raise ValueError(
            f"{softmax_lse.name} must be 3-D (batch, nheads, seqlen_q) = {lse_shape}, got "
            f"{len(softmax_lse.shape)}-D shape {softmax_lse.shape}"
        )
    same_framework([q, k, v, dout, out, softmax_lse])

    want = tuple(q.shape[:3]) + (shape.dv,)
    for info in (dout, out):
        if tuple(info.shape) != want:
            raise ValueError(
                f"{info.name} has shape {info.shape}, expected {want}: q's (batch, seqlen_q, nheads) and v's "
                f"head dim (the forward's output shape)"
            )
        if info.dtype != q.dtype:
            raise TypeError(
                f"{info.name} has dtype {info.dtype} but q has {q.dtype}; {info.name} must have q's dtype"
            )
    if tuple(softmax_lse.shape) != lse_shape:
        raise ValueError(
            f"{softmax_lse.name} has shape {softmax_lse.shape}, expected (batch, nheads, seqlen_q) = "
            f"{lse_shape} from q's shape {q.shape}; pass the softmax_lse that the forward returned"
        )
    if softmax_lse.dtype != "float32":
        raise TypeError(
            f"{softmax_lse.name} must be float32 (as the forward returns it), got {softmax_lse.dtype}"
        )

    for info in (dout, out):
        if info.strides[3] != 1 and info.shape[3] != 1:
            raise ValueError(
                f"{info.name} must be contiguous in its last (headdim) axis, got strides {info.strides} "
                f"(in elements); the other axes may have any stride, but pass a copy if the last axis is "
                f"strided"
            )
    if not _c_contiguous(softmax_lse):
        raise ValueError(
            f"{softmax_lse.name} must be C-contiguous (batch, nheads, seqlen_q), got strides "
            f"{softmax_lse.strides} (in elements) for shape {softmax_lse.shape}; pass the forward's "
            f"softmax_lse or a contiguous copy of it"
        )
    return shape


def check_merge_args(outs, lses) -> tuple:
    """Validate ``merge_attention_states(outs, lses)``; returns ``(n, batch, seqlen_q, nheads, headdim, dtype)``.

    outs: n >= 1 ArrayInfos ``(batch, seqlen_q, nheads, headdim)``, all of one shape and dtype (float16 or
    bfloat16); lses: n ArrayInfos ``(batch, nheads, seqlen_q)`` float32. One framework and device for all.
    """
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(
            f"outs and lses must be non-empty sequences of the same length, got {len(outs)} outs and "
            f"{len(lses)} lses"
        )
    same_framework(list(outs) + list(lses))
    first = outs[0]
    if len(first.shape) != 4:
        raise ValueError(f"{first.name} must be 4-D (batch, seqlen_q, nheads, headdim), got shape {first.shape}")
    batch, seqlen_q, nheads, headdim = first.shape
    if first.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{first.name} has dtype {first.dtype}; outs must be float16 or bfloat16")
    if min(first.shape) < 1 or headdim > MAX_HEADDIM:
        raise ValueError(f"{first.name} has shape {first.shape}; every axis >= 1 and headdim <= {MAX_HEADDIM}")
    for info in outs[1:]:
        if info.shape != first.shape or info.dtype != first.dtype:
            raise ValueError(
                f"{info.name} is {info.dtype} {info.shape} but {first.name} is {first.dtype} {first.shape}; "
                f"all outs must share shape and dtype"
            )
    for info in lses:
        if info.shape != (batch, nheads, seqlen_q):
            raise ValueError(
                f"{info.name} has shape {info.shape}; expected (batch, nheads, seqlen_q) = "
                f"{(batch, nheads, seqlen_q)} to match outs"
            )
        if info.dtype != "float32":
            raise TypeError(f"{info.name} has dtype {info.dtype}; lses must be float32 (as flash_attn_func returns)")
    return len(outs), batch, seqlen_q, nheads, headdim, first.dtype


# --------------------------------------------------------------------------------------------- kv-cache

@dataclass(frozen=True)
class DecodeExtras:
    """The optional features of a call, validated, as the kernels take them. The default is the plain decode."""

    window_left: int = UNLIMITED_WINDOW  # keys before the diagonal a query sees (UNLIMITED_WINDOW: no limit)
    window_right: int = UNLIMITED_WINDOW  # keys after it; causal is 0 here
    softcap: float = 0.0
    alibi: bool = False  # alibi_slopes given (float32 (batch, nheads) or (nheads,))
    alibi_batch_stride: int = 0  # elements; 0 for (nheads,)
    leftpad: bool = False  # cache_leftpad given
    rotary_dim: int = 0  # 0: no rotary embedding
    seqlen_ro: int = 0  # rows of rotary_cos / rotary_sin
    rotary_interleaved: bool = True
    rotary_advance: bool = False  # query t at position cache_seqlens + t (causal or local), else cache_seqlens

    @property
    def masked(self) -> bool:
        return self.window_left != UNLIMITED_WINDOW or self.window_right != UNLIMITED_WINDOW

    @property
    def plain_causal(self) -> bool:
        """The window is the causal mask (unlimited, 0), which the plain kernels handle."""
        return self.window_left == UNLIMITED_WINDOW and self.window_right == 0

    @property
    def attention(self) -> bool:
        """Whether the attention needs the Extras kernel (anything but no mask or the causal mask)."""
        return (self.masked and not self.plain_causal) or self.softcap > 0 or self.alibi or self.leftpad

    @property
    def append(self) -> bool:
        """Whether the append needs its Extras kernel (rotating the new keys, checking pads and positions)."""
        return self.rotary_dim > 0 or self.leftpad


def cache_usable_in_place(x, name: str) -> None:
    """Raises unless the CuPy array ``x`` (a cache, read and written in place) suits the kernels as it is."""
    item = x.itemsize
    if x.data.ptr % 16 or any(s % (8 * item) for s in x.strides[:3]) or x.strides[3] != item:
        raise ValueError(
            f"{name} must have a contiguous last axis, 16-byte aligned rows and strides that are multiples of 8 "
            f"elements (it is updated and read in place, never copied); got strides {x.strides} bytes"
        )
    if abs(x.strides[1]) // item >= MAX_ROW_STRIDE:
        raise ValueError(f"{name} has a row stride of {x.strides[1] // item} elements; at most "
                         f"{MAX_ROW_STRIDE - 1} are supported")


def fixed_seqlen(cache_seqlens, capacity: int, seqlen_new: int, rotary_span: int = 0, seqlen_ro: int = 0) -> int:
    """The kernels' fixed_seqlen argument: an int cache_seqlens (checked here, on the host, where it is), the
    whole cache for None, anything for an array (the kernels read and check the array). ``rotary_span``: with
    rotary, how many positions from cache_seqlens on are rotated (they must lie below ``seqlen_ro``)."""
    if cache_seqlens is None:
        fixed = capacity - seqlen_new
    elif isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= capacity - seqlen_new:
            raise ValueError(f"cache_seqlens + seqlen_new must lie in [0, {capacity}] (the cache capacity); got "
                             f"cache_seqlens={cache_seqlens}, seqlen_new={seqlen_new}")
        fixed = cache_seqlens
    else:
        return 0
    if rotary_span and fixed + rotary_span > seqlen_ro:
        raise ValueError(f"rotary_cos/rotary_sin have {seqlen_ro} rows but position {fixed + rotary_span - 1} "
                         f"(cache_seqlens={fixed} plus the new tokens) is rotated; they need a row per position")
    return fixed


@dataclass(frozen=True)
class KvcacheCall:
    """A flash_attn_with_kvcache call's validated metadata (see check_kvcache_args)."""

    batch: int
    seqlen_q: int
    nheads: int
    nheads_kv: int
    headdim: int
    dtype: str
    seqlen_new: int
    page_size: int  # 0: contiguous cache
    capacity: int
    max_pages: int
    fixed_seqlen: int
    scale: float
    causal: bool
    extras: DecodeExtras
    headdim_v: int = 0  # v_cache's (and the output's) where it differs from headdim; 0: the same

    @property
    def dv(self) -> int:
        """v_cache's head dim: the output's."""
        return self.headdim_v or self.headdim


def check_kvcache_args(infos: dict, cache_seqlens, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                       softcap=0.0, rotary_interleaved=True, num_splits=0) -> KvcacheCall:
    """Validates a flash_attn_with_kvcache call from its arrays' descriptions (``infos``: argument name ->
    ArrayInfo for each array given, cache_seqlens included when it is an array) and its scalar options; needs no
    GPU. Raises TypeError / ValueError naming the argument and what is allowed."""
    cap = _check_kvcache_options(infos, softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits)
    batch, seqlen_q, nheads, nheads_kv, headdim, headdim_v, seqlen_new = _check_kvcache_arrays(infos)
    page_size, max_pages, capacity = _check_kvcache_index(infos, cache_seqlens, batch)
    # The mask, flash-attn's way: causal is the window's right side 0, and a side of at least the cache capacity
    # is no limit (so it also decides whether q's rotary positions advance, below).
    left, right = (int(w) for w in window_size)
    right = 0 if causal else right
    left, right = (-1 if w >= capacity else w for w in (left, right))
    extras = dict(window_left=left if left >= 0 else UNLIMITED_WINDOW,
                  window_right=right if right >= 0 else UNLIMITED_WINDOW, softcap=cap,
                  leftpad="cache_leftpad" in infos, alibi=_check_kvcache_alibi(infos, batch, nheads))
    rotary_span = 0
    if "rotary_cos" in infos:
        advance = left >= 0 or right >= 0  # (causal or local: query t is at position cache_seqlens + t)
        rotary_dim, seqlen_ro = _check_rotary(infos, headdim, capacity)
        extras.update(rotary_dim=rotary_dim, seqlen_ro=seqlen_ro, rotary_interleaved=bool(rotary_interleaved),
                      rotary_advance=advance)
        rotary_span = max(seqlen_new, seqlen_q if advance else 1)
    fixed = fixed_seqlen(cache_seqlens, capacity, seqlen_new, rotary_span, extras.get("seqlen_ro", 0))
    scale = default_scale(headdim) if softmax_scale is None else float(softmax_scale)
    return KvcacheCall(batch, seqlen_q, nheads, nheads_kv, headdim, infos["q"].dtype, seqlen_new, page_size,
                       capacity, max_pages, fixed, scale, bool(causal), DecodeExtras(**extras),
                       headdim_v if headdim_v != headdim else 0)


def _check_kvcache_options(infos: dict, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                           num_splits) -> float:
    """The scalar options and the arguments that come in pairs; returns the softcap as a float."""
    if ("k" in infos) != ("v" in infos):
        raise ValueError("k and v must be given together (new keys and values to append) or both be None")
    if ("rotary_cos" in infos) != ("rotary_sin" in infos):
        raise ValueError("rotary_cos and rotary_sin must be given together or both be None")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = choose automatically), got {num_splits!r}")
    if causal is not True and causal is not False:
        _check_bool(causal, "causal")
    if rotary_interleaved is not True and rotary_interleaved is not False:
        _check_bool(rotary_interleaved, "rotary_interleaved")
    if type(window_size) is not tuple or window_size != (-1, -1):
        _check_window(window_size)
    cap = 0.0
    if not (type(softcap) is float and softcap == 0.0):
        cap = _real(softcap, "softcap")
        if not (math.isfinite(cap) and cap >= 0.0):
            raise ValueError(f"softcap must be a finite number >= 0 (0 = no softcap), got {softcap!r}")
    if softmax_scale is not None:
        scale = _real(softmax_scale, "softmax_scale")
        if not math.isfinite(scale):
            raise ValueError(f"softmax_scale must be None or a finite number, got {softmax_scale!r}")
    return cap


def _check_kvcache_arrays(infos: dict) -> tuple:
    """q, the caches and the new keys/values: ``(batch, seqlen_q, nheads, nheads_kv, headdim, headdim_v,
    seqlen_new)``; v_cache (and v) may have a head dim of their own, the output's."""
    q_info, kc_info, vc_info = infos["q"], infos["k_cache"], infos["v_cache"]
    for info in (q_info, kc_info, vc_info):
        if len(info.shape) != 4:
            raise ValueError(f"{info.name} must be 4-D, got shape {info.shape}")
    batch, seqlen_q, nheads, headdim = q_info.shape
    if kc_info.shape[3] != headdim:
        raise ValueError(f"k_cache has headdim {kc_info.shape[3]} but q has {headdim}")
    if kc_info.shape[:3] != vc_info.shape[:3]:
        raise ValueError(f"k_cache {kc_info.shape} and v_cache {vc_info.shape} must agree on every axis but the "
                         f"last (v_cache's head dim may differ)")
    nheads_kv, headdim_v = kc_info.shape[2], vc_info.shape[3]
    if min(q_info.shape) < 1 or min(kc_info.shape) < 1 or headdim_v < 1:
        raise ValueError(f"q {q_info.shape}, k_cache {kc_info.shape} and v_cache {vc_info.shape} must have no "
                         f"zero-length axis")
    for name, d in (("q", headdim), ("v_cache", headdim_v)):
        if d % 8 or d > 256:
            raise ValueError(f"{name} has headdim={d}; flash_attn_with_kvcache needs a multiple of 8 up to 256 "
                             f"(the caches are used in place, so they cannot be padded)")
    if nheads % nheads_kv:
        raise ValueError(f"q has nheads={nheads}, not a multiple of the caches' nheads_kv={nheads_kv}")
    for info in [q_info, kc_info, vc_info] + [infos[n] for n in ("k", "v") if n in infos]:
        if info.dtype not in SUPPORTED_DTYPES or info.dtype != q_info.dtype:
            raise TypeError(f"{info.name} has dtype {info.dtype}; q, k_cache, v_cache, k and v must share one "
                            f"dtype, float16 or bfloat16")
    seqlen_new = 0
    if "k" in infos:
        for n, d in (("k", headdim), ("v", headdim_v)):
            shape = infos[n].shape
            if len(shape) != 4 or shape[0] != batch or shape[2] != nheads_kv or shape[3] != d:
                raise ValueError(f"{n} must be (batch, seqlen_new, nheads_kv, {n}_cache's headdim) = ({batch}, *, "
                                 f"{nheads_kv}, {d}), got {shape}")
        if infos["k"].shape[1] != infos["v"].shape[1]:
            raise ValueError(f"k {infos['k'].shape} and v {infos['v'].shape} must have the same seqlen_new (axis 1)")
        seqlen_new = infos["k"].shape[1]
    return batch, seqlen_q, nheads, nheads_kv, headdim, headdim_v, seqlen_new


def _check_kvcache_index(infos: dict, cache_seqlens, batch: int) -> tuple:
    """The arrays that say where each row's keys are (block_table, cache_batch_idx, cache_leftpad, cache_seqlens):
    ``(page_size, max_pages, capacity)``; page_size and max_pages are 0 for a contiguous cache."""
    kc_info = infos["k_cache"]
    if "block_table" in infos:
        bt = infos["block_table"]
        if len(bt.shape) != 2 or bt.shape[0] != batch or bt.dtype != "int32":
            raise ValueError(f"block_table must be int32 (batch, max_pages) = ({batch}, *), got {bt.dtype} {bt.shape}")
        if "cache_batch_idx" in infos:
            raise ValueError("cache_batch_idx cannot be combined with block_table (each row's pages say where it is)")
        if "cache_leftpad" in infos:
            raise ValueError("cache_leftpad cannot be combined with block_table (as in flash-attn, left-padded "
                             "caches must be contiguous)")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required with block_table")
        page_size = kc_info.shape[1]
        if page_size % 16:
            raise ValueError(f"k_cache has page_size={page_size} (axis 1 of a paged cache); it must be a multiple "
                             f"of 16")
        max_pages, capacity = bt.shape[1], bt.shape[1] * page_size
    else:
        page_size, max_pages, capacity = 0, 0, kc_info.shape[1]
    for name in ("cache_batch_idx", "cache_leftpad"):
        info = infos.get(name)
        if info is not None and (info.shape != (batch,) or info.dtype != "int32"):
            raise ValueError(f"{name} must be int32 (batch,) = ({batch},), got {info.dtype} {info.shape}")
    if not page_size and "cache_batch_idx" not in infos and kc_info.shape[0] < batch:
        raise ValueError(f"k_cache has {kc_info.shape[0]} rows but q has batch={batch}; pass cache_batch_idx")
    cs = infos.get("cache_seqlens")
    if cs is not None and (cs.shape != (batch,) or cs.dtype != "int32"):
        raise ValueError(f"cache_seqlens must be an int or int32 (batch,) = ({batch},), got {cs.dtype} {cs.shape}")
    if isinstance(cache_seqlens, bool):
        raise TypeError("cache_seqlens must be an int or an int32 array, not a bool")
    return page_size, max_pages, capacity


def _check_kvcache_alibi(infos: dict, batch: int, nheads: int) -> bool:
    """Whether ALiBi slopes were given (float32 ``(nheads,)`` or ``(batch, nheads)``)."""
    al = infos.get("alibi_slopes")
    if al is None:
        return False
    if al.dtype != "float32":
        raise TypeError(f"alibi_slopes must be float32, got {al.dtype}")
    if al.shape not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must be ({nheads},) or ({batch}, {nheads}) = (nheads,) or (batch, nheads), "
                         f"got {al.shape}")
    return True


def _check_rotary(infos: dict, headdim: int, capacity: int) -> tuple:
    """rotary_cos / rotary_sin ``(seqlen_ro, rotary_dim / 2)`` in q's dtype: ``(rotary_dim, seqlen_ro)``."""
    cos, sin, dtype = infos["rotary_cos"], infos["rotary_sin"], infos["q"].dtype
    for info in (cos, sin):
        if info.dtype != dtype:
            raise TypeError(f"{info.name} has dtype {info.dtype}; it must be q's dtype, {dtype}")
        if len(info.shape) != 2 or info.shape[1] < 1:
            raise ValueError(f"{info.name} must be 2-D (seqlen_ro, rotary_dim / 2), got shape {info.shape}")
    if cos.shape != sin.shape:
        raise ValueError(f"rotary_cos {cos.shape} and rotary_sin {sin.shape} must have the same shape")
    seqlen_ro, rotary_dim = cos.shape[0], 2 * cos.shape[1]
    if rotary_dim > headdim:
        raise ValueError(f"rotary_cos has {cos.shape[1]} columns, so rotary_dim = {rotary_dim}; it must be at "
                         f"most headdim = {headdim} (rotary_cos: (seqlen_ro, rotary_dim / 2))")
    if seqlen_ro < capacity:
        raise ValueError(f"rotary_cos/rotary_sin have {seqlen_ro} rows; they need at least one per cache slot, "
                         f"{capacity} (the cache capacity), as in flash-attn")
    return rotary_dim, seqlen_ro
