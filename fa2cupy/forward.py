"""Forward kernel family (cuda/fwd.cu): the launch plan (config, grid, scalar arguments) and the launch.

A plan depends only on shapes, strides, dtype and options, never on data pointers, so the interface caches
plans and a repeated call costs one dictionary look-up plus the launch itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import arrays, build, checks, configs, device_errors, tensor_maps

#: Tests set this to fill out and lse with NaN before every launch, so an element the kernel fails to write
#: shows up as NaN instead of as whatever the allocator happened to hand back.
_debug_poison = False

#: Run calls without modifiers (paged K/V included) on the Hopper kernel (cuda/hopper/fwd.cu) on compute capability 9.0
#: where configs.hopper_forward_config picks it. Tests and A/B timings set it False to run the mma.sync kernel
#: there instead (and empty configs.HOPPER_MASKED_MIN_SEQLEN's lengths to take the Hopper kernel for every length).
HOPPER = True
#: Let the Hopper forward's blocks take masked work items from a tile counter (False: the grid stride, for A/B).
TILE_COUNTER = True

_LOG2E = 1.4426950408889634
#: Row strides travel as 32-bit ints (the kernel steps K/V rows with them); the interface copies anything wider.
MAX_ROW_STRIDE = 1 << 24


@dataclass(frozen=True)
class ForwardPlan:
    # variable slots: the ten pointers q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi, rng_state,
    # block_table, then the dropout seed and offset words (see dropout_words)
    launch: build.Launch
    config: configs.FwdConfig | configs.HopperFwdConfig
    # The Hopper forward's blocks take work items from a counter (zeroed per launch, see run_forward) instead of
    # a grid stride: where items differ in length (masks), a fixed stride left SMs idle (0.64 of the ideal
    # balance at causal 16k, d=128).
    tile_counter: bool = False
    # The Hopper forward's tensor maps of q, k, v and out (the tiles it moves with TMA: all of a padded call's; a
    # varlen call's Q, whole output tiles and, unless K/V are paged, whole K/V tiles): encoded into the launch's
    # last four parameters for each call's pointers.
    tensor_maps: tensor_maps.TileMaps | None = None


def kernel_variant(causal: bool, window_size, softcap: float, alibi: bool,
                   dropout_p: float = 0.0) -> tuple[str, bool, int, int]:
    """``(mask, mods, left, right)``: the kernel variant (configs.VARIANTS) and window bounds for the options.
    Softcap, ALiBi and dropout run in the modifier variant, built on the window mask, which expresses every mask."""
    mask, left, right = checks.window_bounds(causal, window_size)
    mods = softcap > 0 or alibi or dropout_p > 0
    return ("window" if mods else mask), mods, left, right


def dropout_scalars(dropout_p: float) -> tuple:
    """(keep threshold, 1 / (1 - p)) as kernel arguments: a score is kept iff its 16-bit Philox number is below
    the threshold, round((1 - p) * 65536) (at least 1); threshold 0 switches dropout off."""
    if dropout_p <= 0:
        return np.uint32(0), np.float32(1.0)
    return np.uint32(max(1, min(65536, round((1.0 - dropout_p) * 65536)))), np.float32(1.0 / (1.0 - dropout_p))


def dropout_words(seed: int, offset: int) -> tuple[int, int, int, int]:
    """The 64-bit dropout seed and offset as the kernels' four 32-bit words (seed lo/hi, offset lo/hi)."""
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, offset & 0xFFFFFFFF, (offset >> 32) & 0xFFFFFFFF


def fast_divisor(d: int) -> tuple[int, int]:
    """(magic, shift) with ``n // d == (umulhi(n, magic) + n) >> shift`` for 0 <= n < 2**31 (FastDiv in
    common/fast_div.cuh; Granlund & Montgomery 1994: shift = ceil(log2 d), magic = 2**32 (2**shift - d) // d + 1)."""
    if not 1 <= d < 1 << 31:
        raise ValueError(f"divisor must be in [1, 2**31), got {d}")
    shift = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def error_pointers() -> tuple:
    """The device-error report words for kernels on the current device, as kernel arguments."""
    import cupy

    claim, host = device_errors.pointers(cupy.cuda.runtime.getDevice())
    return np.uint64(claim), np.uint64(host)


def kernel_config(arch: int, headdim: int, dtype: str, mask: str, mods: bool = False, varlen: bool = False,
                  seqlen_q: int | None = None):
    """The forward kernel's row for a call: the Hopper forward's where it takes the call (and HOPPER is on), else
    the mma.sync forward's."""
    config = configs.hopper_forward_config(arch, headdim, dtype, mods, varlen, mask, seqlen_q) if HOPPER else None
    return config or configs.forward_config(arch, headdim, dtype, mask, varlen)


