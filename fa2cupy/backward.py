"""Backward kernel family (cuda/bwd.cu): launch plans for preprocess, dK/dV (+ atomic dQ), deterministic dQ and
the dQ conversion, and their launch on raw pointers.

Like the forward, a plan depends only on shapes, strides, dtype and options, so the interface caches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import build, configs, tensor_maps
from .forward import _LOG2E, dropout_scalars, dropout_words, error_pointers, kernel_variant

#: Tests set this to fill dq, dk and dv with NaN before the kernels run (see forward._debug_poison).
_debug_poison = False
#: Run the dK/dV step of calls without modifiers on the Hopper kernel (cuda/hopper/bwd.cu) on compute
#: capability 9.0 where configs.hopper_backward_config picks it; tests and A/B timings set it False to run the
#: mma.sync kernel there instead.
HOPPER = True


@dataclass(frozen=True)
class BackwardPlan:
    preprocess: build.Launch  # each launch's variable slots: its leading pointer arguments (see run_backward)
    main: build.Launch
    dq: build.Launch | None  # deterministic=True: dQ by its own kernel
    convert: build.Launch | None  # deterministic=False: fp32 accumulator -> dq
    zero_tail: build.Launch | None  # varlen: zeroes the gradient rows past the last sequence
    dsum_shape: tuple  # (batch, nheads, seqlen_q) float32 workspace ((nheads, total_q) for varlen)
    dq_accum_shape: tuple | None  # (batch, nheads, seqlen_q, d [+ 4]) float32 workspace, atomics only
    config: configs.BwdConfig | configs.HopperBwdConfig
    # The Hopper dK/dV kernel's tensor maps of q, k, v and dout (the tiles it moves with TMA: all of a padded call's,
    # a varlen call's whole ones): encoded into the main launch's last four parameters for each call's pointers.
    tensor_maps: tensor_maps.TileMaps | None = None


def _launch(function, grid, block, smem_bytes: int, pointers: int, scalars: tuple, rng_at=None,
            blobs: int = 0) -> build.Launch:
    """A launch whose first ``pointers`` arguments are per-call device pointers, then fixed ``scalars``; with
    ``rng_at``, the four argument slots from there (dropout seed and offset words) are per-call values too; then
    ``blobs`` tensor maps (build.Launch)."""
    variable = list(range(pointers)) + ([] if rng_at is None else list(range(rng_at, rng_at + 4)))
    return build.Launch(function, grid, block, smem_bytes, (np.uint64(0),) * pointers + scalars, variable,
                        blobs=blobs)


def _strides3(strides) -> tuple:
    batch_stride, row_stride, head_stride, _ = strides
    return (np.int64(batch_stride), np.int32(row_stride), np.int64(head_stride))


def plan_backward(
    q_shape, k_shape, strides: dict, dtype: str, softmax_scale: float, causal: bool, deterministic: bool, arch: int,
    config=None, window_size=(-1, -1), softcap: float = 0.0, alibi_batch_stride=None, varlen_totals=None,
    dropout_p: float = 0.0,
) -> BackwardPlan:
    """Builds the launches for one backward problem.

    ``strides`` maps "q", "k", "v", "dout", "out", "dq", "dk", "dv" to element strides (4-tuples, last 1);
    shapes, alignment, modifiers and varlen as in :func:`fa2cupy.forward.plan_forward` (varlen: lse, and the
    dsum/dq_accum workspaces, are ``(nheads, total_q[, d])``, and dq/dk/dv must be contiguous: their rows past the
    last sequence are zeroed). The scale may be negative here: the backward has no
    running maximum, P = exp(scale * s - lse) is exact for any sign.
    """
    mask, mods, left, right = kernel_variant(causal, window_size, softcap, alibi_batch_stride is not None, dropout_p)
    batch, seqlen_q, nheads, headdim = q_shape
    seqlen_k, nheads_kv = k_shape[1], k_shape[2]
    tag = configs.DTYPE_TAGS[dtype]
    atomic = not deterministic
    if config is None and HOPPER:
        config = configs.hopper_backward_config(arch, headdim, mods, deterministic)
    shapes = dict(zip(("q", "k", "v", "dout"), tensor_maps.array_shapes(q_shape, k_shape, varlen_totals)))
    if (isinstance(config, configs.HopperBwdConfig)
            and not all(tensor_maps.usable(shapes[n], strides[n]) for n in shapes)):
        config = None  # (strides TMA cannot take, say negative ones: the mma.sync backward, with cp.async)
    if config is None:
        config = configs.backward_config(arch, headdim, dtype, mask, mods)
    hopper = isinstance(config, configs.HopperBwdConfig)
    total_q, total_k = varlen_totals or (0, 0)
    stats = (np.int64(0), np.int64(total_q)) if varlen_totals else (np.int64(nheads * seqlen_q), np.int64(seqlen_q))
    errors = error_pointers()
    threshold, keep_scale = dropout_scalars(dropout_p)
    sizes = stats + (np.int32(seqlen_q), np.int32(seqlen_k), np.int32(nheads), np.int32(nheads // nheads_kv),
                     np.int32(headdim), np.int32(left), np.int32(right), np.float32(softmax_scale),
                     np.float32(softmax_scale * _LOG2E), np.float32(softcap), np.int32(alibi_batch_stride or 0),
                     threshold)
    rng_at = len(sizes)  # the dropout seed and offset words come next: per-call values
    sizes += (np.uint32(0),) * 4 + (keep_scale, np.int32(total_q), np.int32(total_k)) + errors

    dq_pitch = config.dq_pitch(headdim)  # the fp32 dQ accumulator's floats per row, as the main kernel adds them
    lanes = min(32, 1 << (headdim // 8 - 1).bit_length())  # the preprocess's lanes per row: 16-byte chunks each
    pre = _launch(
        build.get_kernel("bwd", f"fa2::bwd_preprocess<{tag}>", 0),
        (-(-seqlen_q * lanes // 256), nheads, batch), (256, 1, 1), 0, 5,
        _strides3(strides["dout"]) + _strides3(strides["out"]) + stats + (np.int32(seqlen_q), np.int32(headdim),
                                                                          np.int32(dq_pitch), np.int32(lanes),
                                                                          np.int32(total_q))
        + errors,
    )
    smem = config.smem_bytes(atomic)
    main = _launch(
        build.get_kernel(config.family, config.name_expression(dtype, mask, atomic, mods, varlen_totals is not None), smem),
        (((seqlen_k + config.block_n - 1) // config.block_n) * config.dslices, nheads_kv, batch),
        (config.threads, 1, 1), smem, 13,
        sum((_strides3(strides[n]) for n in ("q", "k", "v", "dout", "dk", "dv")), ()) + sizes, rng_at=13 + 18 + rng_at,
        blobs=4 if hopper else 0,
    )
    maps = None
    if hopper:
        rows = {"q": config.block_m, "k": config.block_n, "v": config.block_n, "dout": config.block_m}
        maps = tensor_maps.TileMaps([tensor_maps.layout(shapes[n], strides[n], rows[n]) for n in shapes])
    dq = convert = None
    dq_accum_shape = None
    if deterministic:
        dq_config = configs.backward_dq_config(arch, headdim, dtype, mask)
        dq = _launch(
            build.get_kernel("bwd", dq_config.name_expression(dtype, mask, mods), dq_config.smem_bytes),
            ((seqlen_q + dq_config.block_m - 1) // dq_config.block_m, nheads, batch),
            (dq_config.threads, 1, 1), dq_config.smem_bytes, 11,
            sum((_strides3(strides[n]) for n in ("q", "k", "v", "dout", "dq")), ()) + sizes, rng_at=11 + 15 + rng_at,
        )
    else:
        convert = _launch(
            build.get_kernel("bwd", f"fa2::bwd_convert_dq<{tag}>", 0),
            ((seqlen_q * (headdim // 8) + 255) // 256, nheads, batch), (256, 1, 1), 0, 3,
            _strides3(strides["dq"]) + stats + (np.int32(seqlen_q), np.int32(headdim), np.int32(dq_pitch),
                                                np.float32(softmax_scale), np.int32(total_q)) + errors,
        )
        dq_accum_shape = (nheads, total_q, dq_pitch) if varlen_totals else (batch, nheads, seqlen_q, dq_pitch)
    zero_tail = None
    if varlen_totals:
        q_row, kv_row = nheads * headdim, nheads_kv * headdim
        if any(strides[n][1:] != (row, headdim, 1) for n, row in (("dq", q_row), ("dk", kv_row), ("dv", kv_row))):
            raise ValueError("varlen gradients must be contiguous (total, heads, d) arrays")
        chunks = max(total_q * q_row, total_k * kv_row) // 8
        zero_tail = _launch(build.get_kernel("bwd", "fa2::bwd_zero_tail", 0), (min(64, -(-chunks // 256)), 3, 1),
                            (256, 1, 1), 0, 5, (np.int32(batch), np.int32(total_q), np.int32(total_k),
                                                np.int32(q_row), np.int32(kv_row)))
    dsum_shape = (nheads, total_q) if varlen_totals else (batch, nheads, seqlen_q)
    return BackwardPlan(pre, main, dq, convert, zero_tail, dsum_shape, dq_accum_shape, config, maps)


def maps_writer(plan: BackwardPlan, q: int, k: int, v: int, dout: int):
    """What the main launch takes as ``write_blobs`` for these pointers: the plan's tensor maps encoded for them
    (None where the plan has none)."""
    return None if plan.tensor_maps is None else plan.tensor_maps.writer((q, k, v, dout))


def run_backward(plan: BackwardPlan, ptr: dict, stream_ptr: int) -> None:
    """Launches a plan on the stream with handle ``stream_ptr``. ``ptr`` maps "q", "k", "v", "dout", "out", "lse",
    "dq", "dk", "dv", "dsum" and (atomics only) "dq_accum" to device pointers, and optionally "cu_seqlens_q",
    "cu_seqlens_k" (varlen), "alibi_slopes" and "rng_state", and the ints "dropout_seed" and "dropout_offset"."""
    dq_accum = ptr.get("dq_accum", 0) if plan.convert is not None else 0
    cu_q, cu_k, alibi = ptr.get("cu_seqlens_q", 0), ptr.get("cu_seqlens_k", 0), ptr.get("alibi_slopes", 0)
    rng_state = ptr.get("rng_state", 0)
    rng = dropout_words(ptr.get("dropout_seed", 0), ptr.get("dropout_offset", 0))
    plan.preprocess(stream_ptr, (ptr["dout"], ptr["out"], ptr["dsum"], dq_accum, cu_q))
    plan.main(stream_ptr, (ptr["q"], ptr["k"], ptr["v"], ptr["dout"], ptr["lse"], ptr["dsum"], dq_accum, ptr["dk"],
                           ptr["dv"], cu_q, cu_k, alibi, rng_state) + rng,
              maps_writer(plan, ptr["q"], ptr["k"], ptr["v"], ptr["dout"]))
    if plan.dq is not None:
        plan.dq(stream_ptr, (ptr["q"], ptr["k"], ptr["v"], ptr["dout"], ptr["lse"], ptr["dsum"], ptr["dq"], cu_q,
                             cu_k, alibi, rng_state) + rng)
    else:
        plan.convert(stream_ptr, (dq_accum, ptr["dq"], cu_q))
    if plan.zero_tail is not None:
        plan.zero_tail(stream_ptr, (ptr["dq"], ptr["dk"], ptr["dv"], cu_q, cu_k))
