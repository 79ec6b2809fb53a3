"""Decode kernel family (cuda/decode.cu): split-KV decoding with GQA packing over contiguous or paged caches, and
the (out, lse) merge (public as merge_attention_states). A plan depends on shapes, strides and options only; the
call pipeline remembers it, so a decode step costs a dictionary look-up and one to three launches (append, rotary
q, attention)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from . import arrays, build, configs, device_errors, params
from .checks import UNLIMITED_WINDOW, DecodeExtras  # noqa: F401 -- (decode.UNLIMITED_WINDOW, decode.DecodeExtras)
from .forward import fast_divisor
from .options import DEFAULT, KernelOptions

_LOG2E = 1.4426950408889634

#: merge_states instantiations by (parts dtype, output dtype): 16-bit parts keep their dtype; fp32 parts (split-KV
#: partial results) are written out in the query's dtype.
MERGE_DTYPES = (("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float16"), ("float32", "bfloat16"))
_TAGS = {**configs.DTYPE_TAGS, "float32": "fa2::f32"}


def merge_name_expression(parts_dtype: str, out_dtype: str) -> str:
    return f"fa2::merge_states<{_TAGS[parts_dtype]}, {_TAGS[out_dtype]}>"


def instantiations(family: str | None = None) -> list[str]:
    """Name expressions of every shipped decode-family instantiation (of one arch family, or all; merge, append and
    rotary kernels are not per arch family): per table row and deep-ring twin the plain kernels (causal x paged x
    dtype) and the Extras ones (paged x dtype)."""
    return sorted({merge_name_expression(p, o) for p, o in MERGE_DTYPES}
                  | {append_name_expression(paged) for paged in (False, True)}
                  | {append_name_expression(paged, dtype) for paged in (False, True) for dtype in configs.DTYPE_TAGS}
                  | {rotary_name_expression(dtype) for dtype in configs.DTYPE_TAGS}
                  | set(configs.decode_instantiations(family))
                  | set(configs.decode_instantiations(family, extras=True)))


#: The plain decode: no window, softcap, ALiBi, left padding or rotary.
PLAIN = DecodeExtras()


@dataclass(frozen=True)
class DecodePlan:
    """Everything a call needs but its pointers and its int cache_seqlens: built once per metadata, cached."""

    # Each launch holds a params.DecodeParams; per call the fields of ATTENTION_PER_CALL, APPEND_PER_CALL and
    # ROTARY_PER_CALL (see run_decode).
    attention: build.Launch
    append: build.Launch | None  # None without new keys
    rotary: build.Launch | None  # rotates q into a temporary
    splits: int
    workspace_floats: int  # arrivals, partial lse, partial out (float32 units); 0 with one split
    arrivals: int
    partial_lse_offset: int
    partial_out_offset: int
    capacity: int
    seqlen_new: int
    rotary_span: int = 0  # with rotary: positions rotated from cache_seqlens on (an int one is checked on the host)
    seqlen_ro: int = 0  # rows of rotary_cos / rotary_sin
    config: configs.DecodeConfig | None = None  # the attention kernel's row
    workspaces: dict = field(default_factory=dict, compare=False)  # stream handle -> (array, pointer)

    def workspace(self, stream_ptr: int, framework: str, device: int) -> int:
        """This plan's scratch memory for launches on one stream (0 with one split): zeroed once, then reused by
        every call on that stream (stream order makes that safe); the merging block leaves the arrival counters
        at 0 again, so a call needs no memset."""
        if self.splits == 1:
            return 0
        found = self.workspaces.get(stream_ptr)
        if found is None:
            array, pointer = arrays.new_zeroed_raw(self.workspace_floats, "float32", framework, device, stream_ptr,
                                                   zero_bytes=self.arrivals * 4)
            found = self.workspaces[stream_ptr] = (array, pointer)
        return found[1]


def choose_num_splits(blocks: int, sms: int, max_seqlen_k: int, tile_keys: int) -> int:
    """Splits per (batch row, kv head, row block): enough that the ``blocks`` x splits cover the GPU's ``sms``
    once (floor: a second, partial wave would cost a whole wave), and each split keeps at least one key tile
    per warp (``tile_keys`` = warps x keys per tile). One block per SM, not full residency: measured on the
    H100, one 4-warp block keeps enough loads in flight to saturate an SM's share of HBM, and more splits only
    add partial results to merge; this rule picked the fastest split count (or within 5% of it) at every point
    of a `bench/dev/tune_decode.py` sweep of split counts (design.md, "Decode: split-KV and the merge")."""
    if blocks >= sms:
        return 1
    most = max(1, max_seqlen_k // tile_keys)
    return max(1, min(sms // blocks, most, configs.MAX_DECODE_SPLITS))


def uses_warp_items(splits: int, items: int, sms: int, config: configs.DecodeConfig, keys_per_item: int,
                    max_tiles: int = DEFAULT.decode_warp_items_max_tiles) -> bool:
    """Whether a launch's warps take whole work items alone: with one split, when the items fill the warps of
    one block per SM in equal rounds with at most 1/32 of them idle (a block per item would walk several,
    merging and meeting at a barrier per item; a half-empty last round of warps would cost more than that), and
    items of at most ``max_tiles`` key tiles (KernelOptions.decode_warp_items_max_tiles)."""
    slots = sms * config.warps
    return (splits == 1 and _fills(_fewest_for_rounds(items, slots), slots)
            and -(-keys_per_item // config.block_n) <= max_tiles)


def _fewest_for_rounds(items: int, walkers: int) -> int:
    """The fewest walkers (blocks or warps) that take ``items`` in as few rounds as ``walkers`` of them do."""
    return -(-items // -(-items // walkers))


def _fills(used: int, walkers: int) -> bool:
    """Whether ``used`` of ``walkers`` leaves at most 1/32 of them idle."""
    return 32 * used >= 31 * walkers


def _opt_in_smem(config: configs.DecodeConfig, device: int) -> int:
    """The dynamic shared memory a decode kernel may be launched with: enough for blocks that walk several items
    where the device has it (not the 99 KB parts at the largest head dims)."""
    limit = build.device_attribute(device, "MaxSharedMemoryPerBlockOptin")
    return config.persistent_smem_bytes if config.persistent_smem_bytes <= limit else config.smem_bytes


def _attention_grid(function, config: configs.DecodeConfig, device: int, items: int, sms: int) -> tuple[int, int]:
    """(blocks, shared memory) of a decode launch over ``items`` work items on ``sms`` SMs: one block per item while
    they all fit on the GPU at once; beyond that, blocks that walk several items each, so that an SM never waits for
    one block to end before its next item's loads start (docs/design.md, "decode: blocks that walk items"). Where
    fewer blocks take the same number of rounds and leave at most 1/32 of the SMs idle, that many: the last round
    is then full (64 x 1k: 128 blocks of 4 items each, 0.4-0.6% faster than 132 blocks of 3 or 4; with fewer
    blocks each SM's own bytes in flight bound the rate)."""
    from cupy_backends.cuda.api import driver

    if config.warp_items:  # a block takes `warps` items at a time (one per warp), walking as below
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, config.threads, config.smem_bytes)
        resident = sms * max(1, per_sm)
        fewest = _fewest_for_rounds(-(-items // config.warps), resident)
        return (fewest if _fills(fewest, resident) else resident), config.smem_bytes
    resident = sms * driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, config.threads,
                                                                      config.smem_bytes)
    if items <= resident or _opt_in_smem(config, device) != config.persistent_smem_bytes:
        return items, config.smem_bytes
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, config.threads,
                                                              config.persistent_smem_bytes)
    walkers = min(items, sms * max(1, per_sm))
    fewest = _fewest_for_rounds(items, walkers)
    return (fewest if _fills(fewest, walkers) else walkers), config.persistent_smem_bytes


