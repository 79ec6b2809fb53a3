"""Forward kernel family (cuda/fwd.cu): the launch plan (config, grid, scalar arguments) and the launch.

A plan depends only on shapes, strides, dtype and options, never on data pointers, so the call pipeline
(fa2cupy.pipeline) remembers plans and a repeated call costs one dictionary look-up plus the launch itself.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from . import arrays, build, checks, configs, device_errors, params, tensor_maps
from .options import DEFAULT, KernelOptions

_LOG2E = 1.4426950408889634
MAX_ROW_STRIDE = checks.MAX_ROW_STRIDE


@dataclass(frozen=True)
class ForwardPlan:
    # A flash_fwd launch (params.FwdParams) or a Hopper forward's (params.FwdHopperParams); per call the pointers of
    # POINTERS, the dropout seed and offset and the tile counter (see run_forward).
    launch: build.Launch
    config: configs.FwdConfig | configs.HopperFwdConfig
    # The Hopper forward's blocks take work items from a counter (zeroed per launch, see run_forward) instead of
    # a grid stride: where items differ in length (masks), a fixed stride left SMs idle (0.64 of the ideal
    # balance at causal 16k, d=128).
    tile_counter: bool = False
    # The Hopper forward's tensor maps of q, k, v and out (the tiles it moves with TMA: all of a padded call's; a
    # varlen call's Q, whole output tiles and, unless K/V are paged, whole K/V tiles): encoded into the launch's
    # struct (its tmap_* fields) for each call's pointers.
    tensor_maps: tensor_maps.TileMaps | None = None


def kernel_variant(causal: bool, window_size, softcap: float, alibi: bool, dropout_p: float = 0.0,
                   causal_mods: bool = False, unmasked_mods: bool = False) -> tuple[str, bool, int, int]:
    """``(mask, mods, left, right)``: the kernel variant (configs.VARIANTS) and window bounds for the options.
    Softcap, ALiBi and dropout run in the modifier variant, built on the window mask, which expresses every mask;
    with ``causal_mods`` (the padded forward, configs.FORWARD_VARIANTS) a causal call takes the causal one, and with
    ``unmasked_mods`` (the padded Hopper forward, KernelOptions.hopper_unmasked_mods) a call without a mask or
    dropout the unmasked one (with dropout it measured slower there than the window one)."""
    mask, left, right = checks.window_bounds(causal, window_size)
    mods = softcap > 0 or alibi or dropout_p > 0
    keep = (causal_mods and mask == "causal") or (unmasked_mods and mask == "none" and dropout_p == 0)
    if mods and not keep:
        mask = "window"
    return mask, mods, left, right


def alibi_only_kernel(mask: str, softcap: float, alibi: bool, dropout_p: float, softmax_scale: float,
                      backward: bool = False) -> bool:
    """Whether a padded call on the Hopper kernels whose variant has mask ``mask`` (:func:`kernel_variant`) runs their
    ALiBi-only instantiation (HopperFwdTraits' and HopperBwdTraits' AlibiOnly, KernelOptions.hopper_alibi_only):
    ALiBi its one modifier; the forward's only without a mask or causal, at a positive scale in fp32 as the kernel
    takes it (UnitScoreMods' kAlibi), the dK/dV kernel's (``backward``) for every mask."""
    alone = alibi and softcap <= 0 and dropout_p <= 0
    return bool(alone and (backward or (mask in ("none", "causal") and np.float32(softmax_scale) > 0)))


def dropout_threshold(dropout_p: float) -> int:
    """The kernels' keep threshold for ``dropout_p``: a score is kept iff its 8-bit Philox number (cuda/attention/masks.cuh,
    Dropout) is below it, so the keep probability is threshold / 256 exactly. round((1 - p) * 256), at least 1;
    0 (dropout off) where that is 256, for p < 1/512."""
    if dropout_p <= 0:
        return 0
    threshold = max(1, round((1.0 - dropout_p) * 256))
    return 0 if threshold >= 256 else threshold


def realised_dropout_p(dropout_p: float) -> float:
    """The dropout probability the kernels realise for ``dropout_p``: a multiple of 1/256, the nearest to it (0 for
    p < 1/512). The kept scores are scaled by 1 / (1 - this), so the output stays an unbiased estimate; references
    and probabilities reported to the caller use it."""
    threshold = dropout_threshold(dropout_p)
    return 1.0 - threshold / 256 if threshold else 0.0


def dropout_scalars(dropout_p: float) -> tuple:
    """(keep threshold, 256 / threshold), the kernels' dropout_threshold and dropout_scale (:func:`dropout_threshold`):
    the scale of the kept scores is the exact inverse of the keep probability; threshold 0 switches dropout off
    (scale 1)."""
    threshold = dropout_threshold(dropout_p)
    return np.uint32(threshold), np.float32(256.0 / threshold if threshold else 1.0)


def fast_divisor(d: int) -> tuple[int, int]:
    """(magic, shift) with ``n // d == (umulhi(n, magic) + n) >> shift`` for 0 <= n < 2**31 (FastDiv in
    common/fast_div.cuh; Granlund & Montgomery 1994: shift = ceil(log2 d), magic = 2**32 (2**shift - d) // d + 1)."""
    if not 1 <= d < 1 << 31:
        raise ValueError(f"divisor must be in [1, 2**31), got {d}")
    shift = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def error_pointers() -> dict:
    """The device-error report words for kernels on the current device: the fields error_claim and error_host."""
    import cupy

    claim, host = device_errors.pointers(cupy.cuda.runtime.getDevice())
    return {"error_claim": claim, "error_host": host}


