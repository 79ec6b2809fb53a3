"""The tile table: the one place that chooses tile sizes, warps and pipeline stages for every kernel.

Each entry becomes C++ template arguments of a traits type in ``cuda/``; every entry listed here is a
"shipped instantiation" that CI compiles for sm_80 and sm_90 with NVRTC. Nothing else in the package picks tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .options import DEFAULT, KernelOptions

#: Tile widths (template head dims). A head dim d (padded to a multiple of 8) runs on the smallest width >= d;
#: the kernel zero-fills the columns between d and the width.
HEADDIMS = (32, 64, 96, 128, 160, 192, 224, 256)

#: Element type tags of the kernels, by canonical dtype name.
DTYPE_TAGS = {"float16": "fa2::f16", "bfloat16": "fa2::bf16"}

#: Attention masks (MaskKind in cuda/attention/masks.cuh), each its own kernel instantiation so that a kernel pays only
#: for its own mask: none, causal (bounds folded in at compile time), window (sliding window, bounds at run time).
MASKS = ("none", "causal", "window")
MASK_TAGS = {"none": "fa2::kMaskNone", "causal": "fa2::kMaskCausal", "window": "fa2::kMaskWindow"}

#: Kernel variants shipped per table row: (mask, score modifiers). Softcap and ALiBi (ScoreMods, attention/masks.cuh)
#: are switched on at run time inside one extra variant built on the window mask (which also expresses "none" and
#: "causal" with unlimited sides), so the plain kernels stay as they were and each row costs one more kernel, not
#: one per combination.
VARIANTS = (("none", False), ("causal", False), ("window", False), ("window", True))
#: The forward's variants: those, and for padded calls a causal modifier variant too (compile-time causal bounds).
#: Training with dropout runs causal forwards in the modifier variant, where the window mask's run-time bounds cost
#: 5% at d=64 on an H200 (docs/design.md, dropout).
FORWARD_VARIANTS = VARIANTS + (("causal", True),)

#: Arch families with their own table rows, told apart by shared memory per block: sm80 (A100, 163 KB),
#: sm86 (RTX 30/40, L4, consumer Blackwell: 99 KB) and sm90 (H100/H200, B200: 227 KB).
ARCH_FAMILIES = ("sm80", "sm86", "sm90")

@dataclass(frozen=True)
class FwdConfig:
    """Template arguments of ``fa2::FwdTraits`` (cuda/fwd.cu), minus the element type and causal flag."""

    headdim: int  # tile width in elements
    block_m: int  # query rows per thread block
    block_n: int  # keys per K/V tile
    warps: int  # warps per block; each owns block_m / warps rows
    stages: int  # K/V shared-memory ring depth
    min_blocks: int  # __launch_bounds__ minimum resident blocks per SM (caps registers)
    q_in_regs: bool  # keep Q's mma fragments in registers instead of re-reading shared memory

    family = "fwd"  # cuda/fwd.cu

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def smem_bytes(self) -> int:
        # Must match FwdTraits::kSmemBytes: padded rows of (headdim + 8) 16-bit elements.
        return (self.block_m + 2 * self.stages * self.block_n) * (self.headdim + 8) * 2

    def name_expression(self, dtype: str, mask: str, mods: bool = False, varlen: bool = False,
                        paged: bool = False) -> str:
        if paged and not varlen:
            raise ValueError("paged K/V comes with varlen")
        tail = f", {str(bool(mods)).lower()}, true" if varlen else (", true" if mods else "")
        tail += ", true" if paged else ""
        return (
            f"fa2::flash_fwd<fa2::FwdTraits<{self.headdim}, {self.block_m}, {self.block_n}, {self.warps}, "
            f"{self.stages}, {self.min_blocks}, {str(self.q_in_regs).lower()}, {DTYPE_TAGS[dtype]}, "
            f"{MASK_TAGS[mask]}{tail}>>"
        )


@dataclass(frozen=True)
class HopperFwdConfig:
    """Template arguments of ``fa2::HopperFwdTraits`` (cuda/hopper/fwd.cu, sm_90a only): wgmma, a producer
    warpgroup and consumer warpgroups of 64 rows each, persistent blocks; a work item is 64 query rows per
    consumer warpgroup."""

    headdim: int  # exactly the head dim (64 or 128; 192 or 256 in the wide table): no zero-filled columns
    block_n: int  # keys per K/V tile
    k_stages: int  # K ring depth (a slot goes back once S has landed)
    v_stages: int  # V ring depth (a slot goes back after P V, a step later than K's)
    q_buffers: int  # 2: the next work item's Q loads during this one
    consumer_wgs: int = 2  # 2 or 3 (three fit the registers at d=64, and at 192 with v at 128)
    v_dim: int | None = None  # HopperFwdTraits' HeadDimV where v is narrower (FORWARD_HOPPER_V_TABLE), else None
    tail_waves: int = 2  # causal calls' last group of work items holds this many per block (hopper_tail_heads)

    family = "fwd_hopper"  # cuda/hopper/fwd.cu

    @property
    def headdim_v(self) -> int:
        """The head dim of the kernel's V tiles, P V and output: v_dim, else the row's."""
        return self.v_dim or self.headdim

    @property
    def block_m(self) -> int:
        return 64 * self.consumer_wgs

    @property
    def threads(self) -> int:
        return 128 * (self.consumer_wgs + 1)  # and a producer warpgroup

    @property
    def smem_bytes(self) -> int:
        # Must match HopperFwdTraits::kSmemBytes: alignment slack, the Q buffers, the K/V ring, the mbarriers,
        # the work-item words (7 a Q buffer, 2 to hand out the next item).
        tiles = self.k_stages * self.headdim + self.v_stages * self.headdim_v
        return 1024 + self.q_buffers * self.block_m * self.headdim * 2 + tiles * self.block_n * 2 + (
            8 * (2 * self.k_stages + self.v_stages + 2 * self.q_buffers) + 4 * (7 * self.q_buffers + 2))

    def name_expression(self, dtype: str, mask: str, mods: bool = False, varlen: bool = False,
                        paged: bool = False, alibi_only: bool = False) -> str:
        """``mods``: softcap, ALiBi and dropout (HopperFwdTraits::kMods); ``alibi_only``: the modifier kernel with
        ALiBi's code alone (kAlibiOnly: padded, no window)."""
        if paged and not varlen:
            raise ValueError("paged K/V comes with varlen")
        if alibi_only and not (mods and not varlen and mask != "window"):
            raise ValueError("the ALiBi-only kernel is a padded modifier kernel without a window")
        if self.v_dim is not None:
            if mods or paged or self.v_dim not in forward_hopper_v_dims(self.headdim):
                raise ValueError(f"the Hopper forward's {self.headdim} row has v head dims "
                                 f"{forward_hopper_v_dims(self.headdim)} of its own, without modifiers, not paged; "
                                 f"got {self.v_dim}")
            flags = f"{DTYPE_TAGS[dtype]}, {MASK_TAGS[mask]}, {str(varlen).lower()}, false, false, false, {self.v_dim}"
        elif mods:
            flags = f"{DTYPE_TAGS[dtype]}, {MASK_TAGS[mask]}, {str(varlen).lower()}, {str(paged).lower()}, true"
            flags += ", true" if alibi_only else ""
        else:
            flags = f"{DTYPE_TAGS[dtype]}, {MASK_TAGS[mask]}{', true' if varlen else ''}{', true' if paged else ''}"
        return (f"fa2::flash_fwd_hopper<fa2::HopperFwdTraits<{self.headdim}, {self.block_n}, {self.k_stages}, "
                f"{self.v_stages}, {self.q_buffers}, {self.consumer_wgs}, {flags}>>")