def _strides(prefix: str, array_strides, item: int) -> dict:
    """A (batch, row, head) triple of byte strides as the element-stride fields ``<prefix>_batch_stride``, ..."""
    b, r, h, _ = array_strides
    return {f"{prefix}_batch_stride": b // item, f"{prefix}_row_stride": r // item, f"{prefix}_head_stride": h // item}


def plan_decode(q_shape, strides, dtype: str, *, nheads_kv: int, cache_rows: int, capacity: int, page_size: int,
                max_pages: int, seqlen_new: int, max_seqlen_k: int, softmax_scale: float, causal: bool, arch: int,
                device: int, num_splits: int, item: int, config=None, extras: DecodeExtras = PLAIN,
                options: KernelOptions = DEFAULT, headdim_v: int | None = None) -> DecodePlan:
    """The launches of one flash_attn_with_kvcache call. ``strides`` maps q, k_cache, v_cache (and k, v when
    appending) to byte strides; ``page_size`` 0 means a contiguous cache; ``max_seqlen_k`` bounds the keys per row
    (for the split count); ``num_splits`` 0 chooses. ``extras``: the optional features; with them ``causal`` must
    already be folded into ``extras.window_right`` (0). ``options``: the kernel choices (the decode_* fields).
    ``headdim_v``: v_cache's head dim (the output's), None for q's; the kernel runs at the wider of the two."""
    batch, seqlen_q, nheads, headdim = q_shape
    headdim_v = headdim if headdim_v is None else headdim_v
    width = max(headdim, headdim_v)
    group = nheads // nheads_kv
    paged = page_size > 0
    use_extras = extras.attention
    # A window that is the causal mask runs the plain causal kernel; the Extras kernel folds causal into its window.
    causal = not use_extras and (causal or extras.masked)
    if extras.window_left != UNLIMITED_WINDOW:  # a row sees at most left + 1 + right keys: split only those
        max_seqlen_k = min(max_seqlen_k, extras.window_left + seqlen_q + min(extras.window_right, max_seqlen_k))
    row_blocks = -(-seqlen_q * group // 16)
    sms = build.sm_count(options.sm_count, device)
    splits, config = _splits_and_row(batch * nheads_kv * row_blocks, sms, max_seqlen_k, arch, width, num_splits,
                                     config, options)
    function = build.get_kernel("decode", config.name_expression(dtype, causal, paged, use_extras),
                                _opt_in_smem(config, device))
    workspace, arrivals, lse_offset, out_offset = _workspace_layout(splits, batch * nheads_kv * row_blocks,
                                                                    batch * seqlen_q * nheads, headdim_v)
    # With rotary, the attention reads the rotated copy of q, contiguous.
    q_strides = (seqlen_q * nheads * headdim * item, nheads * headdim * item, headdim * item, item) \
        if extras.rotary_dim else strides["q"]
    fields = {**_strides("k", strides["k_cache"], item), **_strides("v", strides["v_cache"], item)}
    if seqlen_new:
        fields.update(_strides("k_new", strides["k"], item), **_strides("v_new", strides["v"], item))
    for name, divisor in (("splits", splits), ("groups", nheads_kv * row_blocks), ("heads_kv", nheads_kv),
                          ("heads_per_kv", group), ("page_size", max(page_size, 1))):
        fields[f"{name}_magic"], fields[f"{name}_shift"] = fast_divisor(divisor)
    programmatic = options.decode_programmatic_launch
    if programmatic is None:
        programmatic = splits >= options.decode_programmatic_min_splits
    programmatic = arch >= 90 and programmatic  # (the kernel works out its first copies before waiting only then)
    kv_bytes = batch * max_seqlen_k * nheads_kv * (headdim + headdim_v) * item  # (at most: the longest row's keys)
    evict_first = options.decode_stream_evict_first
    if evict_first is None:
        evict_first = kv_bytes > build.device_attribute(device, "L2CacheSize")
    q_span = (seqlen_q if extras.rotary_advance else 1) if extras.rotary_dim else 0
    fixed = params.DecodeParams(
        **fields, alibi_batch_stride=extras.alibi_batch_stride, batch=batch, seqlen_q=seqlen_q, nheads=nheads,
        nheads_kv=nheads_kv, heads_per_kv=group, headdim=headdim, headdim_v=headdim_v, seqlen_new=seqlen_new,
        capacity=capacity,
        cache_rows=cache_rows, page_size=page_size, max_pages=max_pages, scale=softmax_scale,
        scale_log2=softmax_scale * _LOG2E, window_left=extras.window_left, window_right=extras.window_right,
        softcap=extras.softcap, rotary_dim=extras.rotary_dim, seqlen_ro=extras.seqlen_ro,
        rotary_interleaved=extras.rotary_interleaved, rotary_advance=extras.rotary_advance, q_span=q_span,
        num_splits=splits, programmatic=programmatic,
        stream_larger_than_l2=evict_first)  # (K/V that cannot stay in L2 stream through it under evict-first)
    grid, smem = _attention_grid(function, config, device, splits * batch * nheads_kv * row_blocks, sms)
    attention = build.Launch(function, (grid, 1, 1), (config.threads, 1, 1), smem,
                             fixed, ATTENTION_PER_CALL, programmatic)  # (copied: the launch's own)
    attention.params.set(**_strides("q", q_strides, item))
    append = _append_launch(q_shape, nheads_kv, dtype, paged, extras, seqlen_new, programmatic, fixed,
                            width) if seqlen_new else None
    rotary = _rotary_launch(q_shape, strides, dtype, item, extras, programmatic, fixed) if extras.rotary_dim else None
    rotary_span = max(seqlen_new, q_span) if extras.rotary_dim else 0
    return DecodePlan(attention, append, rotary, splits, workspace, arrivals, lse_offset, out_offset, capacity,
                      seqlen_new, rotary_span, extras.seqlen_ro, config)


def _splits_and_row(blocks: int, sms: int, max_seqlen_k: int, arch: int, headdim: int, num_splits: int, config,
                    options: KernelOptions) -> tuple:
    """(splits, the attention kernel's row) of a decode call of ``blocks`` blocks per split; ``config`` (tuning)
    overrides the row."""
    tile = config or configs.decode_config(arch, headdim)  # a row and its deep-ring twin share the tile shape
    splits = min(num_splits, configs.MAX_DECODE_SPLITS) or choose_num_splits(
        blocks, sms, max_seqlen_k, tile.warps * tile.block_n)
    if config is None:
        solo = options.decode_warp_items
        if solo is None:
            solo = uses_warp_items(splits, splits * blocks, sms, tile, max_seqlen_k,
                                   options.decode_warp_items_max_tiles)
        config = configs.decode_config(arch, headdim, keys_per_item=-(-max_seqlen_k // splits),
                                       deep=options.decode_deep_ring, warp_items=solo and splits == 1)
    if config.warp_items and splits != 1:
        raise ValueError(f"a warp-items decode config takes one split, not {splits}")
    return splits, config


def _workspace_layout(splits: int, arrivals: int, rows: int, headdim: int) -> tuple:
    """(floats, arrivals, partial lse offset, partial out offset) of the split-KV workspace (float32 units, each
    part 16-byte aligned): the rows' arrival counters, then each split's lse and output rows; all 0 for one
    split."""
    if splits == 1:
        return 0, 0, 0, 0
    lse_offset = -(-arrivals // 4) * 4
    out_offset = lse_offset + -(-splits * rows // 4) * 4
    return out_offset + splits * rows * headdim, arrivals, lse_offset, out_offset


def _append_launch(q_shape, nheads_kv: int, dtype: str, paged: bool, extras: DecodeExtras, seqlen_new: int,
                   programmatic: bool, fixed: params.DecodeParams, width: int) -> build.Launch:
    """The launch that writes the new keys and values into the cache (rotating the keys with rotary); ``width``:
    the wider of k's and v's head dims."""
    chunks = q_shape[0] * seqlen_new * nheads_kv * width // 8
    name = append_name_expression(paged, dtype if extras.append else None)
    return build.Launch(build.get_kernel("decode", name, 0), (max(1, min(-(-chunks // 1024), 64)), 1, 1),
                        (256, 1, 1), 0, fixed, APPEND_PER_CALL, programmatic)


def _rotary_launch(q_shape, strides: dict, dtype: str, item: int, extras: DecodeExtras, programmatic: bool,
                   fixed: params.DecodeParams) -> build.Launch:
    """The launch that rotates q into a contiguous temporary (q_rotated), reading q with its own strides."""
    batch, seqlen_q, nheads, headdim = q_shape
    chunks = batch * seqlen_q * nheads * headdim // 8
    launch = build.Launch(build.get_kernel("decode", rotary_name_expression(dtype), 0),
                          (max(1, min(-(-chunks // 256), 132)), 1, 1), (256, 1, 1), 0, fixed, ROTARY_PER_CALL,
                          programmatic)
    launch.params.set(**_strides("q", strides["q"], item))
    return launch


def append_name_expression(paged: bool, extras_dtype: str | None = None) -> str:
    """kvcache_append's instantiation: plain, or with the Extras (rotary keys, left-pad checks) for one dtype."""
    if extras_dtype is None:
        return f"fa2::kvcache_append<{str(bool(paged)).lower()}>"
    return f"fa2::kvcache_append<{str(bool(paged)).lower()}, true, {configs.DTYPE_TAGS[extras_dtype]}>"


def rotary_name_expression(dtype: str) -> str:
    return f"fa2::rotary_q<{configs.DTYPE_TAGS[dtype]}>"


#: The device pointers a decode launch takes, by name: flash_attn_with_kvcache's array arguments, then its
#: outputs. A launch reads every one: its ``pointers`` start from NO_POINTERS (0 where an array is absent).
POINTERS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx", "block_table", "rotary_cos",
            "rotary_sin", "cache_leftpad", "alibi_slopes", "out", "softmax_lse", "q_rotated")
NO_POINTERS = dict.fromkeys(POINTERS, 0)
# (what the attention launch reads, and what the append or the rotation add)
_attention_pointers = operator.itemgetter("q", "k_cache", "v_cache", "block_table", "cache_seqlens", "cache_batch_idx",
                                          "out", "softmax_lse", "alibi_slopes", "cache_leftpad")
_append_pointers = operator.itemgetter("k", "v", "rotary_cos", "rotary_sin")
#: The DecodeParams fields each launch takes per call, in the order run_decode passes them.
ATTENTION_PER_CALL = ("q", "k_cache", "v_cache", "block_table", "cache_seqlens", "cache_batch_idx", "out", "lse_out",
                      "alibi_slopes", "cache_leftpad", "partial_out", "partial_lse", "arrivals", "error_claim",
                      "error_host", "fixed_seqlen")
APPEND_PER_CALL = ("k_new", "v_new", "k_cache", "v_cache", "block_table", "cache_seqlens", "cache_batch_idx",
                   "rotary_cos", "rotary_sin", "cache_leftpad", "error_claim", "error_host", "fixed_seqlen")
ROTARY_PER_CALL = ("q", "q_rotated", "rotary_cos", "rotary_sin", "cache_seqlens", "error_claim", "error_host",
                   "fixed_seqlen")


def run_decode(plan: DecodePlan, pointers: dict, values: tuple, stream_ptr: int, framework: str, device: int) -> None:
    """Launches a plan on the stream ``stream_ptr``. ``pointers`` maps every name of :data:`POINTERS` to a device
    pointer: "q", "k_cache", "v_cache" and, 0 where not given, "k", "v", "cache_seqlens", "cache_batch_idx",
    "block_table", "rotary_cos", "rotary_sin", "cache_leftpad", "alibi_slopes"; the outputs "out", "softmax_lse" (0:
    not wanted) and, with rotary, "q_rotated" (a contiguous (batch, seqlen_q, nheads, d) buffer of q's dtype that
    receives the rotated q, which the attention then reads). ``values`` = (fixed_seqlen,): the int cache_seqlens,
    used where the cache_seqlens pointer is 0. The plan's workspace for this stream (:meth:`DecodePlan.workspace`)
    and the device's error report words (fa2cupy.device_errors) are looked up here, in ``framework``'s allocator on
    ``device``."""
    q, k_cache, v_cache, block_table, cache_seqlens, cache_batch_idx, out, lse, slopes, leftpad = (
        _attention_pointers(pointers))
    fixed_seqlen, = values
    claim, report = device_errors.pointers(device)
    workspace = plan.workspace(stream_ptr, framework, device)  # (zeroed on first use: before the append's launch)
    if plan.append is not None or plan.rotary is not None:
        k, v, cos, sin = _append_pointers(pointers)
        if plan.append is not None:
            plan.append(stream_ptr, (k, v, k_cache, v_cache, block_table, cache_seqlens, cache_batch_idx, cos, sin,
                                     leftpad, claim, report, fixed_seqlen))
        if plan.rotary is not None:
            q_rotated = pointers["q_rotated"]
            plan.rotary(stream_ptr, (q, q_rotated, cos, sin, cache_seqlens, claim, report, fixed_seqlen))
            q = q_rotated
    if workspace:
        partial_lse, partial_out = workspace + 4 * plan.partial_lse_offset, workspace + 4 * plan.partial_out_offset
    else:
        partial_lse = partial_out = 0
    plan.attention(stream_ptr, (q, k_cache, v_cache, block_table, cache_seqlens, cache_batch_idx, out, lse, slopes,
                                leftpad, partial_out, partial_lse, workspace, claim, report, fixed_seqlen))


def plan_merge(n: int, rows: int, headdim: int, parts_dtype: str, out_dtype: str) -> build.Launch:
    """The merge of ``n`` partial results of ``rows`` rows each: parts (n, rows, d) contiguous (fp16/bf16/fp32),
    lses (n, rows) float32 contiguous; out (rows, d) contiguous 16-bit, lse (rows,) float32. ``headdim`` (d) a
    multiple of 8; the rows' order is the caller's, the same in parts and lses (:func:`run_merge`)."""
    function = build.get_kernel("decode", merge_name_expression(parts_dtype, out_dtype), 0)
    return build.Launch(function, ((rows + 7) // 8, 1, 1), (256, 1, 1), 0,
                        params.MergeParams(n=n, rows=rows, headdim=headdim), ("parts", "lses", "out", "lse_out"))


def run_merge(plan: build.Launch, pointers: dict, values: tuple, stream_ptr: int, framework: str = "cupy",
              device: int = 0) -> None:
    """Launches a merge plan: ``pointers`` maps "parts", "lses", "out" and "lse_rows" to device pointers."""
    plan(stream_ptr, (pointers["parts"], pointers["lses"], pointers["out"], pointers["lse_rows"]))