def stride_fields(prefix: str, strides) -> dict:
    """A (batch, row, head) stride triple of element strides as the fields ``<prefix>_batch_stride``, ... of a
    params struct (the last, 1, is implied)."""
    batch_stride, row_stride, head_stride = strides[:3]
    return {f"{prefix}_batch_stride": batch_stride, f"{prefix}_row_stride": row_stride,
            f"{prefix}_head_stride": head_stride}


def kernel_config(arch: int, headdim: int, dtype: str, mask: str, mods: bool = False, varlen: bool = False,
                  seqlen_q: int | None = None, options: KernelOptions = DEFAULT, dropout: bool = False):
    """The forward kernel's row for a call (configs.kernel_rows): the Hopper forward's where it takes the call (and
    the options let it), else the mma.sync forward's. ``mods``: softcap, ALiBi or dropout; ``dropout``: whether
    dropout is among them."""
    return configs.kernel_rows(arch, headdim, dtype, mask, mods, varlen, seqlen_q, options=options,
                               dropout=dropout).forward


def plan_forward(
    q_shape, k_shape, strides, dtype: str, softmax_scale: float, causal: bool, arch: int, config=None,
    window_size=(-1, -1), softcap: float = 0.0, alibi_batch_stride=None, varlen_totals=None, dropout_p: float = 0.0,
    paged=None, options: KernelOptions = DEFAULT, width: int | None = None, headdim_v: int | None = None,
) -> ForwardPlan:
    """Builds (and compiles on first use) the launch for one problem.

    q_shape ``(batch, seqlen_q, nheads, d)``, k_shape ``(batch, seqlen_k, nheads_kv, d)``; ``strides`` holds the
    element strides of q, k, v and out (4 tuples of 4). ``d`` is a multiple of 8 (<= 256); every last-axis
    stride is 1, the others are multiples of 8 with row strides below ``MAX_ROW_STRIDE``; ``softmax_scale >= 0``
    (the entry points fold a negative scale into q). ``config`` overrides the tile table (tuning only).
    ``causal`` and ``window_size`` (validated) pick the mask, see :func:`checks.window_bounds`; ``softcap > 0`` and
    ``alibi_batch_stride`` (not None: slopes are passed, with this batch stride in elements) the score modifiers,
    ``dropout_p > 0`` dropout (the seed and offset are per-call arguments of :func:`run_forward`).

    Varlen: ``varlen_totals = (total_q, total_k)``, the rows of the packed arrays; then the shapes carry the
    number of sequences and the maximum lengths, the batch strides are 0, lse is ``(nheads, total_q)``, and the
    launch takes cu_seqlens pointers. Paged K/V (varlen only): ``paged = (num_pages, page_size, max_pages)``;
    k/v are then ``(num_pages, page_size, nheads_kv, d)`` (their batch strides are the page strides), the launch
    takes a block_table pointer (int32 ``(batch, max_pages)``), and key ``j`` of sequence ``b`` is row
    ``j % page_size`` of page ``block_table[b, j // page_size]``; ``k_shape[1]`` is then max_seqlen_k.
    ``options``: the kernel choices (the Hopper forward or not, its tile counter and L2 grouping).
    ``width`` (not paged): run the Hopper forward at this wider head dim where it takes the call, on arrays of
    head dim ``d``: its copies read zeros past ``d`` and it writes no output column past it (the tensor maps span
    ``d`` columns; a varlen call's ragged tiles stop at ``FwdParams.headdim``); elsewhere the kernels run at ``d``.
    ``headdim_v`` (padded calls on the Hopper forward at ``width``, at least both head dims; varlen ones, not paged,
    where configs.hopper_varlen_own_widths): v and out have this head dim of their own (a multiple of 8), read and
    written as they are by the TMA copies, whose maps span each array's own columns, and by a varlen call's ragged
    copies and stores, which stop at ``FwdParams.headdim_v``; where v is narrower than the row and the row has a
    kernel at v's head dim (configs.hopper_fwd_v_config), that kernel runs the call. ValueError where the Hopper
    forward does not take the call (the caller pads instead).
    """
    batch, seqlen_q, nheads, headdim = q_shape
    seqlen_k, nheads_kv = k_shape[1], k_shape[2]
    mask, mods, left, right = kernel_variant(causal, window_size, softcap, alibi_batch_stride is not None, dropout_p,
                                             causal_mods=varlen_totals is None)
    # The Hopper forward's tensor maps (padded calls, and varlen, whose Q, whole output tiles and, packed, whole K/V
    # tiles go by TMA; paged K/V have none), over the packed arrays' rows for varlen.
    shapes = tensor_maps.array_shapes(q_shape, k_shape, varlen_totals, headdim_v)
    mapped = (True, paged is None, paged is None, True)
    # (strides TMA cannot take, say negative ones: the mma.sync forward, which copies with cp.async)
    tma = all(tensor_maps.usable(shape, s) for shape, s, m in zip(shapes, strides, mapped) if m)
    if config is None and width is not None and width != headdim and tma and paged is None:
        wide = kernel_config(arch, width, dtype, mask, mods, varlen_totals is not None, seqlen_q, options,
                             dropout_p > 0)
        config = wide if isinstance(wide, configs.HopperFwdConfig) else None
    if config is None or (isinstance(config, configs.HopperFwdConfig) and not tma):
        config = configs.kernel_rows(arch, headdim, dtype, mask, mods, varlen_totals is not None, seqlen_q,
                                     options=options, tma=tma, dropout=dropout_p > 0).forward
    # (the unmasked modifier variant and the ALiBi-only kernel are the padded Hopper forward's alone, so they are
    # chosen once the row is)
    padded_hopper = isinstance(config, configs.HopperFwdConfig) and varlen_totals is None
    if padded_hopper and options.hopper_unmasked_mods:
        mask = kernel_variant(causal, window_size, softcap, alibi_batch_stride is not None, dropout_p,
                              causal_mods=True, unmasked_mods=True)[0]
    alibi_only = padded_hopper and options.hopper_alibi_only and alibi_only_kernel(
        mask, softcap, alibi_batch_stride is not None, dropout_p, softmax_scale)
    only = {"alibi_only": True} if alibi_only else {}  # (a Hopper row's keyword: the mma.sync rows have none)
    own_v = headdim_v is not None and headdim_v != headdim
    varlen_hopper = isinstance(config, configs.HopperFwdConfig) and varlen_totals is not None and paged is None
    if own_v and not ((padded_hopper and config.headdim >= max(headdim, headdim_v)) or (
            varlen_hopper and configs.hopper_varlen_own_widths(config.headdim, headdim, headdim_v))):
        raise ValueError(f"headdim_v = {headdim_v} (q's {headdim}) runs on the Hopper forward alone (varlen: "
                         f"configs.hopper_varlen_own_widths), which does not take this call: pad v (or q and k) to "
                         f"one head dim")
    if own_v and headdim_v < config.headdim:  # (v narrower than the row: its own V tiles and P V where it has them)
        config = configs.hopper_fwd_v_config(config, headdim_v, mods, paged is not None, mask,
                                             varlen_totals is not None)
    function = build.get_kernel(config.family, config.name_expression(dtype, mask, mods, varlen_totals is not None,
                                                                      paged is not None, **only), config.smem_bytes)
    fixed = _forward_params(q_shape, k_shape, strides, softmax_scale, left, right, softcap, alibi_batch_stride,
                            varlen_totals, dropout_p, paged, headdim_v)
    grid = ((seqlen_q + config.block_m - 1) // config.block_m, nheads, batch)
    if not isinstance(config, configs.HopperFwdConfig):
        launch = build.Launch(function, grid, (config.threads, 1, 1), config.smem_bytes, fixed, PER_CALL)
        return ForwardPlan(launch, config)
    # The Hopper forward: persistent blocks, one per SM at most, walking the work items.
    grid, tile_counter, heads_per_group, tail_heads = _persistent_grid(grid, mask, seqlen_k, headdim,
                                                                       nheads // nheads_kv, options, config)
    unit, unit_inv = unit_mods_constants(softmax_scale, softcap)
    hopper = params.FwdHopperParams(fwd=fixed, batch=batch, heads_per_group=heads_per_group, tail_heads=tail_heads,
                                    mods_unit=unit, mods_unit_inv=unit_inv)
    per_call = tuple(f"fwd.{name}" for name in PER_CALL) + (("tile_counter",) if tile_counter else ())
    launch = build.Launch(function, grid, (config.threads, 1, 1), config.smem_bytes, hopper, per_call,
                          maps=("tmap_q", "tmap_k", "tmap_v", "tmap_o"))
    rows = (config.block_m, config.block_n, config.block_n, config.block_m)
    maps = tensor_maps.TileMaps([tensor_maps.layout(shape, s, r) if m else None
                                 for shape, s, r, m in zip(shapes, strides, rows, mapped)])
    return ForwardPlan(launch, config, tile_counter, maps)


def unit_mods_constants(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """The Hopper forward's softcap and ALiBi constants per call (UnitModsConstants, cuda/attention/masks.cuh): the
    unit of the modified scores (the cap, else the scale, else 1) and its reciprocal, which takes ALiBi's slope into
    that unit."""
    unit = softcap if softcap > 0 else softmax_scale if softmax_scale > 0 else 1.0
    return unit, 1.0 / unit


def _forward_params(q_shape, k_shape, strides, softmax_scale, left, right, softcap, alibi_batch_stride,
                    varlen_totals, dropout_p, paged, headdim_v=None) -> params.FwdParams:
    """The forward's fixed parameters (all but the per-call fields; ``headdim_v``: v's and out's, if not q's)."""
    _, seqlen_q, nheads, headdim = q_shape
    seqlen_k, nheads_kv = k_shape[1], k_shape[2]
    total_q, total_k = varlen_totals or (0, 0)
    lse_strides = (0, total_q) if varlen_totals else (nheads * seqlen_q, seqlen_q)
    num_pages, page_size, max_pages = paged or (0, 1, 0)
    if paged is not None:
        total_k = (1 << 31) - 1  # cu_seqlens_k counts keys of the sequences' pages, not rows of k
    magic, shift = fast_divisor(page_size)
    threshold, keep_scale = dropout_scalars(dropout_p)
    fields = {}
    for prefix, array_strides in zip(("q", "k", "v", "o"), strides):
        fields.update(stride_fields(prefix, array_strides))
    return params.FwdParams(
        **fields, lse_batch_stride=lse_strides[0], lse_head_stride=lse_strides[1], max_seqlen_q=seqlen_q,
        max_seqlen_k=seqlen_k, nheads=nheads, heads_per_kv=nheads // nheads_kv, headdim=headdim,
        headdim_v=headdim if headdim_v is None else headdim_v, total_q=total_q,
        total_k=total_k, window_left=left, window_right=right, scale=softmax_scale,
        scale_log2=softmax_scale * _LOG2E, softcap=softcap, alibi_batch_stride=alibi_batch_stride or 0,
        dropout_threshold=threshold, dropout_scale=keep_scale, page_size=page_size, page_magic=magic,
        page_shift=shift, max_pages=max_pages, num_pages=num_pages, **error_pointers())


def _persistent_grid(grid, mask, seqlen_k, headdim, group, options, config) -> tuple:
    """The Hopper forward's persistent blocks, one per SM at most, for the work items of ``grid``: (grid, whether
    a tile counter hands out the items, heads per L2 group, heads of the last group)."""
    items = grid[0] * grid[1] * grid[2]
    sms = build.sm_count(options.sm_count)
    persistent = (min(items, sms), 1, 1)
    # Items of different lengths (a mask) go to whichever block asks next, longest first within L2 groups.
    tile_counter = options.tile_counter and mask != "none" and items > persistent[0]
    heads = grid[1] * grid[2]
    if not tile_counter:
        return persistent, False, 1, 1
    heads_per_group = configs.hopper_heads_per_group(seqlen_k, headdim, group, heads, options.hopper_l2_group_bytes)
    # (a causal mask's items run from one key tile to all; a window's are about one length: its last group stays an
    # L2 group, whose heads' K/V stay in L2)
    waves = config.tail_waves if mask == "causal" else 0
    waves = waves if options.hopper_tail_waves is None else options.hopper_tail_waves
    tail = configs.hopper_tail_heads(grid[0], heads, heads_per_group, persistent[0], waves)
    return persistent, True, heads_per_group, tail


#: The device pointers a forward launch takes, by name. A launch reads every one: its ``pointers`` start from
#: NO_POINTERS (0 where an array is absent).
POINTERS = ("q", "k", "v", "out", "softmax_lse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "dropout_rng_state",
            "block_table")
NO_POINTERS = dict.fromkeys(POINTERS, 0)
_pointer_values = operator.itemgetter(*POINTERS)
#: The FwdParams field of each pointer.
FIELDS = {"q": "q", "k": "k", "v": "v", "out": "o", "softmax_lse": "lse", "cu_seqlens_q": "cu_seqlens_q",
          "cu_seqlens_k": "cu_seqlens_k", "alibi_slopes": "alibi_slopes", "dropout_rng_state": "rng_state",
          "block_table": "block_table"}
#: The FwdParams fields a call writes: the pointers, then the dropout seed and offset.
PER_CALL = tuple(FIELDS[name] for name in POINTERS) + ("seed", "offset")


def run_forward(plan: ForwardPlan, pointers: dict, values: tuple, stream_ptr: int, framework: str = "cupy",
                device: int = 0) -> None:
    """Launches a plan on the stream with handle ``stream_ptr``. ``pointers`` maps every name of :data:`POINTERS`
    to a device pointer: "q", "k", "v", "out", "softmax_lse", and 0 where absent, "cu_seqlens_q", "cu_seqlens_k"
    (varlen), "alibi_slopes", "dropout_rng_state" (uint32 {seed lo, seed hi, offset lo, offset hi} in device
    memory, read instead of ``values``) and "block_table" (required by a plan made with ``paged``). ``values`` =
    (dropout seed, dropout offset), ints in [0, 2**64), ignored without dropout.

    A plan with a tile counter gets a fresh one, zeroed on the stream, from the caller's allocator (see
    :func:`arrays.new_zeroed_raw`, on the current ``device``): per launch, so that launches on different streams
    or replayed from CUDA graphs never share one (a graph captures the zeroing with the launch)."""
    args = _pointer_values(pointers) + values
    write_maps = None if plan.tensor_maps is None else plan.tensor_maps.writer(args[:4])  # (q, k, v, out)
    if plan.tile_counter:
        counter, pointer = arrays.new_zeroed_raw(1, "int32", framework, device, stream_ptr)
        plan.launch(stream_ptr, args + (pointer,), write_maps)
        del counter  # (stream-ordered allocators: reused only by work queued after this launch)
    else:
        plan.launch(stream_ptr, args, write_maps)


def plan_dropout_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float) -> build.Launch:
    """The launch that writes the keep mask (uint8 ``(batch, nheads, seqlen_q, seqlen_k)``, 1 = kept) the kernels
    draw for ``dropout_p``; per call the mask's pointer and the seed and offset (:func:`run_dropout_mask`)."""
    function = build.get_kernel("fwd", "fa2::dropout_keep_mask", 0)
    threshold, _ = dropout_scalars(dropout_p)
    fixed = params.DropoutMaskParams(seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, threshold=threshold)
    return build.Launch(function, ((seqlen_k + 255) // 256, seqlen_q, batch * nheads), (256, 1, 1), 0, fixed,
                        ("mask", "seed", "offset"))


def run_dropout_mask(plan: build.Launch, pointers: dict, values: tuple, stream_ptr: int, framework: str = "cupy",
                     device: int = 0) -> None:
    """Writes the keep mask into ``pointers["mask"]`` for ``values`` = (dropout seed, dropout offset)."""
    plan(stream_ptr, (pointers["mask"],) + values)
