"""Backward kernel family (cuda/bwd.cu): launch plans for preprocess, dK/dV (+ atomic dQ), deterministic dQ and
the dQ conversion, and their launch on raw pointers.

Like the forward, a plan depends only on shapes, strides, dtype and options, so the call pipeline remembers it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from . import arrays, build, checks, configs, params, tensor_maps
from .forward import _LOG2E, alibi_only_kernel, dropout_scalars, error_pointers, kernel_variant, stride_fields
from .options import DEFAULT, KernelOptions


@dataclass(frozen=True)
class BackwardPlan:
    # Each launch holds a params.BwdParams (a BwdHopperParams for the Hopper dK/dV kernel); per call, the pointers its
    # kernel reads and, for the main and dQ kernels, the dropout seed and offset (see run_backward).
    preprocess: build.Launch
    main: build.Launch
    dq: build.Launch | None  # deterministic=True on the mma.sync backward: dQ by its own kernel
    convert: build.Launch | None  # fp32 accumulator -> dq (every plan without a dq launch)
    zero_tail: build.Launch | None  # varlen: zeroes the gradient rows past the last sequence
    dsum_shape: tuple  # (batch, nheads, seqlen_q) float32 workspace ((nheads, total_q) for varlen)
    dq_accum_shape: tuple | None  # (batch, nheads, seqlen_q, d [+ 4]) float32 workspace, atomics only
    config: configs.BwdConfig | configs.HopperBwdConfig
    # The Hopper dK/dV kernel's tensor maps of q, k, v and dout (the tiles it moves with TMA: all of a padded call's,
    # a varlen call's whole ones): encoded into the main launch's struct (its tmap_* fields) for each call's pointers.
    tensor_maps: tensor_maps.TileMaps | None = None
    # The Hopper dK/dV kernel's counts of completed dQ additions (an int per batch row, query head and query tile:
    # turn flags when deterministic), zeroed for each call (run_backward) and passed as BwdHopperParams.dq_semaphore,
    # and to the conversion as BwdParams.dq_arrivals where it converts tile by tile (convert_counted); else 0.
    # Deterministic at the wide head dims: a plane of such ints per half of the tiles' rows (turn_planes).
    dq_semaphores: int = 0
    convert_counted: bool = False


def plan_backward(
    q_shape, k_shape, strides: dict, dtype: str, softmax_scale: float, causal: bool, deterministic: bool, arch: int,
    config=None, window_size=(-1, -1), softcap: float = 0.0, alibi_batch_stride=None, varlen_totals=None,
    dropout_p: float = 0.0, options: KernelOptions = DEFAULT, width: int | None = None, headdim_v: int | None = None,
) -> BackwardPlan:
    """Builds the launches for one backward problem.

    ``strides`` maps "q", "k", "v", "dout", "out", "dq", "dk", "dv" to element strides (4-tuples, last 1);
    shapes, alignment, modifiers and varlen as in :func:`fa2cupy.forward.plan_forward` (varlen: lse, and the
    dsum/dq_accum workspaces, are ``(nheads, total_q[, d])``, and dq/dk/dv must be contiguous: their rows past the
    last sequence are zeroed). The scale may be negative here: the backward has no
    running maximum, P = exp(scale * s - lse) is exact for any sign. ``options``: the kernel choices (the Hopper
    dK/dV kernel or not). ``width``: run the Hopper dK/dV kernel at this wider head dim where it takes the call, on
    arrays of the call's own: its copies read zeros past it (a varlen call's ragged tiles stop at
    ``BwdParams.headdim``), its dQ accumulator rows are the wider kernel's, and it writes dK and dV columns of the
    arrays' head dim only. ``headdim_v`` (padded calls on the Hopper dK/dV kernel at ``width``, at least both head
    dims; varlen ones where it is narrower than q's and configs.hopper_varlen_own_widths): v, dout and out have this
    head dim of their own (a multiple of 8; q and k have q_shape's), read as they are by the TMA copies, by a
    varlen call's ragged copies (which stop at ``BwdParams.headdim_v``) and by the preprocess; dq, dk and dv are
    the wider of the two head dims; ValueError where the Hopper dK/dV kernel does not take the call (the caller
    pads instead).
    """
    mask, mods, left, right = kernel_variant(causal, window_size, softcap, alibi_batch_stride is not None, dropout_p)
    batch, seqlen_q, nheads, headdim = q_shape
    seqlen_k, nheads_kv = k_shape[1], k_shape[2]
    own_v = headdim_v is not None and headdim_v != headdim
    q_headdim = headdim
    shapes = dict(zip(("q", "k", "v", "dout"),
                      tensor_maps.array_shapes(q_shape, k_shape, varlen_totals, headdim_v if own_v else None)))
    if own_v:  # (the gradients, and so the kernels' columns, at the wider head dim: BwdParams.headdim)
        q_shape, headdim = q_shape[:3] + (max(headdim, headdim_v),), max(headdim, headdim_v)
    # (strides TMA cannot take, say negative ones: the mma.sync backward, with cp.async)
    tma = all(tensor_maps.usable(shapes[n], strides[n]) for n in shapes)
    rows = None
    if config is None and width is not None and width != headdim and tma:
        wide = configs.kernel_rows(arch, width, dtype, mask, mods, varlen_totals is not None, seqlen_q, deterministic,
                                   options, dropout=dropout_p > 0)
        rows = wide if isinstance(wide.backward, configs.HopperBwdConfig) else None
    if rows is None:
        rows = configs.kernel_rows(arch, headdim, dtype, mask, mods, varlen_totals is not None, seqlen_q,
                                   deterministic, options, tma=tma, dropout=dropout_p > 0)
    config = config or rows.backward
    if isinstance(config, configs.HopperBwdConfig) and not tma:  # (a config given for tuning)
        rows = configs.kernel_rows(arch, headdim, dtype, mask, mods, varlen_totals is not None, seqlen_q,
                                   deterministic, options, tma=False, dropout=dropout_p > 0)
        config = rows.backward
    hopper = isinstance(config, configs.HopperBwdConfig)
    # (varlen: v no wider than q, whose head dim then bounds the dK and dV stores, and both in the row's last pass)
    if own_v and not (hopper and config.headdim >= headdim and (varlen_totals is None or (
            headdim_v < q_headdim and configs.hopper_varlen_own_widths(config.headdim, q_headdim, headdim_v)))):
        raise ValueError(f"headdim_v = {headdim_v} (q's {q_headdim}) runs on the Hopper dK/dV kernel alone (varlen: "
                         f"v narrower, configs.hopper_varlen_own_widths), which does not take this call: pad v, dout "
                         f"and out (or q and k) to one head dim")
    atomic = hopper or not deterministic  # (the Hopper kernel adds dQ in either mode: in turns when deterministic)
    total_q, total_k = varlen_totals or (0, 0)
    stats = (0, total_q) if varlen_totals else (nheads * seqlen_q, seqlen_q)
    threshold, keep_scale = dropout_scalars(dropout_p)
    # the fp32 dQ accumulator's floats per row, as the main kernel adds them (at its head dim, which may be wider)
    dq_pitch = config.dq_pitch(config.headdim if hopper else headdim)
    fields = {}
    for prefix, name in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out"), ("do", "dout"), ("dq", "dq"), ("dk", "dk"),
                         ("dv", "dv")):
        fields.update(stride_fields(prefix, strides[name]))
    fixed = params.BwdParams(
        **fields, stat_batch_stride=stats[0], stat_head_stride=stats[1], max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k,
        nheads=nheads, heads_per_kv=nheads // nheads_kv, headdim=headdim,
        headdim_v=headdim_v if own_v else headdim, total_q=total_q, total_k=total_k,
        batch=batch, dq_pitch=dq_pitch, window_left=left, window_right=right, scale=softmax_scale,
        scale_log2=softmax_scale * _LOG2E, softcap=softcap, alibi_batch_stride=alibi_batch_stride or 0,
        dropout_threshold=threshold, dropout_scale=keep_scale, **error_pointers())

    pre = _preprocess_launch(q_shape[:3] + (headdim_v,) if own_v else q_shape, dtype, fixed)
    varlen = varlen_totals is not None
    # (padded calls whose one modifier is ALiBi: the Hopper dK/dV kernel's ALiBi-only instantiation)
    alibi_only = hopper and not varlen and options.hopper_alibi_only and alibi_only_kernel(
        mask, softcap, alibi_batch_stride is not None, dropout_p, softmax_scale, backward=True)
    only = {"alibi_only": True} if alibi_only else {}  # (a Hopper row's keyword: the mma.sync rows have none)
    smem = config.smem_bytes(atomic, mods, **only)
    # (a call narrower than the Hopper row: its score products leave out the k16 steps of the zero columns)
    score_dim = (configs.hopper_bwd_score_dim(headdim, config.headdim, mods, mask, varlen),) if hopper else ()
    if own_v and headdim_v < headdim:  # (v narrower than q: dP^T's k and dV's N at v's own head dim where it has one)
        v_dim = configs.hopper_bwd_v_dim(headdim_v, config.headdim, score_dim[0], mods)
        only = {**only, "v_dim": v_dim} if v_dim != config.headdim else only
    function = build.get_kernel(config.family,
                                config.name_expression(dtype, mask, atomic, mods, varlen, *score_dim, **only), smem)
    grid = (((seqlen_k + config.block_n - 1) // config.block_n) * config.dslices, nheads_kv, batch)
    maps = None
    semaphores = 0
    # (deterministic calls whose flags are in two planes, one per half of the tiles' rows, convert after the whole
    # kernel: the conversion's count is an int per tile)
    planes = config.turn_planes if hopper and deterministic else 1
    counted = hopper and planes == 1 and configs.hopper_bwd_early_converts(
        mask, seqlen_q, options.hopper_bwd_early_convert, config.wide)
    if hopper:
        chunk = configs.hopper_bwd_group_chunk(grid[0], nheads_kv * batch, nheads // nheads_kv, mask,
                                              options.hopper_bwd_chunk_blocks)
        if deterministic or counted:  # (an int per batch row, query head and query tile of block_m rows)
            semaphores = batch * nheads * -(-seqlen_q // config.block_m)
        semaphores *= planes
        # (calls without a mask, whose window is unlimited both ways, on whichever kernel variant: the modifier
        # calls' is the window one)
        unmasked = left == right == checks.UNLIMITED_WINDOW
        rotate = int(unmasked and configs.hopper_bwd_rotates(grid[0] * chunk, build.sm_count(options.sm_count),
                                                             deterministic, mods, config.wide,
                                                             options.hopper_bwd_rotate))
        by_map = config.dq_by_map(headdim, varlen, mods)
        main = build.Launch(function, grid, (config.threads, 1, 1), smem,
                            params.BwdHopperParams(bwd=fixed, group_chunk=chunk, dq_rotate=rotate,
                                                   deterministic=int(deterministic), dq_by_map=int(by_map)),
                            tuple(f"bwd.{name}" for name in MAIN_PER_CALL) + (("dq_semaphore",) if semaphores else ()),
                            programmatic=options.hopper_bwd_programmatic,
                            maps=("tmap_q", "tmap_k", "tmap_v", "tmap_do", "tmap_dq"))
        tile_rows = {"q": config.block_m, "k": config.block_n, "v": config.block_n, "dout": config.block_m}
        # (and with dq_by_map the dQ accumulator's, whose reductions add only the arrays' head dim of each staged row)
        accumulator_rows = nheads * total_q if varlen_totals else batch * nheads * seqlen_q
        accumulator = (tensor_maps.accumulator_layout(accumulator_rows, headdim, dq_pitch, config.block_m)
                       if by_map else None)
        maps = tensor_maps.TileMaps([tensor_maps.layout(shapes[n], strides[n], tile_rows[n]) for n in shapes]
                                    + [accumulator])
    else:
        main = build.Launch(function, grid, (config.threads, 1, 1), smem, fixed, MAIN_PER_CALL)
    dq = convert = dq_accum_shape = None
    if not atomic:
        dq = _dq_launch(rows.backward_dq, q_shape, dtype, mask, mods, fixed)
    else:
        convert = _convert_launch(q_shape, dtype, fixed, hopper and options.hopper_bwd_programmatic,
                                  (config.block_m, config.block_n) if counted else None)
        dq_accum_shape = (nheads, total_q, dq_pitch) if varlen_totals else (batch, nheads, seqlen_q, dq_pitch)
    zero_tail = _zero_tail_launch(q_shape, k_shape, strides, varlen_totals, fixed) if varlen_totals else None
    dsum_shape = (nheads, total_q) if varlen_totals else (batch, nheads, seqlen_q)
    return BackwardPlan(pre, main, dq, convert, zero_tail, dsum_shape, dq_accum_shape, config, maps, semaphores,
                        counted)


def _preprocess_launch(q_shape, dtype, fixed: params.BwdParams) -> build.Launch:
    """dsum = rowsum(dout * out) (and the fp32 dQ accumulator's zeroing)."""
    batch, seqlen_q, nheads, headdim = q_shape
    lanes = min(32, 1 << (headdim // 8 - 1).bit_length())  # the preprocess's lanes per row: 16-byte chunks each
    launch = build.Launch(build.get_kernel("bwd", f"fa2::bwd_preprocess<{configs.DTYPE_TAGS[dtype]}>", 0),
                          (-(-seqlen_q * lanes // 256), nheads, batch), (256, 1, 1), 0, fixed,
                          ("dout", "out", "dsum", "dq_accum", "cu_seqlens_q"))
    launch.params.set(lanes=lanes, headdim=headdim)  # (the launch's own copy of the struct: dout's and out's)
    return launch


def _dq_launch(dq_config, q_shape, dtype, mask, mods, fixed: params.BwdParams) -> build.Launch:
    """The deterministic dQ kernel's launch (its own pass over the keys)."""
    batch, seqlen_q, nheads, _ = q_shape
    return build.Launch(build.get_kernel("bwd", dq_config.name_expression(dtype, mask, mods), dq_config.smem_bytes),
                        ((seqlen_q + dq_config.block_m - 1) // dq_config.block_m, nheads, batch),
                        (dq_config.threads, 1, 1), dq_config.smem_bytes, fixed, DQ_PER_CALL)


def _convert_launch(q_shape, dtype, fixed: params.BwdParams, programmatic: bool = False,
                    counted: tuple | None = None) -> build.Launch:
    """The atomic backward's last launch: the fp32 dQ accumulator, scaled, into dq's dtype and strides
    (``programmatic``: launched to start while the kernel before it finishes, sm_90). ``counted``: the Hopper
    dK/dV kernel's (block_m, block_n), whose per-tile arrival counts the conversion waits for, a tile at a time
    (a call then passes them as "dq_arrivals")."""
    batch, seqlen_q, nheads, headdim = q_shape
    launch = build.Launch(build.get_kernel("bwd", f"fa2::bwd_convert_dq<{configs.DTYPE_TAGS[dtype]}>", 0),
                          ((seqlen_q * (headdim // 8) + 255) // 256, nheads, batch), (256, 1, 1), 0, fixed,
                          ("dq_accum", "dq", "cu_seqlens_q", "cu_seqlens_k") + (("dq_arrivals",) if counted else ()),
                          programmatic)
    if counted:
        launch.params.set(arrival_block_m=counted[0], arrival_block_n=counted[1])
    return launch


def _zero_tail_launch(q_shape, k_shape, strides, varlen_totals, fixed: params.BwdParams) -> build.Launch:
    """Varlen: zeroes dq/dk/dv's rows past the last sequence (which must be contiguous)."""
    _, _, nheads, headdim = q_shape
    total_q, total_k = varlen_totals
    q_row, kv_row = nheads * headdim, k_shape[2] * headdim
    if any(strides[n][1:] != (row, headdim, 1) for n, row in (("dq", q_row), ("dk", kv_row), ("dv", kv_row))):
        raise ValueError("varlen gradients must be contiguous (total, heads, d) arrays")
    chunks = max(total_q * q_row, total_k * kv_row) // 8
    launch = build.Launch(build.get_kernel("bwd", "fa2::bwd_zero_tail", 0), (min(64, -(-chunks // 256)), 3, 1),
                          (256, 1, 1), 0, fixed, ("dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k"))
    launch.params.set(q_row_elems=q_row, kv_row_elems=kv_row)
    return launch


def maps_writer(plan: BackwardPlan, q: int, k: int, v: int, dout: int, dq_accum: int):
    """What the main launch takes as ``write_maps`` for these pointers: the plan's tensor maps encoded for them
    (None where the plan has none)."""
    return None if plan.tensor_maps is None else plan.tensor_maps.writer((q, k, v, dout, dq_accum))


#: The device pointers a backward launch takes, by name. A launch reads every one: its ``pointers`` start from
#: NO_POINTERS (0 where an array is absent).
POINTERS = ("q", "k", "v", "dout", "softmax_lse", "dsum", "dq_accum", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
            "alibi_slopes", "dropout_rng_state", "out", "dq")
NO_POINTERS = dict.fromkeys(POINTERS, 0)
_pointer_values = operator.itemgetter(*POINTERS)
#: The BwdParams fields the main (dK/dV) kernel and the deterministic dQ kernel take per call.
MAIN_PER_CALL = ("q", "k", "v", "dout", "lse", "dsum", "dq_accum", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
                 "alibi_slopes", "rng_state", "seed", "offset")
DQ_PER_CALL = ("q", "k", "v", "dout", "lse", "dsum", "dq", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes",
               "rng_state", "seed", "offset")


def run_backward(plan: BackwardPlan, pointers: dict, values: tuple, stream_ptr: int, framework: str = "cupy",
                 device: int = 0) -> None:
    """Launches a plan on the stream with handle ``stream_ptr``. ``pointers`` maps every name of :data:`POINTERS`
    to a device pointer: "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dsum" and (atomics only)
    "dq_accum", and 0 where absent, "cu_seqlens_q", "cu_seqlens_k" (varlen), "alibi_slopes" and
    "dropout_rng_state"; ``values`` = (dropout seed, dropout offset), ints in [0, 2**64)."""
    q, k, v, dout, lse, dsum, dq_accum, dk, dv, cu_q, cu_k, alibi, rng_state, out, dq = _pointer_values(pointers)
    if plan.convert is None:
        dq_accum = 0  # (deterministic: no accumulator)
    seed, offset = values
    flags, pointer = None, 0  # (no counts where there are no query tiles: a call without query rows)
    if plan.dq_semaphores:
        # The counts, fresh and zeroed on the stream for each call (as the forward's tile counter), so that calls on
        # other streams or replayed from CUDA graphs never share them; before the preprocess, so that it and the
        # dK/dV kernel are adjacent launches (programmatic).
        flags, pointer = arrays.new_zeroed_raw(plan.dq_semaphores, "int32", framework, device, stream_ptr)
    plan.preprocess(stream_ptr, (dout, out, dsum, dq_accum, cu_q))
    main_args = (q, k, v, dout, lse, dsum, dq_accum, dk, dv, cu_q, cu_k, alibi, rng_state, seed, offset)
    plan.main(stream_ptr, main_args + ((pointer,) if plan.dq_semaphores else ()),
              maps_writer(plan, q, k, v, dout, dq_accum))
    if plan.dq is not None:
        plan.dq(stream_ptr, (q, k, v, dout, lse, dsum, dq, cu_q, cu_k, alibi, rng_state, seed, offset))
    else:
        plan.convert(stream_ptr, (dq_accum, dq, cu_q, cu_k) + ((pointer,) if plan.convert_counted else ()))
    del flags  # (stream-ordered allocators: reused only by work queued after these launches)
    if plan.zero_tail is not None:
        plan.zero_tail(stream_ptr, (dq, dk, dv, cu_q, cu_k))
