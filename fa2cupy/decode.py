"""Decode kernel family (cuda/decode.cu): split-KV decoding with GQA packing over contiguous or paged caches, and
the (out, lse) merge (public as merge_attention_states). A plan depends on shapes, strides and options only; the
interface caches it, so a decode step costs a dictionary look-up and one to three launches (append, rotary q,
attention)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import arrays, build, configs
from .forward import fast_divisor

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


#: A window side without a limit, as the kernels take it (kUnlimitedWindow in cuda/attention/masks.cuh).
UNLIMITED_WINDOW = 1 << 30


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


PLAIN = DecodeExtras()


@dataclass(frozen=True)
class DecodePlan:
    """Everything a call needs but its pointers and its int cache_seqlens: built once per metadata, cached."""

    attention: build.Launch  # variable slots: the 13 pointers, fixed_seqlen, alibi_slopes, cache_leftpad
    append: build.Launch | None  # None without new keys; variable slots: the 9 pointers, fixed_seqlen, then
    # rotary_cos, rotary_sin, cache_leftpad
    rotary: build.Launch | None  # rotates q into a temporary; variable slots: the 7 pointers, then fixed_seqlen
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
            array, pointer = arrays.new_empty_raw((self.workspace_floats,), "float32", framework, device)
            build.memset_async(pointer, 0, self.arrivals * 4, stream_ptr)
            found = self.workspaces[stream_ptr] = (array, pointer)
        return found[1]


def _sm_count(device: int) -> int:
    return build.device_attribute(device, "MultiProcessorCount")


def choose_num_splits(blocks: int, sms: int, max_seqlen_k: int, tile_keys: int) -> int:
    """Splits per (batch row, kv head, row block): enough that the ``blocks`` x splits cover the GPU's ``sms``
    once (floor: a second, partial wave would cost a whole wave), and each split keeps at least one key tile
    per warp (``tile_keys`` = warps x keys per tile). One block per SM, not full residency: measured on the
    H100, one 4-warp block keeps enough loads in flight to saturate an SM's share of HBM, and more splits only
    add partial results to merge; this rule picked the fastest split count (or within 5% of it) at every point
    of bench/results/tune_decode_splits_h100_20261123-0625.log."""
    if blocks >= sms:
        return 1
    most = max(1, max_seqlen_k // tile_keys)
    return max(1, min(sms // blocks, most, configs.MAX_DECODE_SPLITS))


#: Force the deep-ring row (True) or the table's row (False) where a row has a deep-ring twin, instead of the
#: rule in configs.decode_config (A/B timings and tests flip it).
DEEP_RING: bool | None = None
#: Force warp items on (True, wherever there is one split and a warp-items twin) or off (False), instead of
#: :func:`uses_warp_items`.
WARP_ITEMS: bool | None = None
#: Force programmatic launches of the decode kernels (True; sm_90 and later) or plain ones (False), instead of
#: :data:`PROGRAMMATIC_MIN_SPLITS` (A/B timings).
PROGRAMMATIC_LAUNCH: bool | None = None
#: Force K/V copies under an L2 evict-first policy (True) or under none (False: evict-unchanged), instead of only for
#: calls whose K/V bytes exceed the L2 size (tests and A/B timings).
STREAM_EVICT_FIRST: bool | None = None
#: On sm_90 and later, calls with this many splits or more launch their kernels with programmatic stream
#: serialization: a kernel's launch overlaps the end of the kernel before it in the stream (the last split
#: block's merge of the call before, where most SMs idle), and it waits for that kernel before reading memory.
#: H100, bench/NOTES.md: 1 x 16k -1.8% from a graph, -3.7% eager; 1 x 1k -7%; but 8 x 1k (2 splits) +4-7%.
PROGRAMMATIC_MIN_SPLITS = 4


#: Longest work item (in key tiles) that warps stream alone: on longer ones the warps of a block drifting apart
#: cost more than the per-item merge they save (H100, bench/NOTES.md: 64 x 1k -1.4%, 64 x 4k level, 64 x 16k +0.7%).
WARP_ITEMS_MAX_TILES = 128


def uses_warp_items(splits: int, items: int, sms: int, config: configs.DecodeConfig, keys_per_item: int) -> bool:
    """Whether a launch's warps take whole work items alone: with one split, when the items fill the warps of
    one block per SM in equal rounds with at most 1/32 of them idle (a block per item would walk several,
    merging and meeting at a barrier per item; a half-empty last round of warps would cost more than that), and
    items of at most WARP_ITEMS_MAX_TILES key tiles."""
    slots = sms * config.warps
    return (splits == 1 and _fills(_fewest_for_rounds(items, slots), slots)
            and -(-keys_per_item // config.block_n) <= WARP_ITEMS_MAX_TILES)


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


def _attention_grid(function, config: configs.DecodeConfig, device: int, items: int) -> tuple[int, int]:
    """(blocks, shared memory) of a decode launch over ``items`` work items: one block per item while they all
    fit on the GPU at once; beyond that, blocks that walk several items each, so that an SM never waits for one
    block to end before its next item's loads start (bench/NOTES.md, "decode: blocks that walk items"). Where
    fewer blocks take the same number of rounds and leave at most 1/32 of the SMs idle, that many: the last round
    is then full (64 x 1k: 128 blocks of 4 items each, 0.4-0.6% faster than 132 blocks of 3 or 4; with fewer
    blocks each SM's own bytes in flight bound the rate)."""
    from cupy_backends.cuda.api import driver

    sms = _sm_count(device)
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


def _strides(array_strides, item):
    b, r, h, _ = array_strides
    return (np.int64(b // item), np.int32(r // item), np.int64(h // item))


def plan_decode(q_shape, strides, dtype: str, *, nheads_kv: int, cache_rows: int, capacity: int, page_size: int,
                max_pages: int, seqlen_new: int, max_seqlen_k: int, softmax_scale: float, causal: bool, arch: int,
                device: int, num_splits: int, item: int, config=None, extras: DecodeExtras = PLAIN) -> DecodePlan:
    """The launches of one flash_attn_with_kvcache call. ``strides`` maps q, k_cache, v_cache (and k, v when
    appending) to byte strides; ``page_size`` 0 means a contiguous cache; ``max_seqlen_k`` bounds the keys per row
    (for the split count); ``num_splits`` 0 chooses. ``extras``: the optional features; with them ``causal`` must
    already be folded into ``extras.window_right`` (0)."""
    batch, seqlen_q, nheads, headdim = q_shape
    group = nheads // nheads_kv
    paged = page_size > 0
    use_extras = extras.attention
    if extras.masked and not use_extras:  # the window is the causal mask: the plain causal kernel
        causal = True
    if use_extras:
        causal = False
    if extras.window_left != UNLIMITED_WINDOW:  # a row sees at most left + 1 + right keys: split only those
        max_seqlen_k = min(max_seqlen_k, extras.window_left + seqlen_q + min(extras.window_right, max_seqlen_k))
    row_blocks = -(-seqlen_q * group // 16)
    blocks = batch * nheads_kv * row_blocks
    tile = config or configs.decode_config(arch, headdim)  # a row and its deep-ring twin share the tile shape
    splits = min(num_splits, configs.MAX_DECODE_SPLITS) or choose_num_splits(
        blocks, _sm_count(device), max_seqlen_k, tile.warps * tile.block_n)
    items = splits * blocks
    if config is None:
        solo = (uses_warp_items(splits, items, _sm_count(device), tile, max_seqlen_k) if WARP_ITEMS is None
                else WARP_ITEMS)
        config = configs.decode_config(arch, headdim, keys_per_item=-(-max_seqlen_k // splits), deep=DEEP_RING,
                                       warp_items=solo and splits == 1)
    if config.warp_items and splits != 1:
        raise ValueError(f"a warp-items decode config takes one split, not {splits}")
    name = config.name_expression(dtype, causal, paged, use_extras)
    function = build.get_kernel("decode", name, _opt_in_smem(config, device))
    rows = batch * seqlen_q * nheads
    if splits > 1:
        arrivals = batch * nheads_kv * row_blocks
        lse_offset = -(-arrivals // 4) * 4
        out_offset = lse_offset + -(-splits * rows // 4) * 4
        workspace = out_offset + splits * rows * headdim
    else:
        arrivals = lse_offset = out_offset = workspace = 0
    pointer = np.uint64(0)  # placeholder of a per-call pointer slot
    # With rotary, the attention reads the rotated copy of q, contiguous.
    q_strides = (seqlen_q * nheads * headdim * item, nheads * headdim * item, headdim * item, item) \
        if extras.rotary_dim else strides["q"]
    args = (pointer,) * 13 + _strides(q_strides, item) + _strides(strides["k_cache"], item) \
        + _strides(strides["v_cache"], item)
    args += (np.int32(batch), np.int32(seqlen_q), np.int32(nheads), np.int32(group), np.int32(headdim))
    seqlen_slot = len(args)
    index = (np.int32(0), np.int32(seqlen_new), np.int32(capacity), np.int32(cache_rows), np.int32(page_size),
             np.int32(max_pages))  # fixed_seqlen (per call), then the rest
    args += index + (np.float32(softmax_scale), np.float32(softmax_scale * _LOG2E))
    extra_slot = len(args)  # alibi_slopes, then cache_leftpad two slots later (per-call pointers)
    args += (pointer, np.int64(extras.alibi_batch_stride), pointer, np.int32(extras.window_left),
             np.int32(extras.window_right), np.float32(extras.softcap))
    args += (np.int32(splits),)
    for divisor in (splits, nheads_kv * row_blocks, nheads_kv, group, max(page_size, 1)):  # the FastDiv divisors
        magic, shift = fast_divisor(divisor)
        args += (np.uint32(magic), np.int32(shift))
    programmatic = arch >= 90 and (splits >= PROGRAMMATIC_MIN_SPLITS if PROGRAMMATIC_LAUNCH is None
                                   else PROGRAMMATIC_LAUNCH)
    args += (np.int32(programmatic),)  # (the kernel works out its first copies before waiting only then)
    kv_bytes = 2 * batch * max_seqlen_k * nheads_kv * headdim * item  # (at most: the longest row's keys per row)
    evict_first = (kv_bytes > build.device_attribute(device, "L2CacheSize") if STREAM_EVICT_FIRST is None
                   else STREAM_EVICT_FIRST)
    args += (np.int32(evict_first),)  # (K/V that cannot stay in L2 stream through it under evict-first)
    grid, smem = _attention_grid(function, config, device, items)
    attention = build.Launch(function, (grid, 1, 1), (config.threads, 1, 1), smem, args,
                             tuple(range(13)) + (seqlen_slot, extra_slot, extra_slot + 2), programmatic)
    q_span = (seqlen_q if extras.rotary_advance else 1) if extras.rotary_dim else 0
    rotary_args = (np.int32(extras.rotary_dim), np.int32(extras.seqlen_ro), np.int32(extras.rotary_interleaved))
    append = None
    if seqlen_new:
        chunks = batch * seqlen_new * nheads_kv * headdim // 8
        args = (pointer,) * 9
        for name in ("k", "v", "k_cache", "v_cache"):
            args += _strides(strides[name], item)
        args += (np.int32(batch), np.int32(nheads_kv), np.int32(headdim))
        seqlen_slot = len(args)
        args += index
        extra_slot = len(args)
        args += (pointer,) * 3 + rotary_args + (np.int32(q_span),)
        append_name = append_name_expression(paged, dtype if extras.append else None)
        append = build.Launch(build.get_kernel("decode", append_name, 0),
                              (max(1, min(-(-chunks // 1024), 64)), 1, 1), (256, 1, 1), 0, args,
                              tuple(range(9)) + (seqlen_slot, extra_slot, extra_slot + 1, extra_slot + 2),
                              programmatic)
    rotary = None
    if extras.rotary_dim:
        chunks = batch * seqlen_q * nheads * headdim // 8
        args = (pointer,) * 7 + _strides(strides["q"], item)
        args += (np.int32(batch), np.int32(seqlen_q), np.int32(nheads), np.int32(headdim))
        seqlen_slot = len(args)
        args += (np.int32(0), np.int32(seqlen_new), np.int32(capacity)) + rotary_args
        args += (np.int32(extras.rotary_advance),)
        rotary = build.Launch(build.get_kernel("decode", rotary_name_expression(dtype), 0),
                              (max(1, min(-(-chunks // 256), 132)), 1, 1), (256, 1, 1), 0, args,
                              tuple(range(7)) + (seqlen_slot,), programmatic)
    rotary_span = max(seqlen_new, q_span) if extras.rotary_dim else 0
    return DecodePlan(attention, append, rotary, splits, workspace, arrivals, lse_offset, out_offset, capacity,
                      seqlen_new, rotary_span, extras.seqlen_ro, config)


def append_name_expression(paged: bool, extras_dtype: str | None = None) -> str:
    """kvcache_append's instantiation: plain, or with the Extras (rotary keys, left-pad checks) for one dtype."""
    if extras_dtype is None:
        return f"fa2::kvcache_append<{str(bool(paged)).lower()}>"
    return f"fa2::kvcache_append<{str(bool(paged)).lower()}, true, {configs.DTYPE_TAGS[extras_dtype]}>"


def rotary_name_expression(dtype: str) -> str:
    return f"fa2::rotary_q<{configs.DTYPE_TAGS[dtype]}>"


#: The per-call device pointers run_decode takes, in order (0 for an absent one).
INPUTS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx", "block_table", "rotary_cos",
          "rotary_sin", "cache_leftpad", "alibi_slopes")


def run_decode(plan: DecodePlan, inputs, out: int, lse: int, fixed_seqlen: int, stream_ptr: int, workspace: int,
               errors: tuple, q_rotated: int = 0) -> None:
    """Launches a plan on the stream ``stream_ptr``. ``inputs``: device pointers in :data:`INPUTS` order (the first
    8 are enough without extras); ``out``/``lse`` (lse 0: not wanted); ``fixed_seqlen`` the int cache_seqlens
    (used when the cache_seqlens pointer is 0); ``workspace`` from :meth:`DecodePlan.workspace`; ``errors`` the
    (claim, report) pointers of fa2cupy.device_errors; ``q_rotated``: with rotary, a (batch, seqlen_q, nheads, d)
    contiguous buffer of q's dtype that receives the rotated q, which the attention then reads."""
    if len(inputs) < 12:
        inputs = tuple(inputs) + (0,) * (12 - len(inputs))
    q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, cos, sin, leftpad, slopes = inputs
    claim, report = errors
    if plan.append is not None:
        plan.append(stream_ptr, (k, v, k_cache, v_cache, block_table, cache_seqlens, cache_batch_idx, claim, report,
                                 fixed_seqlen, cos, sin, leftpad))
    if plan.rotary is not None:
        plan.rotary(stream_ptr, (q, q_rotated, cos, sin, cache_seqlens, claim, report, fixed_seqlen))
        q = q_rotated
    if workspace:
        partial_lse, partial_out = workspace + 4 * plan.partial_lse_offset, workspace + 4 * plan.partial_out_offset
    else:
        partial_lse = partial_out = 0
    plan.attention(stream_ptr, (q, k_cache, v_cache, block_table, cache_seqlens, cache_batch_idx, out, lse,
                                partial_out, partial_lse, workspace, claim, report, fixed_seqlen, slopes, leftpad))


def launch_merge(parts, lses, out, lse_out, stream) -> None:
    """parts: (n, rows, d) contiguous CuPy array (fp16/bf16/fp32), lses: (n, rows) float32 contiguous; out: (rows, d)
    contiguous 16-bit, lse_out: (rows,) float32. ``d`` a multiple of 8. Rows order is the caller's, the same in
    parts and lses."""
    n, rows, headdim = parts.shape
    function = build.get_kernel("decode", merge_name_expression(parts.dtype.name, out.dtype.name), 0)
    args = (parts, lses, out, lse_out, np.int32(n), np.int64(rows), np.int32(headdim))
    function(((rows + 7) // 8, 1, 1), (256, 1, 1), args, shared_mem=0, stream=stream)
