"""merge_attention_states: argument checks (CPU) and the merge against full attention (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from fa2cupy.arrays import ArrayInfo
from fa2cupy.checks import check_merge_args
from fa2cupy.options import KernelOptions


def _info(name, shape, dtype="bfloat16"):
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return ArrayInfo(name, "cupy", tuple(shape), dtype, strides, ("cuda", 0))


def test_merge_args_valid():
    outs = [_info(f"outs[{i}]", (2, 5, 4, 64)) for i in range(3)]
    lses = [_info(f"lses[{i}]", (2, 4, 5), "float32") for i in range(3)]
    assert check_merge_args(outs, lses) == (3, 2, 5, 4, 64, "bfloat16")


def test_merge_args_lengths():
    with pytest.raises(ValueError, match="same length"):
        check_merge_args([_info("outs[0]", (1, 2, 3, 8))], [])
    with pytest.raises(ValueError, match="non-empty"):
        check_merge_args([], [])


def test_merge_args_mismatched_parts():
    outs = [_info("outs[0]", (1, 2, 3, 8)), _info("outs[1]", (1, 2, 3, 16))]
    lses = [_info(f"lses[{i}]", (1, 3, 2), "float32") for i in range(2)]
    with pytest.raises(ValueError, match=r"outs\[1\]"):
        check_merge_args(outs, lses)


def test_merge_args_lse_shape_and_dtype():
    outs = [_info("outs[0]", (1, 2, 3, 8))]
    with pytest.raises(ValueError, match=r"lses\[0\].*\(batch, nheads, seqlen_q\)"):
        check_merge_args(outs, [_info("lses[0]", (1, 2, 3), "float32")])
    with pytest.raises(TypeError, match=r"lses\[0\].*float32"):
        check_merge_args(outs, [_info("lses[0]", (1, 3, 2), "float16")])


def test_merge_args_dtype():
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        check_merge_args([_info("outs[0]", (1, 2, 3, 8), "float32")], [_info("lses[0]", (1, 3, 2), "float32")])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", [64, 40, 128])
def test_merge_of_key_shards_equals_full_attention(dtype, causal, headdim):
    import cupy as cp

    import fa2cupy

    rng = np.random.default_rng(headdim + causal)
    b, sq, sk, h, hkv = 2, 37, 300, 4, 2
    npdt = np.float16 if dtype == "float16" else __import__("ml_dtypes").bfloat16
    q, k, v = (cp.asarray(rng.standard_normal(s, dtype=np.float32).astype(npdt))
               for s in ((b, sq, h, headdim), (b, sk, hkv, headdim), (b, sk, hkv, headdim)))
    full, full_lse, _ = fa2cupy.flash_attn_func(q, k, v, return_attn_probs=True)
    cuts = [0, 70, 71, 300]  # a one-key shard included
    outs, lses = [], []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        o, lse, _ = fa2cupy.flash_attn_func(q, k[:, lo:hi], v[:, lo:hi], return_attn_probs=True)
        outs.append(o)
        lses.append(lse)
    # An empty part (a row that saw no key: out 0, lse +inf) must not change anything.
    outs.append(cp.zeros_like(full))
    lses.append(cp.full_like(full_lse, np.inf))
    out, lse = fa2cupy.merge_attention_states(outs, lses)
    cp.cuda.runtime.deviceSynchronize()
    assert out.shape == full.shape and out.dtype == full.dtype and lse.shape == full_lse.shape
    u = 2.0**-11 if dtype == "float16" else 2.0**-8
    # Each part is rounded to the dtype once, the merge rounds once more: within 4u of max|v| of the full result.
    err = float(cp.abs(out.astype(cp.float32) - full.astype(cp.float32)).max())
    assert err <= 4 * u * float(cp.abs(v.astype(cp.float32)).max()), err
    assert float(cp.abs(lse - full_lse).max()) <= 1e-4 * (1 + float(cp.abs(full_lse).max()))


@pytest.mark.gpu
def test_merge_all_empty_rows():
    import cupy as cp

    import fa2cupy

    out0 = cp.ones((1, 3, 2, 16), dtype=cp.float16)
    lse0 = cp.full((1, 2, 3), np.inf, dtype=cp.float32)
    out, lse = fa2cupy.merge_attention_states([out0, out0], [lse0, -lse0])
    cp.cuda.runtime.deviceSynchronize()
    assert bool((out == 0).all()) and bool(cp.isinf(lse).all() and (lse > 0).all())


# ------------------------------------------------------------------ split-KV heuristic (CPU)


def test_split_count_fills_the_gpu_once():
    from fa2cupy.decode import choose_num_splits

    # b=1, 8 kv heads, 132 SMs: 16 splits, 128 blocks, one per SM.
    assert choose_num_splits(8, 132, 65536, 128) == 16
    # Never a second partial wave: floor(132 / 64) = 2 splits, not 3.
    assert choose_num_splits(64, 132, 65536, 128) == 2
    # Enough blocks already: one split.
    assert choose_num_splits(512, 132, 16384, 128) == 1
    # Short caches: at least one tile per warp per split (1024 keys / 128 = 8 splits at most).
    assert choose_num_splits(8, 132, 1024, 128) == 8
    assert choose_num_splits(8, 132, 16, 128) == 1


def test_blocks_walk_items_only_when_the_grid_is_over_full(monkeypatch):
    # _attention_grid with the device queries stubbed: an H100-like part (132 SMs, 227 KB per block) holding one
    # block per SM of either layout.
    from cupy_backends.cuda.api import driver

    from fa2cupy import build, configs, decode

    config = configs.decode_config(90, 128)
    attributes = {"MultiProcessorCount": 132, "MaxSharedMemoryPerBlockOptin": 232448}
    monkeypatch.setattr(build, "device_attribute", lambda device, name: attributes[name])
    asked = []

    def occupancy(function, threads, smem):
        asked.append(smem)
        return 1

    monkeypatch.setattr(driver, "occupancyMaxActiveBlocksPerMultiprocessor", occupancy)

    class Function:
        ptr = 0

    # Every item resident at once: one block per item, the compact layout.
    assert decode._attention_grid(Function, config, 0, 128, 132) == (128, config.smem_bytes)
    assert decode._attention_grid(Function, config, 0, 132, 132) == (132, config.smem_bytes)
    # 64 x 1k (512 items): blocks walking items, with the merge area after the rings: 128 blocks of 4 items (the
    # same 4 rounds as 132 blocks of 3 or 4, with a full last round).
    assert decode._attention_grid(Function, config, 0, 512, 132) == (128, config.persistent_smem_bytes)
    assert config.persistent_smem_bytes in asked
    # Fewer blocks only while at most 1/32 of the SMs would idle: 133 items keep 132 walkers (67 blocks of 2 would
    # leave half the GPU idle), 1000 items keep 132 (125 blocks of 8 would idle 7 SMs).
    assert decode._attention_grid(Function, config, 0, 133, 132) == (132, config.persistent_smem_bytes)
    assert decode._attention_grid(Function, config, 0, 1000, 132) == (132, config.persistent_smem_bytes)
    assert decode._attention_grid(Function, config, 0, 1024, 132) == (128, config.persistent_smem_bytes)
    assert decode._opt_in_smem(config, 0) == config.persistent_smem_bytes
    # A part whose blocks cannot have the walking layout (99 KB, d=256): one block per item, however many.
    attributes["MaxSharedMemoryPerBlockOptin"] = 101376
    wide = configs.decode_config(86, 256)
    assert wide.smem_bytes <= 101376 < wide.persistent_smem_bytes
    assert decode._opt_in_smem(wide, 0) == wide.smem_bytes
    assert decode._attention_grid(Function, wide, 0, 10_000, 132) == (10_000, wide.smem_bytes)


def _h100_like_planner(monkeypatch):
    """plan_decode of a bf16 hq=32 hkv=8 d=128 call on an H100-like part (132 SMs, 50 MiB L2), with device
    queries and kernel builds stubbed: plan(batch, arch, num_splits=0, seqlen_k=16384)."""
    from fa2cupy import build, decode

    class Function:
        ptr = 0

    monkeypatch.setattr(build, "get_kernel", lambda *args: Function())
    monkeypatch.setattr(build, "device_attribute",
                        lambda device, name: {"L2CacheSize": 50 * 2**20, "MultiProcessorCount": 132}[name])
    monkeypatch.setattr(decode, "_opt_in_smem", lambda config, device: config.smem_bytes)
    monkeypatch.setattr(decode, "_attention_grid", lambda function, config, device, items, sms: (items, 1024))
    strides = {name: (0, 0, 0, 2) for name in ("q", "k_cache", "v_cache", "k", "v")}

    def plan(batch, arch, num_splits=0, seqlen_k=16384, **options):
        return decode.plan_decode((batch, 1, 32, 128), strides, "bfloat16", nheads_kv=8, cache_rows=batch,
                                  capacity=seqlen_k, page_size=0, max_pages=0, seqlen_new=1, max_seqlen_k=seqlen_k,
                                  softmax_scale=0.1, causal=False, arch=arch, device=0, num_splits=num_splits,
                                  item=2, options=KernelOptions(**options))
    return plan


def test_programmatic_launches_where_splits_merge(monkeypatch):
    # plan_decode (device queries and kernel builds stubbed: an H100-like part): on sm_90, calls of
    # KernelOptions.decode_programmatic_min_splits splits or more launch every kernel (append included)
    # programmatically, others plainly; never before sm_90; KernelOptions.decode_programmatic_launch forces either way.
    plan = _h100_like_planner(monkeypatch)
    fewest = KernelOptions().decode_programmatic_min_splits

    def programmatic(p):
        return p.attention._config is not None, p.append._config is not None

    assert plan(1, 90).splits >= fewest and programmatic(plan(1, 90)) == (True, True)
    assert programmatic(plan(1, 90, num_splits=fewest - 1)) == (False, False)
    assert programmatic(plan(1, 90, num_splits=fewest - 1, decode_programmatic_min_splits=fewest - 1)) == (True, True)
    assert plan(64, 90).splits == 1 and programmatic(plan(64, 90)) == (False, False)
    assert programmatic(plan(1, 80)) == (False, False)
    assert programmatic(plan(64, 90, decode_programmatic_launch=True)) == (True, True)
    assert programmatic(plan(1, 80, decode_programmatic_launch=True)) == (False, False)
    assert programmatic(plan(1, 90, decode_programmatic_launch=False)) == (False, False)


def test_kv_streams_under_evict_first_only_past_l2(monkeypatch):
    # DecodeParams.stream_larger_than_l2: K/V copies under an L2 evict-first policy only for calls whose K/V
    # bytes exceed L2 (50 MiB here; 2 x b x sk x 8 heads x 128 x 2 bytes), where they cannot stay in L2 anyway;
    # a cache that fits keeps its residency. KernelOptions.decode_stream_evict_first forces either way.
    plan = _h100_like_planner(monkeypatch)

    def evict_first(p):
        return p.attention.params.stream_larger_than_l2

    assert evict_first(plan(1, 90, seqlen_k=16384)) == 1        # 64 MiB
    assert evict_first(plan(8, 90, seqlen_k=1024)) == 0         # 32 MiB
    assert evict_first(plan(64, 90, seqlen_k=1024)) == 1        # 256 MiB
    assert evict_first(plan(1, 90, seqlen_k=4096)) == 0         # 16 MiB
    assert evict_first(plan(1, 80, seqlen_k=65536)) == 1        # (the policy is sm_80's too)
    assert evict_first(plan(1, 90, seqlen_k=16384, decode_stream_evict_first=False)) == 0
    assert evict_first(plan(8, 90, seqlen_k=1024, decode_stream_evict_first=True)) == 1


def test_deep_ring_twin_for_short_streams():
    # configs.decode_config picks the deep-ring twin (sm_90, d=128) for work items of 2..16 key tiles per warp
    # (4 warps x 32 keys: 256..2048 keys); `deep` (KernelOptions.decode_deep_ring in plan_decode) forces it either
    # way.
    from fa2cupy import configs, decode

    base, twin = configs.decode_config(90, 128), configs.DECODE_DEEP_TABLE[("sm90", 128)]
    assert not base.deep_ring and twin.deep_ring
    assert configs.decode_config(90, 128, keys_per_item=1024) == twin       # 1 x 16k: 16 splits of 1024 keys
    assert configs.decode_config(90, 128, keys_per_item=256) == twin        # 2 tiles per warp
    assert configs.decode_config(90, 128, keys_per_item=2048) == twin       # 16 tiles per warp
    assert configs.decode_config(90, 128, keys_per_item=128) == base        # 1 x 1k: one tile per warp
    assert configs.decode_config(90, 128, keys_per_item=2049) == base       # 8 x 64k: long streams
    assert configs.decode_config(90, 128, keys_per_item=128, deep=True) == twin
    assert configs.decode_config(90, 128, keys_per_item=1024, deep=False) == base
    assert configs.decode_config(80, 128, keys_per_item=1024) == configs.decode_config(80, 128)  # no twin there
    assert configs.decode_config(90, 64, keys_per_item=1024, deep=True) == configs.decode_config(90, 64)
    # The twin's names add DecodeTraits' last two arguments (Extras, DeepRing); the row's stay as they were.
    assert base.name_expression("bfloat16", True, False).endswith("fa2::bf16, true, false>>")
    assert twin.name_expression("bfloat16", True, False).endswith("fa2::bf16, true, false, false, true>>")
    assert twin.name_expression("float16", True, True, extras=True).endswith("fa2::f16, false, true, true, true>>")
    names = decode.instantiations("sm90")
    assert twin.name_expression("bfloat16", False, True, extras=True) in names
    assert twin.name_expression("float16", True, False) in names


def test_warp_items_twin_for_grids_of_a_work_item_per_warp():
    # decode.uses_warp_items: one split, items that fill the GPU's warps (132 SMs x 4 on an H100) in equal rounds
    # with at most 1/32 of them idle (64 x 1k: 512 items), and items of at most
    # KernelOptions.decode_warp_items_max_tiles tiles; configs.decode_config then gives the warp-items twin where
    # one exists.
    from fa2cupy import configs, decode

    solo = configs.DECODE_WARP_TABLE[("sm90", 128)]
    longest = KernelOptions().decode_warp_items_max_tiles * solo.block_n
    assert decode.uses_warp_items(1, 512, 132, solo, 1024)          # 64 x 1k
    assert decode.uses_warp_items(1, 4096, 132, solo, longest)
    assert not decode.uses_warp_items(1, 512, 132, solo, longest + 1)  # long streams: blocks split items
    assert decode.uses_warp_items(1, 512, 132, solo, longest + 1, max_tiles=longest // solo.block_n + 1)
    assert not decode.uses_warp_items(1, 511, 132, solo, 1024)      # some SMs would stream fewer items than warps
    assert decode.uses_warp_items(1, 1024, 132, solo, 1024)         # 128 x 1k: two equal rounds of 512 warps
    assert not decode.uses_warp_items(1, 768, 132, solo, 1024)      # 96 x 1k: a second round of 240 items
    assert not decode.uses_warp_items(1, 128, 132, solo, 1024)      # 16 x 1k: a block per item
    assert not decode.uses_warp_items(2, 1024, 132, solo, 1024)     # splits merge across warps and blocks
    assert solo.warp_items and configs.decode_config(90, 128, keys_per_item=1024, warp_items=True) == solo
    assert configs.decode_config(90, 128, warp_items=True, deep=not solo.deep_ring).deep_ring != solo.deep_ring
    assert configs.decode_config(80, 128, warp_items=True) == configs.decode_config(80, 128)  # no twin there
    # Per-warp Q tiles and no merge area: the same bytes whether or not the warps walk items.
    assert solo.smem_bytes == solo.persistent_smem_bytes
    assert solo.name_expression("bfloat16", False, False).endswith(
        "fa2::bf16, false, false, false, " + str(solo.deep_ring).lower() + ", true>>")
    assert solo.name_expression("float16", True, True) in decode.instantiations("sm90")
    assert solo.name_expression("bfloat16", False, True, extras=True) in decode.instantiations("sm90")


def test_warp_items_grid(monkeypatch):
    # A block per 4 items (its warps take one each) up to the GPU's resident blocks, beyond which warps walk items:
    # the fewest blocks that take the same rounds, while at most 1/32 of the SMs idle.
    from cupy_backends.cuda.api import driver

    from fa2cupy import build, configs, decode

    solo = configs.DECODE_WARP_TABLE[("sm90", 128)]
    monkeypatch.setattr(build, "device_attribute", lambda device, name: {"MultiProcessorCount": 132}[name])
    monkeypatch.setattr(driver, "occupancyMaxActiveBlocksPerMultiprocessor", lambda function, threads, smem: 1)

    class Function:
        ptr = 0

    assert decode._attention_grid(Function, solo, 0, 512, 132) == (128, solo.smem_bytes)   # 64 x 1k: one round
    assert decode._attention_grid(Function, solo, 0, 510, 132) == (128, solo.smem_bytes)
    assert decode._attention_grid(Function, solo, 0, 528, 132) == (132, solo.smem_bytes)
    assert decode._attention_grid(Function, solo, 0, 1024, 132) == (128, solo.smem_bytes)  # 128 x 1k: 2 items per warp
    assert decode._attention_grid(Function, solo, 0, 600, 132) == (132, solo.smem_bytes)   # 75 blocks would idle 57 SMs
    assert decode._attention_grid(Function, solo, 0, 4096, 132) == (128, solo.smem_bytes)
