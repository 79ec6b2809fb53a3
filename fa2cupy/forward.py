"""Forward kernel family (cuda/fwd.cu): the launch plan (config, grid, scalar arguments) and the launch.

A plan depends only on shapes, strides, dtype and options, never on data pointers, so the interface caches
plans and a repeated call costs one dictionary look-up plus the launch itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import build, checks, configs

#: Tests set this to fill out and lse with NaN before every launch, so an element the kernel fails to write
#: shows up as NaN instead of as whatever the allocator happened to hand back.
_debug_poison = False

_LOG2E = 1.4426950408889634
#: Row strides travel as 32-bit ints (the kernel steps K/V rows with them); the interface copies anything wider.
MAX_ROW_STRIDE = 1 << 24


@dataclass(frozen=True)
class ForwardPlan:
    launch: build.Launch  # variable slots: the five pointers q, k, v, out, lse
    config: configs.FwdConfig


def plan_forward(
    q_shape, k_shape, strides, dtype: str, softmax_scale: float, causal: bool, arch: int, config=None,
    window_size=(-1, -1),
) -> ForwardPlan:
    """Builds (and compiles on first use) the launch for one problem.

    q_shape ``(batch, seqlen_q, nheads, d)``, k_shape ``(batch, seqlen_k, nheads_kv, d)``; ``strides`` holds the
    element strides of q, k, v and out (4 tuples of 4). ``d`` is a multiple of 8 (<= 256); every last-axis
    stride is 1, the others are multiples of 8 with row strides below ``MAX_ROW_STRIDE``; ``softmax_scale >= 0``
    (the interface folds a negative scale into q). ``config`` overrides the tile table (tuning only).
    ``causal`` and ``window_size`` (validated) pick the mask, see :func:`checks.window_bounds`.
    """
    batch, seqlen_q, nheads, headdim = q_shape
    seqlen_k, nheads_kv = k_shape[1], k_shape[2]
    mask, left, right = checks.window_bounds(causal, window_size)
    if config is None:
        config = configs.forward_config(arch, headdim, dtype, mask)
    function = build.get_kernel("fwd", config.name_expression(dtype, mask), config.smem_bytes)
    scalars = ()
    for batch_stride, row_stride, head_stride, _ in strides:
        scalars += (np.int64(batch_stride), np.int32(row_stride), np.int64(head_stride))
    scalars += (
        np.int32(seqlen_q),
        np.int32(seqlen_k),
        np.int32(nheads),
        np.int32(nheads // nheads_kv),
        np.int32(headdim),
        np.int32(left),
        np.int32(right),
        np.float32(softmax_scale),
        np.float32(softmax_scale * _LOG2E),
    )
    grid = ((seqlen_q + config.block_m - 1) // config.block_m, nheads, batch)
    launch = build.Launch(function, grid, (config.threads, 1, 1), config.smem_bytes, (np.uint64(0),) * 5 + scalars,
                          range(5))
    return ForwardPlan(launch, config)


def run_forward(plan: ForwardPlan, q_ptr: int, k_ptr: int, v_ptr: int, out_ptr: int, lse_ptr: int,
                stream_ptr: int) -> None:
    """Launches a plan on the stream with handle ``stream_ptr`` with raw device pointers."""
    plan.launch(stream_ptr, (q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr))
