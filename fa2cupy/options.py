"""KernelOptions: every choice between kernels (and how they launch) that a call does not take from its arguments.

The defaults are what the tile table's measurements chose; the other values are for A/B timings, for tests that
must run one kernel where another would be picked, and for debugging. A KernelOptions is frozen and hashable,
passed to an entry point as ``kernel_options=`` (None: the defaults), and part of the key under which the entry
point remembers its plan: two calls that differ only in their options never share a plan.

Example::

    from fa2cupy import KernelOptions, flash_attn_func
    mma = KernelOptions(hopper_forward=False)  # the mma.sync forward even where the Hopper one would run
    out = flash_attn_func(q, k, v, causal=True, kernel_options=mma)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class KernelOptions:
    """Kernel choices of a call beyond its arguments (see the module docstring). Fields:

    hopper_forward (True): run the forward on the Hopper (wgmma, TMA) kernel where the tile table has a row for the
        call (compute capability 9.0, head dim 64, 128, 192 or 256; softcap, ALiBi and dropout at
        configs.HOPPER_MODS_HEADDIMS); False runs the mma.sync kernel there.
    hopper_backward (True): the same for the backward's dK/dV kernel (no score modifiers; deterministic or not).
    hopper_backward_mods (True): the Hopper dK/dV kernel for softcap, ALiBi and dropout too, at
        configs.hopper_bwd_takes_mods's head dims (its modifier rows: 2x the mma.sync backward at 64 and 128, 3.5-5.6x
        at 192 and 256, H200); False runs those calls on the mma.sync backward.
    hopper_unmasked_mods (True): padded calls without a mask that take softcap or ALiBi (and no dropout) run the
        Hopper forward's unmasked modifier kernel, which has no run-time window bounds (H200, d = 256, 8k: ALiBi 7%
        and softcap 2% faster; with dropout up to 7% slower at d = 192, so those keep the window kernel); False runs
        them in the window-mask modifier kernel.
    hopper_alibi_only (True): padded calls whose one modifier is ALiBi (no softcap, no dropout) run the Hopper
        kernels' ALiBi-only instantiations, the modifier kernels without the others' code: the forward's without a
        mask or causal at a positive scale (H200, 8k: 4-7% faster at d = 64 and 256, 3% at 128, level at 192), the
        dK/dV kernel's for every mask (5-6% faster at d = 128, 2-3% at 64, 192 and 256); False runs them in the
        modifier kernels.
    hopper_pad_headdim (None): on compute capability 9.0, run a head dim without a Hopper row (say 80, 96, 160) on
        the Hopper kernels at the next width up that has one, on the arrays as they are (True), or on the mma.sync
        kernels at its own width (False); None: from configs.HOPPER_PAD_MIN_HEADDIM on. Each call (forward,
        backward) goes wider only where the Hopper kernel at that width takes it.
    hopper_masked_min_seqlen (None): causal and windowed forwards take the Hopper kernel from this many query rows
        on (below it the mma.sync kernel is faster); None is the tile table's per-head-dim length
        (configs.HOPPER_MASKED_MIN_SEQLEN), an int that length for every head dim (0: always Hopper).
    tile_counter (True): the Hopper forward's persistent blocks take masked work items from a per-launch counter,
        longest first; False walks them with a fixed grid stride.
    hopper_l2_group_bytes (None): the Hopper forward hands out the work items of heads in groups whose K/V take at
        most this many bytes, so the heads in flight share L2; None is configs.HOPPER_L2_GROUP_BYTES.
    hopper_tail_waves (None): the last of those groups holds enough heads for this many work items per block, so
        that its longest items start early enough (configs.hopper_tail_heads); 0 keeps it an L2 group; None is
        the tile table row's (HopperFwdConfig.tail_waves) for causal calls, 0 for windows.
    hopper_bwd_chunk_blocks (None): the Hopper dK/dV grid launches in chunks of (kv head, batch) groups of at least
        this many blocks, key tile by key tile within a chunk (longest first under a causal mask); 0 launches each
        group's key tiles in turn; None is configs.HOPPER_BWD_CHUNK_BLOCKS for causal GQA calls, 0 for the rest.
    hopper_bwd_programmatic (True): the Hopper dK/dV kernel and the dQ conversion after it launch with programmatic
        stream serialization (sm_90), each starting while the kernel before it finishes: the dK/dV kernel loads K
        and V before it waits for the preprocess's D, the conversion only waits.
    hopper_bwd_early_convert (None): the Hopper dK/dV kernel counts the completed dQ additions of each query tile,
        and the conversion after it converts each tile once its count is complete, so that (launched
        programmatically) it runs in the dK/dV kernel's last wave instead of after it (True); False converts after
        the whole kernel; None: masked calls and long ones at head dims up to 128 (configs.hopper_bwd_early_converts;
        H200: 3-10% faster at 8k and causal, up to 7% slower at 2k and 4k without a mask, 10-17% slower at head dim
        192, docs/design.md).
    hopper_bwd_rotate (None): the Hopper dK/dV kernel's blocks of calls without a mask walk their query tiles from
        starts of their own (cuda/hopper/bwd_traits.cuh, rotated_start), so that at each step a group's blocks add
        to different dQ tiles: True in every such call, False in none, None as configs.hopper_bwd_rotates measured
        (calls without score modifiers, or at head dims 192 and 256). Deterministic calls, which take turns, rotate
        only where configs.hopper_bwd_rotates allows it, whatever this says.
    decode_deep_ring (None): force the decode kernel's deep-ring row (True) or the table's row (False) where a row
        has a deep-ring twin; None lets configs.decode_config choose by the work item's length.
    decode_warp_items (None): force warp items in decode (each warp streams whole work items alone; True, wherever
        there is one split and a twin row) or blocks that split items (False); None: decode.uses_warp_items.
    decode_warp_items_max_tiles (128): the longest work item, in key tiles, that warps stream alone: on longer ones
        the warps of a block drifting apart cost more than the per-item merge they save (H100: 64 x 1k -1.4%,
        64 x 4k level, 64 x 16k +0.7%).
    decode_programmatic_launch (None): force programmatic stream serialization of the decode kernels (True; sm_90
        and later) or plain launches (False); None: from decode_programmatic_min_splits splits on.
    decode_programmatic_min_splits (4): on sm_90 and later, decode calls with this many splits or more launch with
        programmatic stream serialization: a kernel's launch overlaps the end of the kernel before it (the last
        split's merge, where most SMs idle). H100: 1 x 16k -1.8% from a graph, -3.7% eager; 1 x 1k -7%; but
        8 x 1k (2 splits) +4-7%.
    decode_stream_evict_first (None): force K/V copies under an L2 evict-first policy (True) or under none (False);
        None: only for calls whose K/V bytes exceed the L2 size.
    sm_count (None): the SMs that persistent grids (the Hopper forward), split-KV decoding and the deterministic
        Hopper backward's rotated walks (configs.hopper_bwd_rotates) are sized for; None is the device's count.
        Tests pretend a small GPU with it, so that few blocks walk many work items.
    debug_poison (False): fill every output and gradient with NaN before the launch, so an element a kernel fails
        to write shows up as NaN instead of as whatever the allocator handed back (tests). Such calls take the
        checked path every time.
    """

    hopper_forward: bool = True
    hopper_backward: bool = True
    hopper_backward_mods: bool = True
    hopper_unmasked_mods: bool = True
    hopper_alibi_only: bool = True
    hopper_pad_headdim: bool | None = None
    hopper_masked_min_seqlen: int | None = None
    tile_counter: bool = True
    hopper_l2_group_bytes: int | None = None
    hopper_tail_waves: int | None = None
    hopper_bwd_chunk_blocks: int | None = None
    hopper_bwd_programmatic: bool = True
    hopper_bwd_early_convert: bool | None = None
    hopper_bwd_rotate: bool | None = None
    decode_deep_ring: bool | None = None
    decode_warp_items: bool | None = None
    decode_warp_items_max_tiles: int = 128
    decode_programmatic_launch: bool | None = None
    decode_programmatic_min_splits: int = 4
    decode_stream_evict_first: bool | None = None
    sm_count: int | None = None
    debug_poison: bool = False
    # The hash, computed once; and a token that equal options share (an object() hashed by identity in C), which
    # the plan cache's key holds: the key is hashed on every call.
    _hash: int = field(init=False, repr=False, compare=False)
    _token: object = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for f in fields(self):
            if not f.init:
                continue
            value, kind = getattr(self, f.name), _KINDS[f.name]
            if value is None and kind.startswith("optional"):
                continue
            allowed = ("True or False" if kind.endswith("bool") else "an int >= 0") + (
                " or None" if kind.startswith("optional") else "")
            if type(value) is not (bool if kind.endswith("bool") else int):
                raise TypeError(f"KernelOptions.{f.name} must be {allowed}, got {value!r}")
            if kind.endswith("int") and value < 0:
                raise ValueError(f"KernelOptions.{f.name} must be {allowed}, got {value!r}")
        values = tuple(getattr(self, f.name) for f in fields(self) if f.compare)
        object.__setattr__(self, "_hash", hash(values))
        object.__setattr__(self, "_token", _tokens.setdefault(values, object()))

    def __hash__(self) -> int:
        return self._hash


_tokens: dict = {}  # field values -> the token of KernelOptions with them

#: The type of each field's values, for the checks in KernelOptions.__post_init__.
_KINDS = {
    "hopper_forward": "bool", "hopper_backward": "bool", "hopper_backward_mods": "bool",
    "hopper_unmasked_mods": "bool", "hopper_alibi_only": "bool",
    "hopper_pad_headdim": "optional bool",
    "hopper_masked_min_seqlen": "optional int",
    "tile_counter": "bool", "hopper_l2_group_bytes": "optional int",
    "hopper_tail_waves": "optional int",
    "hopper_bwd_chunk_blocks": "optional int", "hopper_bwd_programmatic": "bool",
    "hopper_bwd_early_convert": "optional bool", "hopper_bwd_rotate": "optional bool",
    "decode_deep_ring": "optional bool",
    "decode_warp_items": "optional bool", "decode_warp_items_max_tiles": "int",
    "decode_programmatic_launch": "optional bool", "decode_programmatic_min_splits": "int",
    "decode_stream_evict_first": "optional bool", "sm_count": "optional int", "debug_poison": "bool",
}

#: The options of a call given ``kernel_options=None``.
DEFAULT = KernelOptions()


def resolve(kernel_options) -> KernelOptions:
    """``kernel_options`` as an entry point takes it: None means :data:`DEFAULT`; anything else must be a
    KernelOptions."""
    if kernel_options is None:
        return DEFAULT
    if not isinstance(kernel_options, KernelOptions):
        raise TypeError(f"kernel_options must be a fa2cupy.KernelOptions or None, got {type(kernel_options).__name__}")
    return kernel_options


# Interned options by small int, for the torch custom ops, whose arguments cannot be Python objects: an op takes
# the int and its body looks the options up. Handle 0 is DEFAULT.
_interned: list[KernelOptions] = [DEFAULT]
_handles: dict[KernelOptions, int] = {DEFAULT: 0}


def handle(kernel_options) -> int:
    """A small int that stands for ``kernel_options`` (None: the defaults, 0) in this process."""
    kernel_options = resolve(kernel_options)
    found = _handles.get(kernel_options)
    if found is None:
        found = _handles[kernel_options] = len(_interned)
        _interned.append(kernel_options)
    return found


def from_handle(number: int) -> KernelOptions:
    """The KernelOptions that :func:`handle` gave ``number`` for."""
    return _interned[number]