#: The Hopper forward, by head dim: used on compute capability 9.0 for padded and varlen calls (paged K/V too),
#: with softcap, ALiBi and dropout at HOPPER_MODS_HEADDIMS (every other case runs FORWARD_TABLE's mma.sync
#: kernels). At d=64 a tile's products
#: take half as long as at d=128 and its softmax as long, so three consumer warpgroups (192-row items) take turns:
#: 12-14% faster than two at 2k-16k (H100, same process; docs/design.md); d=128 has no registers for a third.
#: The wide head dims, 192 and 256, take two consumer warpgroups (O takes d / 2 registers a thread: 96 or 128 of
#: the 224) on 64-key tiles (S and P take 32 + 16; 128-key tiles of d = 192 would not fit 227 KB with two K and two V
#: slots beside one Q buffer). d = 192: two Q buffers, K 2, V 3 (217 KB); d = 256: one Q buffer (64 KB: two would
#: leave too little for the rings), K 2, V 3 (225 KB). On an H200 they run 2.4-2.9x the mma.sync forward's
#: TFLOPs/s (docs/design.md).
FORWARD_HOPPER_TABLE: dict[int, HopperFwdConfig] = {
    64: HopperFwdConfig(64, 128, 4, 4, 2, 3),
    128: HopperFwdConfig(128, 128, 2, 3, 2),
    192: HopperFwdConfig(192, 64, 2, 3, 2),
    256: HopperFwdConfig(256, 64, 2, 3, 1),
}
#: The Hopper forward's modifier rows (softcap, ALiBi, dropout) where they differ from FORWARD_HOPPER_TABLE's: at
#: d = 64 two consumer warpgroups (224 registers a thread), as the three of the plain row (160) spill 152-168 bytes
#: with the modifiers.
FORWARD_HOPPER_MODS_TABLE: dict[int, HopperFwdConfig] = {
    64: HopperFwdConfig(64, 128, 4, 4, 2, 2),
}


#: v head dims narrower than q's that a Hopper forward row has kernels for without modifiers, padded and varlen (not
#: paged): (row, v head dim) -> the config, HopperFwdTraits' HeadDimV: V's tiles, P V and O at v's width. DeepSeek-
#: V2/V3's prefill, q and k at 192 and v at 128. With O at 64 of a thread's registers rather than 96, three consumer
#: warpgroups take turns (192-row items, 152 registers each, the producer 56) on one Q buffer (72 KB) with K 3 and V 4
#: slots (208 KB). H200, bf16, 16k tokens, in turns, 2k and 8k, causal and not, as a share of the square call's
#: TFLOPs/s (counted at each product's width): 0.89-0.94, against 0.82-0.87 for the 192 row's own kernel reading v
#: at 128 columns and 0.81-0.90 for HeadDimV on the row's two warpgroups (P V at N = 128 alone did not shorten the
#: 64-key step: docs/design.md). The varlen window kernel keeps the row's two warpgroups and Q buffers
#: (hopper_fwd_v_config). Its causal calls' last group of work items holds 4 per block, where the square rows
#: gain most at 2 (hopper_tail_heads: 192 / 128 at 8k causal 589 -> 616 TFLOPs/s from 2 to 4, the 192 row
#: 686 -> 647).
FORWARD_HOPPER_V_TABLE: dict[tuple[int, int], HopperFwdConfig] = {
    (192, 128): HopperFwdConfig(192, 64, 3, 4, 1, 3, v_dim=128, tail_waves=4),
}


def forward_hopper_v_dims(width: int) -> tuple[int, ...]:
    """The narrower v head dims the Hopper forward's ``width`` row has kernels for (FORWARD_HOPPER_V_TABLE)."""
    return tuple(sorted(v for (row, v) in FORWARD_HOPPER_V_TABLE if row == width))


def hopper_fwd_v_config(config: HopperFwdConfig, headdim_v: int, mods: bool, paged: bool, mask: str = "none",
                        varlen: bool = False) -> HopperFwdConfig:
    """The Hopper forward's config for a call on the row ``config`` whose v (and output) is ``headdim_v`` wide: the
    FORWARD_HOPPER_V_TABLE kernel of the smallest v head dim that holds it, on calls without modifiers (``mods``:
    softcap, ALiBi or dropout) nor paged K/V, else ``config`` itself. Varlen window calls take that v head dim on
    the row's own tiles (their kernel's consumers spill 12 bytes at three warpgroups' 152 registers)."""
    if mods or paged or config.v_dim is not None:
        return config
    v_dim = min((d for d in forward_hopper_v_dims(config.headdim) if d >= headdim_v), default=None)
    if v_dim is None:
        return config
    if varlen and mask == "window":
        return replace(config, v_dim=v_dim)
    return FORWARD_HOPPER_V_TABLE[(config.headdim, v_dim)]


def hopper_forward_row(headdim: int, mods: bool = False) -> HopperFwdConfig:
    """The Hopper forward's row at this head dim (a key of FORWARD_HOPPER_TABLE), for calls with score modifiers or
    dropout (``mods``: FORWARD_HOPPER_MODS_TABLE's where it has one) or without."""
    row = FORWARD_HOPPER_TABLE[headdim]
    return FORWARD_HOPPER_MODS_TABLE.get(headdim, row) if mods else row


def _fwd(headdim, block_m, block_n, warps, stages=2, min_blocks=1, q_in_regs=False) -> FwdConfig:
    return FwdConfig(headdim, block_m, block_n, warps, stages, min_blocks, q_in_regs)


# (arch family, tile head dim) -> config. Starting points are FA2's own choices (shared/FACTS.md), adjusted
# so that no entry spills registers (docs/design.md has the ptxas figures and the H100 measurements).
FORWARD_TABLE: dict[tuple[str, int], FwdConfig] = {
    ("sm80", 32): _fwd(32, 128, 128, 4, min_blocks=2),
    ("sm80", 64): _fwd(64, 128, 64, 4, min_blocks=2),
    ("sm80", 96): _fwd(96, 128, 32, 4, min_blocks=2),
    ("sm80", 128): _fwd(128, 128, 32, 4, min_blocks=2),
    ("sm80", 160): _fwd(160, 128, 64, 8),
    ("sm80", 192): _fwd(192, 128, 64, 8),
    ("sm80", 224): _fwd(224, 64, 32, 4),
    ("sm80", 256): _fwd(256, 64, 32, 4),
    ("sm86", 32): _fwd(32, 128, 128, 4, min_blocks=2),
    ("sm86", 64): _fwd(64, 128, 64, 4, min_blocks=2),
    ("sm86", 96): _fwd(96, 128, 32, 4, min_blocks=2),
    ("sm86", 128): _fwd(128, 128, 32, 4, min_blocks=2),
    ("sm86", 160): _fwd(160, 64, 32, 4),
    ("sm86", 192): _fwd(192, 64, 32, 4),
    ("sm86", 224): _fwd(224, 64, 32, 4),
    ("sm86", 256): _fwd(256, 64, 32, 4),
    ("sm90", 32): _fwd(32, 128, 128, 4, min_blocks=2),
    ("sm90", 64): _fwd(64, 128, 128, 4, min_blocks=2),
    ("sm90", 96): _fwd(96, 128, 32, 4, min_blocks=2),
    ("sm90", 128): _fwd(128, 128, 32, 4, min_blocks=2),
    ("sm90", 160): _fwd(160, 128, 64, 8),
    ("sm90", 192): _fwd(192, 128, 64, 8),
    ("sm90", 224): _fwd(224, 128, 64, 8),
    ("sm90", 256): _fwd(256, 64, 64, 4),
}

#: Rows that differ from FORWARD_TABLE's for the window mask without score modifiers and for varlen with a causal
#: mask: run-time window bounds, or the sequence's own lengths, cost registers; the d=64 H100 row (128x128 at the
#: 255-register cap) spilled 20-24 bytes with them, 128x96 has none. The modifier variant keeps FORWARD_TABLE's row:
#: it fits 128x128 without spills, and there dropout (p=0.1, d=64, 8k and 32k, H200) ran at 0.80-0.88x of the
#: plain call against 0.75-0.83x on 128x96.
FORWARD_MASKED_TABLE: dict[tuple[str, int], FwdConfig] = {
    ("sm90", 64): _fwd(64, 128, 96, 4, min_blocks=2),
}