def plan_forward(
    q_shape, k_shape, strides, dtype: str, softmax_scale: float, causal: bool, arch: int, config=None,
    window_size=(-1, -1), softcap: float = 0.0, alibi_batch_stride=None, varlen_totals=None, dropout_p: float = 0.0,
    paged=None,
) -> ForwardPlan:
    """Builds (and compiles on first use) the launch for one problem.

    q_shape ``(batch, seqlen_q, nheads, d)``, k_shape ``(batch, seqlen_k, nheads_kv, d)``; ``strides`` holds the
    element strides of q, k, v and out (4 tuples of 4). ``d`` is a multiple of 8 (<= 256); every last-axis
    stride is 1, the others are multiples of 8 with row strides below ``MAX_ROW_STRIDE``; ``softmax_scale >= 0``
    (the interface folds a negative scale into q). ``config`` overrides the tile table (tuning only).
    ``causal`` and ``window_size`` (validated) pick the mask, see :func:`checks.window_bounds`; ``softcap > 0`` and
    ``alibi_batch_stride`` (not None: slopes are passed, with this batch stride in elements) the score modifiers,
    ``dropout_p > 0`` dropout (the seed and offset are per-call arguments of :func:`run_forward`).

    Varlen: ``varlen_totals = (total_q, total_k)``, the rows of the packed arrays; then the shapes carry the
    number of sequences and the maximum lengths, the batch strides are 0, lse is ``(nheads, total_q)``, and the
    launch takes cu_seqlens pointers. Paged K/V (varlen only): ``paged = (num_pages, page_size, max_pages)``;
    k/v are then ``(num_pages, page_size, nheads_kv, d)`` (their batch strides are the page strides), the launch
    takes a block_table pointer (int32 ``(batch, max_pages)``), and key ``j`` of sequence ``b`` is row
    ``j % page_size`` of page ``block_table[b, j // page_size]``; ``k_shape[1]`` is then max_seqlen_k.
    """
    batch, seqlen_q, nheads, headdim = q_shape
    seqlen_k, nheads_kv = k_shape[1], k_shape[2]
    mask, mods, left, right = kernel_variant(causal, window_size, softcap, alibi_batch_stride is not None, dropout_p)
    if config is None:
        config = kernel_config(arch, headdim, dtype, mask, mods, varlen_totals is not None, seqlen_q)
    # The Hopper forward's tensor maps (padded calls, and varlen, whose Q, whole output tiles and, packed, whole K/V
    # tiles go by TMA; paged K/V have none), over the packed arrays' rows for varlen.
    shapes = tensor_maps.array_shapes(q_shape, k_shape, varlen_totals)
    mapped = (True, paged is None, paged is None, True)
    if (isinstance(config, configs.HopperFwdConfig)
            and not all(tensor_maps.usable(shape, s) for shape, s, m in zip(shapes, strides, mapped) if m)):
        # (strides TMA cannot take, say negative ones: the mma.sync forward, which copies with cp.async)
        config = configs.forward_config(arch, headdim, dtype, mask, varlen_totals is not None)
    function = build.get_kernel(config.family, config.name_expression(dtype, mask, mods, varlen_totals is not None,
                                                                      paged is not None), config.smem_bytes)
    hopper = isinstance(config, configs.HopperFwdConfig)
    scalars = ()
    for batch_stride, row_stride, head_stride, _ in strides:
        scalars += (np.int64(batch_stride), np.int32(row_stride), np.int64(head_stride))
    total_q, total_k = varlen_totals or (0, 0)
    lse_strides = (0, total_q) if varlen_totals else (nheads * seqlen_q, seqlen_q)
    scalars += (
        np.int64(lse_strides[0]),
        np.int64(lse_strides[1]),
        np.int32(seqlen_q),
        np.int32(seqlen_k),
        np.int32(nheads),
        np.int32(nheads // nheads_kv),
        np.int32(headdim),
        np.int32(left),
        np.int32(right),
        np.float32(softmax_scale),
        np.float32(softmax_scale * _LOG2E),
        np.float32(softcap),
        np.int32(alibi_batch_stride or 0),
    )
    threshold, keep_scale = dropout_scalars(dropout_p)
    rng_slot = 10 + len(scalars) + 1  # seed lo, seed hi, offset lo, offset hi follow the threshold
    num_pages, page_size, max_pages = paged or (0, 1, 0)
    if paged is not None:
        total_k = (1 << 31) - 1  # cu_seqlens_k counts keys of the sequences' pages, not rows of k
    magic, shift = fast_divisor(page_size)
    scalars += (threshold, np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0), keep_scale,
                np.int32(total_q), np.int32(total_k), np.int32(page_size), np.uint32(magic), np.int32(shift),
                np.int32(max_pages), np.int32(num_pages)) + error_pointers()
    grid = ((seqlen_q + config.block_m - 1) // config.block_m, nheads, batch)
    variable = list(range(10)) + list(range(rng_slot, rng_slot + 4))
    tile_counter = False
    if hopper:  # persistent blocks, one per SM at most, walking the work items
        import cupy

        items = grid[0] * nheads * batch
        sms = build.device_attribute(cupy.cuda.runtime.getDevice(), "MultiProcessorCount")
        grid = (min(items, sms), 1, 1)
        # Items of different lengths (a mask) go to whichever block asks next, longest first within L2 groups.
        tile_counter = TILE_COUNTER and mask != "none" and items > grid[0]
        heads_per_group = configs.hopper_heads_per_group(seqlen_k, headdim, nheads // nheads_kv,
                                                         nheads * batch) if tile_counter else 1
        scalars += (np.int32(batch), np.int32(heads_per_group), np.uint64(0))  # the tile counter: 0, the stride
        if tile_counter:
            variable.append(10 + len(scalars) - 1)  # a fresh counter per launch (run_forward)
    launch = build.Launch(function, grid, (config.threads, 1, 1), config.smem_bytes, (np.uint64(0),) * 10 + scalars,
                          variable, blobs=4 if hopper else 0)
    maps = None
    if hopper:
        rows = (config.block_m, config.block_n, config.block_n, config.block_m)
        maps = tensor_maps.TileMaps([tensor_maps.layout(shape, s, r) if m else None
                                     for shape, s, r, m in zip(shapes, strides, rows, mapped)])
    return ForwardPlan(launch, config, tile_counter, maps)


def run_forward(plan: ForwardPlan, q_ptr: int, k_ptr: int, v_ptr: int, out_ptr: int, lse_ptr: int,
                stream_ptr: int, cu_seqlens_q: int = 0, cu_seqlens_k: int = 0, alibi_slopes: int = 0,
                dropout_seed: int = 0, dropout_offset: int = 0, rng_state: int = 0, block_table: int = 0,
                framework: str = "cupy", device: int = 0) -> None:
    """Launches a plan on the stream with handle ``stream_ptr`` with raw device pointers (0 for an absent
    cu_seqlens, alibi_slopes, rng_state or block_table) and the dropout seed and offset (ignored without dropout; a
    non-zero ``rng_state`` points to uint32 {seed lo, seed hi, offset lo, offset hi} in device memory instead).
    ``block_table`` is required by a plan made with ``paged`` and must be 0 otherwise.

    A plan with a tile counter gets a fresh one, zeroed on the stream, from the caller's allocator (see
    :func:`arrays.new_empty_raw`, on the current ``device``): per launch, so that launches on different streams
    or replayed from CUDA graphs never share one (a graph captures the zeroing with the launch)."""
    values = (q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state,
              block_table) + dropout_words(dropout_seed, dropout_offset)
    write_maps = None if plan.tensor_maps is None else plan.tensor_maps.writer((q_ptr, k_ptr, v_ptr, out_ptr))
    if plan.tile_counter:
        counter, pointer = arrays.new_empty_raw((1,), "int32", framework, device)
        build.memset_async(pointer, 0, 4, stream_ptr)
        plan.launch(stream_ptr, values + (pointer,), write_maps)
        del counter  # (stream-ordered allocators: reused only by work queued after this launch)
    else:
        plan.launch(stream_ptr, values, write_maps)


def dropout_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float, seed: int, offset: int,
                 stream_ptr: int, out_ptr: int) -> None:
    """Writes the keep mask (uint8 ``(batch, nheads, seqlen_q, seqlen_k)``, 1 = kept) that the kernels draw for
    these dropout parameters into ``out_ptr``."""
    function = build.get_kernel("fwd", "fa2::dropout_keep_mask", 0)
    threshold, _ = dropout_scalars(dropout_p)
    args = (np.uint64(out_ptr), np.int32(seqlen_q), np.int32(seqlen_k), np.int32(nheads), threshold) + tuple(
        np.uint32(w) for w in dropout_words(seed, offset))
    build.Launch(function, ((seqlen_k + 255) // 256, seqlen_q, batch * nheads), (256, 1, 1), 0, args, ())(
        stream_ptr, ())