@dataclass(frozen=True)
class BwdConfig:
    """Template arguments of ``fa2::BwdTraits`` (cuda/bwd.cu), minus element type, causal and AtomicDq."""

    headdim: int
    block_m: int  # query rows per step of the walk over query tiles
    block_n: int  # keys per thread block (K_j, V_j resident in shared memory)
    warps: int
    warps_keys: int  # phase 1 (S^T, dP^T): warps along the keys; the others split the queries
    stages: int  # Q/dO ring depth (1 or 2)
    dslices: int  # head-dim slices of dK/dV/dQ per key tile (each slice is its own block)
    warps_keys2: int  # phase 2 (dK, dV): warps along the keys; the others split the head dim

    family = "bwd"  # cuda/bwd.cu

    @property
    def threads(self) -> int:
        return self.warps * 32

    @staticmethod
    def dq_pitch(headdim: int) -> int:
        """Floats per row of the fp32 dQ accumulator for a call of this (padded) head dim: bwd_dkdv adds whole
        rows of it."""
        return headdim

    def smem_bytes(self, atomic_dq: bool = True, mods: bool = False) -> int:
        # Must match BwdTraits::kSmemBytes: K, V, the Q/dO ring, P^T and dS^T, the row statistics and (atomic
        # dQ) each warp's dQ scratch, whose shape follows BwdTraits' dQ warp tiling (the modifier variant's alike).
        pitch = (self.headdim + 8) * 2
        base = (
            2 * self.block_n * pitch
            + 2 * self.stages * self.block_m * pitch
            + 2 * self.block_n * (self.block_m + 8) * 2
            + 2 * self.stages * self.block_m * 4
        )
        if not atomic_dq:
            return base
        slice_d = self.headdim // self.dslices
        units = slice_d // 16
        two_tiles = self.block_m % 32 == 0 and self.warps % (self.block_m // 32) == 0 and (
            self.warps // (self.block_m // 32) <= units)
        m_tiles = 2 if two_tiles else 1
        col_warps = self.warps // (self.block_m // (16 * m_tiles))
        units_per_warp = -(-units // col_warps)
        return base + self.warps * 16 * (units_per_warp * 16 + 4) * 4

    def name_expression(self, dtype: str, mask: str, atomic_dq: bool, mods: bool = False, varlen: bool = False) -> str:
        tail = f", {str(bool(mods)).lower()}, true" if varlen else (", true" if mods else "")
        return (
            f"fa2::bwd_dkdv<fa2::BwdTraits<{self.headdim}, {self.block_m}, {self.block_n}, {self.warps}, "
            f"{self.warps_keys}, {self.warps_keys2}, {self.stages}, {self.dslices}, {DTYPE_TAGS[dtype]}, "
            f"{MASK_TAGS[mask]}, {str(bool(atomic_dq)).lower()}{tail}>>"
        )


@dataclass(frozen=True)
class HopperBwdConfig:
    """Template arguments of ``fa2::HopperBwdTraits`` (cuda/hopper/bwd.cu, sm_90a only): the dK/dV kernel on wgmma,
    a producer warpgroup and two consumer warpgroups of 64 keys; 128 keys per block, ``block_m`` query rows per step,
    dQ added to the fp32 accumulator (deterministic=True: the key tiles that add to a query tile's dQ take turns, a
    run-time switch); padded and varlen. At the wide head dims (192, 256) 64 keys per block, which both consumer
    warpgroups work on (one computes dV, the other dK)."""

    headdim: int  # exactly the head dim (64, 128, 192, 256)
    block_m: int  # query rows per step: 64, or 128 with dq_by_keys
    stages: int  # Q/dO ring depth
    dq_by_keys: bool  # dQ_i split between the warpgroups by keys (each all columns) instead of by columns

    dslices = 1
    threads = 3 * 128
    family = "bwd_hopper"  # cuda/hopper/bwd.cu

    @property
    def wide(self) -> bool:
        """HopperBwdTraits::kWide: 64-key blocks, the warpgroups split by role (cuda/hopper/bwd_consumer_wide.cuh)."""
        return self.headdim > 128

    @property
    def block_n(self) -> int:
        return 64 if self.wide else 128

    @staticmethod
    def dq_pitch(headdim: int) -> int:
        """Floats per row of the dQ staging tile and of the fp32 accumulator (HopperBwdTraits::kDqPitch): padded
        against bank conflicts in shared memory, and alike in the accumulator so that one bulk reduction adds a
        step's rows; 8 floats, so that every row starts on a 32-byte sector (d = 64 and 192 7% faster than with 4,
        256 4%, 128 2-3%)."""
        return headdim + 8

    def dq_by_map(self, headdim: int, varlen: bool = False, mods: bool = False) -> bool:
        """Whether a call of this (arrays') head dim adds whole query tiles' dQ through a map of the accumulator's
        first ``headdim`` columns (BwdHopperParams.dq_by_map, tmap_dq): calls narrower than the row, whose staged
        columns past their head dim are zeros (at the row's width the map's reductions ran 0-2% slower than whole
        rows'), where the kernel has that path (HopperBwdTraits::kDqReduceByMap): a box has at most 256 columns, so
        not at 256, and not in the varlen modifier row at 64 (16 bytes spilled with it)."""
        return (headdim < self.headdim and self.dq_pitch(self.headdim) <= 256
                and not (varlen and mods and self.dq_by_keys))

    @property
    def turn_planes(self) -> int:
        """Must match HopperBwdTraits::kTurnPlanes: the deterministic turn flags' planes (each an int per batch
        row, head and query tile): two at the wide head dims, whose kernels add each half of a step's dQ rows on
        turns of its own (calls with dropout use only the first), else one; padded or varlen, with modifiers or
        not."""
        return 2 if self.wide else 1

    def smem_bytes(self, atomic_dq: bool = True, mods: bool = False, alibi_only: bool = False) -> int:
        # Must match HopperBwdTraits::kSmemBytes: alignment slack, K and V, the Q/dO ring, the dS^T tiles (two by
        # columns, one by keys), the fp32 dQ staging rows (one tile by columns, a pair by keys), the row statistics,
        # with ``mods`` (not by keys, not ``alibi_only``) dropout's keep flags (per slot block_m / 16 bytes for each
        # thread that forms P^T: 256, or 128 at the wide head dims) and 32 bytes per producer thread, the mbarriers
        # (kv_full, two per slot, two per staging tile: dq_staged and dq_free) and the producer's 8 bytes (the two
        # steps not yet counted).
        # Wide: one dS^T tile and the fp32 P^T hand-over (block_m x block_n floats) before the statistics.
        d, m, n = self.headdim, self.block_m, self.block_n
        ds_tiles, dq_tiles = (1, 2) if self.dq_by_keys else (1, 1) if self.wide else (2, 1)
        p_bytes = m * n * 4 if self.wide else 0
        dropout = mods and not self.dq_by_keys and not alibi_only  # (HopperBwdTraits::kDropout)
        drop_bytes = self.stages * (128 if self.wide else 256) * (m // 16) + 32 * 128 if dropout else 0
        return (1024 + 2 * n * d * 2 + 2 * self.stages * m * d * 2 + ds_tiles * n * m * 2
                + dq_tiles * m * self.dq_pitch(d) * 4 + p_bytes + 2 * self.stages * m * 4 + drop_bytes
                + 8 * (1 + 2 * self.stages + 2 * dq_tiles) + 8)

    def name_expression(self, dtype: str, mask: str, atomic_dq: bool = True, mods: bool = False,
                        varlen: bool = False, score_dim: int | None = None, alibi_only: bool = False,
                        v_dim: int | None = None) -> str:
        """``score_dim``: HopperBwdTraits' ScoreDim, the head dim of the score products (hopper_bwd_score_dim);
        None or the row's own head dim for the row's. ``alibi_only``: the modifier kernel with ALiBi's code alone
        (HopperBwdTraits' AlibiOnly: padded calls). ``v_dim``: HopperBwdTraits' VDim, v's narrower head dim
        (hopper_bwd_v_dim); None or the row's own for the row's."""
        narrow_v = v_dim not in (None, self.headdim)
        if narrow_v and (mods or score_dim not in (None, self.headdim)
                         or v_dim not in HOPPER_BWD_V_DIMS.get(self.headdim, ())):
            raise ValueError(f"the Hopper backward's {self.headdim} row has v head dims "
                             f"{HOPPER_BWD_V_DIMS.get(self.headdim, ())} of its own, without modifiers, at the row's "
                             f"score products; got {v_dim}")
        if alibi_only and (not mods or varlen or score_dim not in (None, self.headdim)):
            raise ValueError("the Hopper backward's ALiBi-only kernel is a padded modifier kernel at the row's "
                             "head dim")
        if mods and (not hopper_bwd_takes_mods(self.headdim, varlen) or mask != "window"):
            raise ValueError(f"the Hopper backward takes softcap and ALiBi at head dims {HOPPER_BWD_MODS_HEADDIMS} "
                             f"(varlen: not {HOPPER_BWD_MODS_PADDED_ONLY}), in the window-mask variant")
        trimmed = score_dim not in (None, self.headdim)
        if trimmed and (mods or score_dim not in hopper_bwd_score_dims(self.headdim, mask, varlen)):
            raise ValueError(f"the Hopper backward's {self.headdim} row has score products over "
                             f"{hopper_bwd_score_dims(self.headdim, mask, varlen)} too, without modifiers; got "
                             f"{score_dim}")
        if narrow_v:
            tail = f", {str(varlen).lower()}, false, {self.headdim}, false, {v_dim}"
        elif trimmed:
            tail = f", {str(varlen).lower()}, false, {score_dim}"
        elif alibi_only:
            tail = f", false, true, {self.headdim}, true"
        else:
            tail = (f", {str(varlen).lower()}, true" if mods else ", true" if varlen else "")
        return (f"fa2::bwd_dkdv_hopper<fa2::HopperBwdTraits<{self.headdim}, {self.block_m}, {self.stages}, "
                f"{str(self.dq_by_keys).lower()}, {DTYPE_TAGS[dtype]}, {MASK_TAGS[mask]}{tail}>>")


#: The Hopper backward's dK/dV kernel, by head dim: used on compute capability 9.0 for padded and varlen calls
#: deterministic or not, with softcap, ALiBi and dropout at HOPPER_BWD_MODS_HEADDIMS; every other case runs
#: BACKWARD_TABLE's mma.sync kernels.
#: Head dim 64 takes 128 query rows per step (the per-step waits and hand-offs over twice the work) and splits dQ_i
#: by keys (by columns each warpgroup's 32 would be half a swizzled slab), the two partial sums added in shared
#: memory before the one reduction per row (docs/design.md). The wide head dims, 192 and 256, take 64 keys per
#: block (each warpgroup holds one of dK and dV, 64 x d: d / 2 registers a thread), 64 query rows a step, dQ_i by
#: columns: d = 192 with a 2-slot ring (219 KB); d = 256 with one slot (218.5 KB: a second, 64 KB of Q and dO, does
#: not fit beside K, V (64 KB) and the fp32 dQ staging tile (65 KB)). On an H200 they run 3.0-5.3x the mma.sync
#: backward's TFLOPs/s (docs/design.md).
BACKWARD_HOPPER_TABLE: dict[int, HopperBwdConfig] = {
    64: HopperBwdConfig(64, 128, 2, True),
    128: HopperBwdConfig(128, 64, 2, False),
    192: HopperBwdConfig(192, 64, 2, False),
    256: HopperBwdConfig(256, 64, 1, False),
}

#: The narrower head dims each Hopper backward row also has instantiations for (HopperBwdTraits' ScoreDim, without
#: modifiers): a call whose arrays are narrower than the row (configs.padded_call_width) has zeros in every tile
#: column past its head dim, and those instantiations leave the zero columns' k16 steps out of S^T = K Q^T and
#: dP^T = V dO^T (the products whose k is the head dim; dK, dV and dQ_i keep the row's width). The head dims of
#: Stable Diffusion (80, 160) and Phi-3 (96); docs/design.md has what they gain.
HOPPER_BWD_SCORE_DIMS: dict[int, tuple[int, ...]] = {64: (), 128: (80, 96), 192: (160,), 256: ()}


#: v head dims narrower than q's that a wide Hopper backward row has instantiations for without modifiers, padded
#: and varlen (HopperBwdTraits' VDim: dP^T = V dO^T over v's columns and dV += P^T dO at N = VDim, at the row's
#: score products): DeepSeek-V2/V3's prefill, q and k at 192 and v at 128. docs/design.md has what it gains.
HOPPER_BWD_V_DIMS: dict[int, tuple[int, ...]] = {192: (128,)}


def hopper_bwd_v_dim(headdim_v: int, width: int, score_dim: int, mods: bool) -> int:
    """v's head dim on the Hopper backward's ``width`` row for a call whose v is ``headdim_v`` wide (padded or
    varlen): the smallest of HOPPER_BWD_V_DIMS that holds it on calls without modifiers whose score products are the
    row's, else the row's own."""
    if mods or score_dim != width:
        return width
    return min((d for d in HOPPER_BWD_V_DIMS.get(width, ()) if d >= headdim_v), default=width)


def hopper_bwd_score_dims(width: int, mask: str, varlen: bool) -> tuple[int, ...]:
    """The narrower score products the ``width`` row's kernel for this mask and layout has: HOPPER_BWD_SCORE_DIMS's,
    but none for the varlen window kernel at 128, which spilled 12 bytes with them."""
    return () if (width, mask, varlen) == (128, "window", True) else HOPPER_BWD_SCORE_DIMS.get(width, ())


def hopper_bwd_score_dim(headdim: int, width: int, mods: bool = False, mask: str = "none",
                         varlen: bool = False) -> int:
    """The score products' head dim for a call of head dim ``headdim`` on the Hopper backward's ``width`` row: the
    smallest of hopper_bwd_score_dims that holds it, else the row's own (so always with modifiers, whose rows have no
    such instantiations)."""
    fits = [d for d in hopper_bwd_score_dims(width, mask, varlen) if d >= headdim] if not mods else []
    return min(fits, default=width)


#: Head dims at which the Hopper dK/dV kernel has softcap/ALiBi/dropout instantiations (HopperBwdTraits' Mods, the
#: window variant); padded calls only at HOPPER_BWD_MODS_PADDED_ONLY (head dim 128's row needs 240 consumer
#: registers, at which the varlen producer, copying ragged tiles by cp.async, spills). Dropout's keep flags are drawn
#: by the producer warpgroup; at the wide head dims only warpgroup 0 applies the modifiers and the flags
#: (hopper/bwd_consumer_wide.cuh). KernelOptions(hopper_backward_mods=False) runs these calls on the mma.sync backward
#: instead (H200, 16k tokens: the rows at 64 and 128 are 1.9-2.2x faster with softcap, 2.0-2.2x
#: with ALiBi).
HOPPER_BWD_MODS_HEADDIMS = (64, 128, 192, 256)
HOPPER_BWD_MODS_PADDED_ONLY = (128,)


#: Head dims whose Hopper modifier rows take softcap and ALiBi but not dropout (HopperBwdTraits::kDropout: at 64,
#: 128 query rows a step, the consumers had no registers for dropout's keep flags); dropout there runs on the
#: mma.sync backward.
HOPPER_BWD_NO_DROPOUT = (64,)


def hopper_bwd_takes_mods(headdim: int, varlen: bool, dropout: bool = False) -> bool:
    """Whether the Hopper dK/dV kernel has modifier rows for this head dim, padded or varlen, that take softcap and
    ALiBi, and with ``dropout`` dropout too."""
    if dropout and headdim in HOPPER_BWD_NO_DROPOUT:
        return False
    return headdim in HOPPER_BWD_MODS_HEADDIMS and not (varlen and headdim in HOPPER_BWD_MODS_PADDED_ONLY)


def hopper_backward_config(arch: int, headdim: int, mods: bool, dropout: bool = False,
                           with_mods: bool = False, varlen: bool = False) -> HopperBwdConfig | None:
    """The Hopper backward's row for this call, or None where the mma.sync backward runs it (padded or varlen, either
    mode): head dims 64, 128, 192 and 256 without score modifiers; softcap, ALiBi and dropout (``mods``; ``dropout``
    counts as one) where hopper_bwd_takes_mods and ``with_mods`` (KernelOptions.hopper_backward_mods)."""
    mods = mods or dropout
    if arch != 90 or (mods and not (with_mods and hopper_bwd_takes_mods(headdim, varlen, dropout))):
        return None
    return BACKWARD_HOPPER_TABLE.get(headdim)


def hopper_backward_instantiations() -> list[str]:
    """Name expressions of every Hopper backward instantiation (compiled for sm_90a): the modifier kernels' padded
    ALiBi-only ones too (backward.plan_backward)."""
    plain = [config.name_expression(dtype, mask, varlen=varlen, score_dim=score_dim)
             for config in BACKWARD_HOPPER_TABLE.values()
             for dtype in DTYPE_TAGS for mask in MASKS for varlen in (False, True)
             for score_dim in (config.headdim, *hopper_bwd_score_dims(config.headdim, mask, varlen))]
    narrow_v = [config.name_expression(dtype, mask, varlen=varlen, v_dim=v_dim)
                for config in BACKWARD_HOPPER_TABLE.values() for v_dim in HOPPER_BWD_V_DIMS.get(config.headdim, ())
                for dtype in DTYPE_TAGS for mask in MASKS for varlen in (False, True)]
    mods = [BACKWARD_HOPPER_TABLE[d].name_expression(dtype, "window", mods=True, varlen=varlen,
                                                     alibi_only=alibi_only)
            for d in HOPPER_BWD_MODS_HEADDIMS for dtype in DTYPE_TAGS
            for varlen, alibi_only in ((False, False), (True, False), (False, True))
            if hopper_bwd_takes_mods(d, varlen)]
    return sorted(plain + narrow_v + mods)


@dataclass(frozen=True)
class BwdDqConfig:
    """Template arguments of ``fa2::BwdDqTraits``: the deterministic dQ kernel (warps own query rows)."""

    headdim: int
    block_m: int
    block_n: int
    warps: int

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def smem_bytes(self) -> int:
        return (2 * self.block_m + 4 * self.block_n) * (self.headdim + 8) * 2

    def name_expression(self, dtype: str, mask: str, mods: bool = False) -> str:
        return (
            f"fa2::bwd_dq<fa2::BwdDqTraits<{self.headdim}, {self.block_m}, {self.block_n}, {self.warps}, "
            f"{DTYPE_TAGS[dtype]}, {MASK_TAGS[mask]}{', true' if mods else ''}>>"
        )


def _bwd(headdim, block_m, block_n, warps, warps_keys, stages=2, dslices=1, warps_keys2=None) -> BwdConfig:
    return BwdConfig(headdim, block_m, block_n, warps, warps_keys, stages, dslices, warps_keys2 or warps_keys)


# Backward main kernel: each warp holds 32 (or 16) keys of dK and dV in registers over a span of the head dim;
# head dims above 128 split the columns into slices. Every row is spill-free (tests/test_compile.py).
_BWD_SM90 = {  # 227 KB of shared memory per block
    32: _bwd(32, 128, 128, 8, 4),
    64: _bwd(64, 128, 128, 8, 4),
    96: _bwd(96, 64, 128, 8, 4),
    128: _bwd(128, 64, 128, 8, 4),
    160: _bwd(160, 32, 64, 4, 4, dslices=2),  # one head-dim slice spills 4-16 B with the varlen bounds
    192: _bwd(192, 32, 64, 4, 2, dslices=2),
    224: _bwd(224, 32, 64, 4, 4, dslices=2),
    256: _bwd(256, 32, 64, 4, 2, dslices=2),
}
_BWD_SM80 = {  # 163 KB
    **_BWD_SM90,
    64: _bwd(64, 64, 128, 8, 4),
    128: _bwd(128, 64, 128, 8, 4, stages=1),
}
_BWD_SM86 = {  # 99 KB
    32: _bwd(32, 64, 128, 8, 4),
    64: _bwd(64, 64, 64, 4, 2),
    96: _bwd(96, 32, 64, 4, 2),
    128: _bwd(128, 32, 64, 4, 2, stages=1),
    160: _bwd(160, 32, 64, 4, 4, stages=1, dslices=2),
    192: _bwd(192, 32, 64, 4, 2, stages=1, dslices=2),
    224: _bwd(224, 16, 32, 2, 2, stages=1, dslices=2),
    256: _bwd(256, 16, 32, 2, 2, stages=1, dslices=2),
}
BACKWARD_TABLE: dict[tuple[str, int], BwdConfig] = {
    **{("sm80", d): c for d, c in _BWD_SM80.items()},
    **{("sm86", d): c for d, c in _BWD_SM86.items()},
    **{("sm90", d): c for d, c in _BWD_SM90.items()},
}

#: Masked (causal or window) rows that differ from BACKWARD_TABLE's (the mask costs a few registers: the d=64 H100 row would
#: spill 4 bytes with it).
BACKWARD_CAUSAL_TABLE: dict[tuple[str, int], BwdConfig] = {
    ("sm90", 64): _bwd(64, 128, 128, 8, 2, warps_keys2=4),
}

_DQ_BIG = {d: BwdDqConfig(d, 64, 64 if d <= 128 else 32, 4) for d in HEADDIMS}
_DQ_SMALL = {d: BwdDqConfig(d, 64, 32, 4) if d <= 128 else BwdDqConfig(d, 32, 16, 2) for d in HEADDIMS}
#: The deterministic dQ kernel (deterministic=True): one block per query tile, no atomics.
BACKWARD_DQ_TABLE: dict[tuple[str, int], BwdDqConfig] = {
    **{("sm80", d): c for d, c in _DQ_BIG.items()},
    **{("sm86", d): c for d, c in _DQ_SMALL.items()},
    **{("sm90", d): c for d, c in _DQ_BIG.items()},
}


#: Most key splits per row in decode (the fp32 partials' workspace grows with it); a larger num_splits is clamped.
MAX_DECODE_SPLITS = 256


@dataclass(frozen=True)
class DecodeConfig:
    """Template arguments of ``fa2::DecodeTraits`` (cuda/decode.cu): 16 packed query rows per block, ``warps`` warps
    each streaming its own key tiles through a ``stages``-deep cp.async ring."""

    headdim: int
    block_n: int  # keys per K/V tile
    stages: int  # K/V ring depth per warp
    warps: int = 4
    l2_prefetch: bool = False  # cp.async with the L2::256B prefetch hint for K/V
    deep_ring: bool = False  # `stages` tiles in flight while a warp waits (refilled after the math), not stages - 1
    warp_items: bool = False  # each warp streams whole work items alone (one split; no block merge)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def _smem_parts(self) -> tuple[int, int, int]:
        # Must match DecodeTraits (cuda/decode.cu): two Q tiles in rows padded by 16 bytes (per warp with warp
        # items), the warps' K/V rings (swizzled unpadded rows where the head dim is a multiple of 64), and the
        # block's merge area (none with warp items): every warp's fp32 rows (pitch headdim + 8) and lse.
        pitch = self.headdim + 8
        kv_pitch = self.headdim if self.headdim % 64 == 0 else pitch
        q = (self.warps if self.warp_items else 1) * 2 * 16 * pitch * 2
        rings = self.warps * 2 * self.stages * self.block_n * kv_pitch * 2
        merge = 0 if self.warp_items else self.warps * 16 * (self.headdim + 8 + 1) * 4
        return q, rings, merge

    @property
    def smem_bytes(self) -> int:
        """Shared memory of a block with one work item (it merges in its rings' memory): kSmemBytes."""
        q, rings, merge = self._smem_parts()
        return q + max(rings, merge)

    @property
    def persistent_smem_bytes(self) -> int:
        """Shared memory of a block that walks several items (the merge area after the rings, which hold the next
        item's first tiles while the block merges): kPersistentSmemBytes."""
        q, rings, merge = self._smem_parts()
        return q + rings + merge

    def name_expression(self, dtype: str, causal: bool, paged: bool, extras: bool = False) -> str:
        """decode_attention's instantiation; ``extras`` (window, softcap, ALiBi, cache_leftpad), ``deep_ring`` and
        ``warp_items`` are DecodeTraits' defaulted last arguments, written only when needed (causal is folded into
        the extras' window)."""
        flags = (bool(extras), self.deep_ring, self.warp_items)
        last = max((i for i, flag in enumerate(flags) if flag), default=-1)
        tail = "".join(f", {str(flag).lower()}" for flag in flags[:last + 1])
        return (
            f"fa2::decode_attention<fa2::DecodeTraits<{self.headdim}, {self.block_n}, {self.stages}, {self.warps}, "
            f"{str(self.l2_prefetch).lower()}, {DTYPE_TAGS[dtype]}, {str(bool(causal) and not extras).lower()}, "
            f"{str(bool(paged)).lower()}{tail}>>"
        )


# Decode is memory-bound: what matters is bytes in flight per SM (warps x ring depth x tile) against the smem
# that buys them. H100 (bench/dev/tune_decode.py, docs/design.md): 4 warps x 2 stages x 32-key tiles with the L2
# 256-byte prefetch hint was the best or within 1% of it at every measured point; the hint alone is worth 2%.
# (4 warps x 5 stages x 16-key tiles: 1% faster at 64x1k, 1.6-5% slower at 8x64k and 8x1k.)
_DEC = {d: DecodeConfig(d, 32, 2, 4, True) if d <= 128 else DecodeConfig(d, 16, 2, 2, True) for d in HEADDIMS}
_DEC_SM86 = {d: DecodeConfig(d, 16, 3, 2, True) if d <= 128 else DecodeConfig(d, 16, 2, 2, True) for d in HEADDIMS}
DECODE_TABLE: dict[tuple[str, int], DecodeConfig] = {
    **{("sm80", d): c for d, c in _DEC.items()},
    **{("sm86", d): c for d, c in _DEC_SM86.items()},
    **{("sm90", d): c for d, c in _DEC.items()},
}
#: The same rows with the deep ring, for short streams: work items of DEEP_RING_TILES key tiles per warp. H100
#: (bench/dev/decode_ab.py, docs/design.md): 2-8% faster at 1x4k, 8x1k, 1x16k, 8x4k, 64x1k, where the rounds that every
#: block starts together are most of the stream; 0.2-1.7% slower on long streams (1x64k, 8x64k, 64x16k) and on
#: single-tile ones (1x1k). Measured at d=128 only, so only that row has one.
DECODE_DEEP_TABLE: dict[tuple[str, int], DecodeConfig] = {
    ("sm90", 128): replace(_DEC[128], deep_ring=True),
}
DEEP_RING_TILES = range(2, 17)
#: The same rows with warp items (each warp streams whole work items alone, writing its rows itself: no block
#: merge, no block barrier), for one split over items that fill the GPU's warps (decode.uses_warp_items). H100
#: (docs/design.md): 64x1k -1.1..-1.8%, 128x2k and 256x1k -1.2%, 64x4k level, 64x16k +0.7% (so not used there).
DECODE_WARP_TABLE: dict[tuple[str, int], DecodeConfig] = {
    ("sm90", 128): replace(_DEC[128], warp_items=True),
}


def arch_family(arch: int) -> str:
    """Compute capability as an int (80, 86, 89, 90, ...) -> table family."""
    if arch < 80:
        raise RuntimeError(
            f"fa2cupy needs a GPU of compute capability 8.0 or newer (mma.sync bf16, cp.async); this one is "
            f"{arch // 10}.{arch % 10}"
        )
    if arch in (86, 89) or arch >= 120:
        return "sm86"
    return "sm90" if arch >= 90 else "sm80"


def tile_headdim(headdim: int) -> int:
    """Smallest tile width that holds ``headdim`` (1..256)."""
    for width in HEADDIMS:
        if headdim <= width:
            return width
    raise ValueError(f"headdim must be at most {HEADDIMS[-1]}, got {headdim}")


def _uses_masked_row(mask: str, varlen: bool, mods: bool = False) -> bool:
    return (mask == "window" and not mods) or (mask == "causal" and varlen)


def forward_config(arch: int, headdim: int, dtype: str, mask: str, varlen: bool = False,
                   mods: bool = False) -> FwdConfig:
    """The forward tile configuration for a GPU arch (e.g. 90), head dim, dtype, mask (one of MASKS), varlen-ness
    and score modifiers (the modifier variant). dtype is part of the key so that a tuned table may split on it;
    today its rows are shared.
    """
    if dtype not in DTYPE_TAGS:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_TAGS)}, got {dtype}")
    key = (arch_family(arch), tile_headdim(headdim))
    if _uses_masked_row(mask, varlen, mods) and key in FORWARD_MASKED_TABLE:
        return FORWARD_MASKED_TABLE[key]
    return FORWARD_TABLE[key]


#: Causal and windowed calls run on the Hopper forward from this many query rows on (seqlen_q, or max_seqlen_q with
#: varlen; KernelOptions.hopper_masked_min_seqlen replaces it, e.g. 0 for the Hopper kernel at every length). Below
#: it, items of a few key tiles each leave its pipeline mostly filling and draining. H100 bf16 causal, hidden 2048,
#: Hopper / mma.sync kernel time in one process, with three consumer warpgroups at d=64: d=64 256 1.11x (mma.sync
#: kept), 512 0.86x, 1024 1.00x; d=128 128 0.93x, 256 0.94x, 512 1.01x; windows d=64 (256, 0) over 512 0.79x,
#: d=128 (128, 0) over 256 0.96x (docs/design.md).
#: The head dims at which the Hopper forward takes softcap, ALiBi and dropout (HopperFwdTraits' Mods, on
#: hopper_forward_row(d, mods=True)); elsewhere they run on the mma.sync forward. At HOPPER_MODS_PADDED_ONLY, padded
#: calls only: the d = 256 consumers need 232 registers with the modifiers (at 224 the window variant spills 40
#: bytes), which leaves the producer 40, where the varlen producer's copies spill.
HOPPER_MODS_HEADDIMS = (64, 128, 192, 256)
HOPPER_MODS_PADDED_ONLY = (256,)


def hopper_takes_mods(headdim: int, varlen: bool) -> bool:
    """Whether the Hopper forward takes softcap, ALiBi and dropout at this head dim, for a padded or a varlen call."""
    return headdim in HOPPER_MODS_HEADDIMS and not (varlen and headdim in HOPPER_MODS_PADDED_ONLY)

HOPPER_MASKED_MIN_SEQLEN = {64: 512, 128: 128, 192: 128, 256: 128}  # (192, 256: d = 128's, not measured)

#: The Hopper forward's persistent blocks take the work items of heads in groups whose K/V take at most this many
#: bytes, longest first within a group, so that the heads in flight at any time share L2 (50 MB on the H100).
HOPPER_L2_GROUP_BYTES = 16 << 20


def hopper_heads_per_group(seqlen_k: int, headdim: int, heads_per_kv: int, heads: int,
                           group_bytes: int | None = None) -> int:
    """(batch row, head) pairs per group of the Hopper forward's work items (see HOPPER_L2_GROUP_BYTES, or
    ``group_bytes``): whole kv heads' worth of query heads, at least one kv head, at most ``heads`` (batch x
    nheads)."""
    kv_bytes = 2 * seqlen_k * headdim * 2  # K and V of one kv head, 16-bit
    group_bytes = HOPPER_L2_GROUP_BYTES if group_bytes is None else group_bytes
    return min(heads, max(1, group_bytes // max(kv_bytes, 1)) * heads_per_kv)


def hopper_tail_heads(m_blocks: int, heads: int, heads_per_group: int, sms: int, waves: int) -> int:
    """(batch row, head) pairs of the Hopper forward's last group of masked work items: at least ``waves`` items
    per block of the ``sms``-block grid (``m_blocks`` items a pair; HopperFwdConfig.tail_waves, or
    KernelOptions.hopper_tail_waves), and whole ``heads_per_group`` groups before it; at most ``heads``.

    Taken longest first, a group's longest item (every key tile of a head under a causal mask) starts as the counter
    enters the group; in the last group nothing comes after it, so the grid ends when it does. With one L2 group's
    heads (the wide head dims' hold one or two at 8k, 86-128 items on 132 SMs) the other blocks finish the rest of
    the group long before: docs/design.md, "The last group of work items"."""
    natural = heads - heads_per_group * ((heads - 1) // heads_per_group)  # (the last of the L2 groups)
    want = -(-waves * sms // m_blocks)
    if want <= natural:
        return natural
    return min(heads, natural + -(-(want - natural) // heads_per_group) * heads_per_group)


#: A causal GQA call's Hopper dK/dV blocks launch in chunks of whole (kv head, batch) groups of at least this many
#: blocks (about a wave on 132 SMs), key tile by key tile within a chunk (cuda/hopper/bwd.cu), so that the longest
#: blocks of a chunk start first and short ones fill the tail. H200, bf16, causal, 16k tokens, against one group
#: a chunk: GQA 32/8 d = 64 +10% at seqlen 2k and 8k, GQA 16/4 d = 128 8k +19%; chunks of 264 or 528 blocks gained
#: less at 8k (-6% to +8%), and whole-grid chunks lost 4-34% without GQA (the heads in flight no longer share L2).
#: Without GQA (blocks a quarter as long) and without a causal mask (blocks of one length) one group a chunk.
HOPPER_BWD_CHUNK_BLOCKS = 128


def hopper_bwd_group_chunk(key_tiles: int, groups: int, heads_per_kv: int, mask: str,
                           chunk_blocks: int | None = None) -> int:
    """(kv head, batch) groups per chunk of the Hopper dK/dV grid, at least one and at most ``groups``: whole groups
    of at least ``chunk_blocks`` blocks (0: one group a chunk, every group's key tiles in turn); None is
    HOPPER_BWD_CHUNK_BLOCKS for causal GQA calls and 0 for the rest."""
    if chunk_blocks is None:
        chunk_blocks = HOPPER_BWD_CHUNK_BLOCKS if mask == "causal" and heads_per_kv > 1 else 0
    return max(1, min(groups, -(-chunk_blocks // max(key_tiles, 1))))


#: Unmasked Hopper backward calls convert dQ early (KernelOptions.hopper_bwd_early_convert) from this many query
#: rows on; masked ones (causal, windows) always; the wide rows (192, 256) never by default. H200, bf16, 16k tokens,
#: against converting after the whole dK/dV kernel in turns in one process: causal level to +3% at 2k and 4k and
#: +4-10% at 8k; without a mask 0-5% faster at 8k, but level to 7% slower at 4k and level to 4% slower at 2k
#: (d = 64, 80, 128); d = 192 10-17% slower at every length, d = 256 level to 3% either way (docs/design.md).
HOPPER_BWD_EARLY_CONVERT_MIN_SEQLEN = 8192


def hopper_bwd_early_converts(mask: str, seqlen_q: int, early_convert: bool | None = None,
                              wide: bool = False) -> bool:
    """Whether the Hopper backward's dQ conversion takes each query tile once the dK/dV kernel's additions to it are
    counted complete (``early_convert``, KernelOptions.hopper_bwd_early_convert, where given): None is every masked
    call, and unmasked ones of HOPPER_BWD_EARLY_CONVERT_MIN_SEQLEN query rows or more (``seqlen_q``: a varlen
    call's max_seqlen_q), on the 128-key rows only: not on the ``wide`` ones (HopperBwdConfig.wide, head dims 192
    and 256), where it measured slower (H200, 16k tokens: d = 192 10-17%)."""
    if early_convert is not None:
        return early_convert
    return not wide and (mask != "none" or seqlen_q >= HOPPER_BWD_EARLY_CONVERT_MIN_SEQLEN)


def hopper_bwd_rotates(group_blocks: int, sms: int, deterministic: bool = True, mods: bool = False,
                       wide: bool = False, rotate: bool | None = None) -> bool:
    """Whether the Hopper backward without a mask walks each block's query tiles from a start of its own
    (cuda/hopper/bwd_traits.cuh, rotated_start; ``rotate``: KernelOptions.hopper_bwd_rotate, None its default).

    Deterministic, a block waits for blocks after it in the grid, so a launch chunk's blocks (``group_blocks``, its
    groups' key tiles) must all be on the GPU at once; they may take half the ``sms`` at most, which leaves room for
    other streams' kernels. Otherwise nothing waits, and by default the kernels without score modifiers and the
    wide (192, 256) modifier kernels rotate: H200, bf16, 8k, no mask, against straight walks, 0 to +5% at 128 and
    256, level at 64 and 192; the modifier kernels +3-4% at 256, level to -4% at 128 (docs/design.md)."""
    if rotate is False:
        return False
    if deterministic:
        return 0 < group_blocks <= sms // 2
    return rotate is True or not mods or wide


def hopper_forward_config(arch: int, headdim: int, dtype: str, dropout: bool = False, varlen: bool = False,
                          mask: str = "none", seqlen_q: int | None = None,
                          masked_min_seqlen: int | None = None, mods: bool = False) -> HopperFwdConfig | None:
    """The Hopper forward's row for this call, or None where the mma.sync forward runs it (another GPU, a head
    dim other than 64, 128, 192 and 256, softcap, ALiBi or dropout (``mods``; ``dropout`` counts as one) at a head
    dim outside HOPPER_MODS_HEADDIMS (or varlen at HOPPER_MODS_PADDED_ONLY), or a masked
    call shorter than HOPPER_MASKED_MIN_SEQLEN, or than ``masked_min_seqlen`` where given; ``seqlen_q`` None skips
    that last rule). Varlen calls, paged K/V included, run where padded ones would."""
    if dtype not in DTYPE_TAGS:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_TAGS)}, got {dtype}")
    mods = mods or dropout
    if arch != 90 or headdim not in FORWARD_HOPPER_TABLE or (mods and not hopper_takes_mods(headdim, varlen)):
        return None
    shortest = HOPPER_MASKED_MIN_SEQLEN[headdim] if masked_min_seqlen is None else masked_min_seqlen
    if mask != "none" and seqlen_q is not None and seqlen_q < shortest:
        return None
    return hopper_forward_row(headdim, mods)


#: On compute capability 9.0 a head dim without a Hopper row (FORWARD_HOPPER_TABLE, BACKWARD_HOPPER_TABLE) runs on
#: the Hopper kernels at the next width up from this head dim on (KernelOptions.hopper_pad_headdim overrides it):
#: the arrays are read as they are (zeros past their head dim: exact, as zero columns add nothing to a score, and no
#: output column past it is written). It pays the wider tiles' work: H200, 16k tokens, 1.8-2.4x the mma.sync
#: forward and 1.8-3.2x its backward at 80-224. Below 40 the work doubles (32 -> 64).
HOPPER_PAD_MIN_HEADDIM = 40


def hopper_pad_width(arch: int, headdim: int, pad: bool | None = None) -> int | None:
    """The Hopper width a call of kernels' head dim ``headdim`` (a multiple of 8) runs at, wider than its arrays
    (read as they are), or None where it runs at its own width (a width with a Hopper row, another GPU, a head dim
    below HOPPER_PAD_MIN_HEADDIM unless ``pad`` is True, or ``pad`` False). Whether the Hopper kernel at that width
    takes the call is the caller's question (kernel_rows)."""
    if arch != 90 or headdim in FORWARD_HOPPER_TABLE or pad is False:
        return None
    if pad is None and headdim < HOPPER_PAD_MIN_HEADDIM:
        return None
    return next((width for width in sorted(FORWARD_HOPPER_TABLE) if width >= headdim), None)


def hopper_takes_call(arch: int, width: int, dtype: str, backward: bool, mask: str = "none", mods: bool = False,
                      varlen: bool = False, seqlen_q: int | None = None, deterministic: bool = False,
                      options: KernelOptions = DEFAULT, dropout: bool = False) -> bool:
    """Whether the Hopper forward (or, with ``backward``, the Hopper dK/dV kernel) at head dim ``width`` takes the
    call (:func:`kernel_rows`, same arguments)."""
    rows = kernel_rows(arch, width, dtype, mask, mods, varlen, seqlen_q, deterministic, options, dropout=dropout)
    return isinstance(rows.backward if backward else rows.forward, (HopperFwdConfig, HopperBwdConfig))


def hopper_varlen_own_widths(width: int, headdim: int, headdim_v: int) -> bool:
    """Whether a varlen forward on the Hopper kernel at ``width`` reads q and k (``headdim``) and v and out
    (``headdim_v``, multiples of 8) at their own head dims: where both lie in the row's last 64-column pass of a
    loader of several passes (width 192 or 256; SlabLoader zero-fills or skips only that pass past an array's
    columns, so a sequence's ragged tiles and output rows stop at each array's own). DeepSeek's 192 / 128."""
    return width > 128 and min(headdim, headdim_v) >= width - 64 and max(headdim, headdim_v) <= width


def padded_call_width(arch: int, headdim: int, dtype: str, backward: bool, mask: str = "none", mods: bool = False,
                      varlen: bool = False, seqlen_q: int | None = None, deterministic: bool = False,
                      options: KernelOptions = DEFAULT, dropout: bool = False) -> int:
    """The head dim a forward (or, with ``backward``, a backward) call of kernels' head dim ``headdim`` runs at:
    :func:`hopper_pad_width`'s where the Hopper kernel at that width takes the call (:func:`hopper_takes_call`, same
    arguments), else ``headdim`` itself."""
    width = hopper_pad_width(arch, headdim, options.hopper_pad_headdim)
    takes = width is not None and hopper_takes_call(arch, width, dtype, backward, mask, mods, varlen, seqlen_q,
                                                    deterministic, options, dropout)
    return width if takes else headdim


def hopper_forward_instantiations() -> list[str]:
    """Name expressions of every Hopper forward instantiation (compiled for sm_90a): without score modifiers for
    every mask, with them (softcap, ALiBi, dropout) for the masks forward.kernel_variant gives modifier calls
    (padded: causal and window; varlen: window) and, padded, without a mask (KernelOptions.hopper_unmasked_mods),
    and the padded ALiBi-only kernels without a mask and causal (forward.alibi_only_kernel)."""
    plain = tuple((mask, False, varlen, paged, False) for mask in MASKS
                  for varlen, paged in ((False, False), (True, False), (True, True)))
    modified = (("causal", True, False, False, False), ("none", True, False, False, False),
                ("window", True, False, False, False), ("window", True, True, False, False),
                ("window", True, True, True, False), ("causal", True, False, False, True),
                ("none", True, False, False, True))
    narrow_v = [hopper_fwd_v_config(FORWARD_HOPPER_TABLE[d], v_dim, False, False, mask, varlen).name_expression(
                    dtype, mask, varlen=varlen)
                for d, v_dim in FORWARD_HOPPER_V_TABLE for dtype in DTYPE_TAGS for mask in MASKS
                for varlen in (False, True)]
    return sorted([hopper_forward_row(d, mods).name_expression(dtype, mask, mods, varlen=varlen, paged=paged,
                                                               alibi_only=alibi_only)
                   for d in FORWARD_HOPPER_TABLE for dtype in DTYPE_TAGS
                   for mask, mods, varlen, paged, alibi_only in (*plain, *modified)
                   if not mods or hopper_takes_mods(d, varlen)] + narrow_v)


def backward_config(arch: int, headdim: int, dtype: str, mask: str, mods: bool = False) -> BwdConfig:
    """The backward main-kernel configuration (same key as :func:`forward_config`). The modifier variant keeps
    BACKWARD_TABLE's rows (the d=64 H100 masked row spills 24-68 bytes with dropout's Philox)."""
    if dtype not in DTYPE_TAGS:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_TAGS)}, got {dtype}")
    key = (arch_family(arch), tile_headdim(headdim))
    if mask != "none" and not mods and key in BACKWARD_CAUSAL_TABLE:
        return BACKWARD_CAUSAL_TABLE[key]
    return BACKWARD_TABLE[key]


def backward_dq_config(arch: int, headdim: int, dtype: str, mask: str) -> BwdDqConfig:
    """The deterministic dQ kernel's configuration."""
    if dtype not in DTYPE_TAGS:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_TAGS)}, got {dtype}")
    return BACKWARD_DQ_TABLE[(arch_family(arch), tile_headdim(headdim))]


@dataclass(frozen=True)
class KernelRows:
    """The tile-table rows one call runs on (:func:`kernel_rows`)."""

    forward: FwdConfig | HopperFwdConfig
    backward: BwdConfig | HopperBwdConfig  # the dK/dV kernel's (with atomic dQ, it adds dQ too)
    backward_dq: BwdDqConfig | None  # deterministic on the mma.sync backward: the separate dQ kernel's; else None


def kernel_rows(arch: int, headdim: int, dtype: str, mask: str = "none", mods: bool = False, varlen: bool = False,
                seqlen_q: int | None = None, deterministic: bool = False, options: KernelOptions = DEFAULT,
                tma: bool = True, dropout: bool = False) -> KernelRows:
    """The one place that chooses the rows a call runs on, forward and backward: the Hopper (wgmma, TMA) kernels'
    where they take the call, else the mma.sync kernels'.

    Args:
        arch: compute capability as an int (80, 86, 89, 90, ...); no GPU is needed.
        headdim: the kernels' head dim (the call's, padded to a multiple of 8).
        dtype: "float16" or "bfloat16".
        mask: one of MASKS ("none", "causal", "window"), as forward.kernel_variant gives it (score modifiers run in
            the "window" variant).
        mods: softcap, ALiBi or dropout (the Hopper kernels' modifier rows take them, configs.hopper_takes_mods and
            hopper_bwd_takes_mods).
        dropout: whether dropout is among ``mods``.
        varlen: packed sequences (paged K/V included).
        seqlen_q: query rows (max_seqlen_q for varlen): masked calls shorter than the Hopper forward's minimum run the
            mma.sync forward; None skips that rule.
        deterministic: the backward's mode (the mma.sync backward then computes dQ in a kernel of its own, the Hopper
            dK/dV kernel adds it in turns).
        options: KernelOptions: hopper_forward, hopper_backward, hopper_masked_min_seqlen.
        tma: whether the call's strides suit TMA (positive, 16-byte multiples): the Hopper kernels copy with it.
    """
    forward = backward = None
    if tma and options.hopper_forward:
        forward = hopper_forward_config(arch, headdim, dtype, dropout, varlen, mask, seqlen_q,
                                        options.hopper_masked_min_seqlen, mods)
    if tma and options.hopper_backward:
        backward = hopper_backward_config(arch, headdim, mods, dropout, options.hopper_backward_mods, varlen)
    return KernelRows(forward or forward_config(arch, headdim, dtype, mask, varlen, mods),
                      backward or backward_config(arch, headdim, dtype, mask, mods),
                      backward_dq_config(arch, headdim, dtype, mask) if deterministic and backward is None else None)


def backward_instantiations(family: str | None = None) -> list[str]:
    """Name expressions of every shipped backward instantiation (of one arch family, or all), deduplicated."""
    names = set()
    for (fam, width), base in BACKWARD_TABLE.items():
        if family is None or fam == family:
            for dtype in DTYPE_TAGS:
                for mask, mods in VARIANTS:
                    config = BACKWARD_CAUSAL_TABLE.get((fam, width), base) if mask != "none" and not mods else base
                    for atomic in (False, True):
                        for varlen in (False, True):  # the dK/dV kernel has its own varlen instantiations
                            names.add(config.name_expression(dtype, mask, atomic, mods, varlen))
    for (fam, _), config in BACKWARD_DQ_TABLE.items():
        if family is None or fam == family:
            for dtype in DTYPE_TAGS:
                for mask, mods in VARIANTS:
                    names.add(config.name_expression(dtype, mask, mods))
    for dtype in DTYPE_TAGS:
        names.add(f"fa2::bwd_preprocess<{DTYPE_TAGS[dtype]}>")
        names.add(f"fa2::bwd_convert_dq<{DTYPE_TAGS[dtype]}>")
    names.add("fa2::bwd_zero_tail")
    return sorted(names)


def decode_config(arch: int, headdim: int, keys_per_item: int | None = None, deep: bool | None = None,
                  warp_items: bool = False) -> DecodeConfig:
    """The decode row for a GPU arch and head dim; given the keys of a work item (a split of a row), its deep-ring
    twin where one exists and the item is DEEP_RING_TILES tiles per warp (``deep`` forces the choice). With
    ``warp_items``, the warp-items twin where one exists (``deep`` forcing its ring)."""
    key = (arch_family(arch), tile_headdim(headdim))
    if warp_items and key in DECODE_WARP_TABLE:
        solo = DECODE_WARP_TABLE[key]
        return solo if deep is None else replace(solo, deep_ring=deep)
    base, twin = DECODE_TABLE[key], DECODE_DEEP_TABLE.get(key)
    if twin is None or (deep is None and keys_per_item is None):
        return base
    if deep is None:
        deep = -(-keys_per_item // (twin.warps * twin.block_n)) in DEEP_RING_TILES
    return twin if deep else base


def decode_instantiations(family: str | None = None, extras: bool = False) -> list[str]:
    """Name expressions of every shipped decode_attention instantiation (of one arch family, or all): the plain
    kernels (causal x paged x dtype), or with ``extras`` the Extras ones (paged x dtype), of every row and twin."""
    rows = [(fam, config) for (fam, _), config in DECODE_TABLE.items()]
    rows += [(fam, config) for (fam, _), config in DECODE_DEEP_TABLE.items()]
    rows += [(fam, config) for (fam, _), config in DECODE_WARP_TABLE.items()]
    return sorted({
        config.name_expression(dtype, causal and not extras, paged, extras)
        for fam, config in rows
        if family is None or fam == family
        for dtype in DTYPE_TAGS
        for causal in (False, True)
        for paged in (False, True)
    })


def forward_instantiations(family: str | None = None) -> list[str]:
    """Name expressions of every shipped forward instantiation (of one arch family, or all), deduplicated."""
    names = {
        (FORWARD_MASKED_TABLE.get(key, config) if _uses_masked_row(mask, varlen, mods) else config).name_expression(
            dtype, mask, mods, varlen, paged)
        for key, config in FORWARD_TABLE.items()
        if family is None or key[0] == family
        for dtype in DTYPE_TAGS
        for mask, mods in FORWARD_VARIANTS
        for varlen, paged in ((False, False), (True, False), (True, True))
        if not (mods and mask == "causal" and varlen)
    }
    names.add("fa2::dropout_keep_mask")
    return sorted(names)
