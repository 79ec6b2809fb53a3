"""flash_attn_with_kvcache's host-side argument checks (CPU only): valid calls give the expected metadata, and each
rejection names its argument and what is allowed. The GPU tests (tests/test_kvcache.py) check that a rejected call
leaves the caches untouched."""

from __future__ import annotations

import numpy as np
import pytest

from fa2cupy import decode
from fa2cupy.arrays import ArrayInfo
from fa2cupy.checks import check_kvcache_args

UNLIMITED = decode.UNLIMITED_WINDOW


def _c_strides(shape):
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def info(name, shape, dtype="float16"):
    """An ArrayInfo as describe() would build it for a CuPy array."""
    return ArrayInfo(name, "cupy", tuple(shape), dtype, _c_strides(shape), ("cuda", 0))


def base(b=2, sq=3, h=8, hkv=2, d=64, capacity=100, new=2, dtype="float16", paged=False):
    """Infos of a valid call: q, caches, k/v (when new > 0) and an int32 cache_seqlens."""
    infos = dict(q=info("q", (b, sq, h, d), dtype))
    if paged:
        pages = -(-capacity // 16)
        infos.update(k_cache=info("k_cache", (b * pages + 1, 16, hkv, d), dtype),
                     v_cache=info("v_cache", (b * pages + 1, 16, hkv, d), dtype),
                     block_table=info("block_table", (b, pages), "int32"))
    else:
        infos.update(k_cache=info("k_cache", (b, capacity, hkv, d), dtype),
                     v_cache=info("v_cache", (b, capacity, hkv, d), dtype))
    if new:
        infos.update(k=info("k", (b, new, hkv, d), dtype), v=info("v", (b, new, hkv, d), dtype))
    infos["cache_seqlens"] = info("cache_seqlens", (b,), "int32")
    return infos


def check(infos, cache_seqlens="array", **kw):
    return check_kvcache_args(infos, object() if cache_seqlens == "array" else cache_seqlens, **kw)


def rotary(infos, rows=100, cols=16, dtype="float16"):
    return dict(infos, rotary_cos=info("rotary_cos", (rows, cols), dtype),
                rotary_sin=info("rotary_sin", (rows, cols), dtype))


# ------------------------------------------------------------------ valid calls


def test_plain_call_uses_the_plain_kernels():
    call = check(base())
    assert (call.batch, call.seqlen_q, call.nheads, call.nheads_kv, call.headdim) == (2, 3, 8, 2, 64)
    assert call.seqlen_new == 2 and call.capacity == 100 and call.page_size == 0
    assert call.extras == decode.PLAIN and not call.extras.attention and not call.extras.append


def test_causal_is_the_plain_causal_kernel():
    extras = check(base(), causal=True).extras
    assert extras.plain_causal and not extras.attention
    # window (-1, 0) is the causal mask too; so is a left side of at least the capacity (flash-attn clamps it).
    assert check(base(), window_size=(-1, 0)).extras.plain_causal
    assert check(base(), window_size=(100, 0)).extras.plain_causal
    assert check(base(), window_size=(1000, 1000)).extras == decode.PLAIN


@pytest.mark.parametrize("window,causal,left,right", [
    ((8, -1), False, 8, UNLIMITED), ((8, 0), False, 8, 0), ((8, 5), True, 8, 0), ((0, 0), False, 0, 0),
    ((-1, 3), False, UNLIMITED, 3), ([4, 4], False, 4, 4),
])
def test_windows_use_the_extras_kernel(window, causal, left, right):
    extras = check(base(), window_size=window, causal=causal).extras
    assert (extras.window_left, extras.window_right) == (left, right)
    assert extras.attention and not extras.append


def test_softcap_alibi_leftpad():
    assert check(base(), softcap=30.0).extras.softcap == 30.0
    assert check(base(), softcap=0).extras == decode.PLAIN
    for shape in ((8,), (2, 8)):
        extras = check(dict(base(), alibi_slopes=info("alibi_slopes", shape, "float32"))).extras
        assert extras.alibi and extras.attention
    extras = check(dict(base(), cache_leftpad=info("cache_leftpad", (2,), "int32"))).extras
    assert extras.leftpad and extras.attention and extras.append


@pytest.mark.parametrize("causal,window,advance", [
    (False, (-1, -1), False), (True, (-1, -1), True), (False, (5, -1), True), (False, (-1, 0), True),
    (False, (100, 100), False),  # both sides at least the capacity: no window, q at one position
])
def test_rotary(causal, window, advance):
    extras = check(rotary(base()), causal=causal, window_size=window, rotary_interleaved=False).extras
    assert extras.rotary_dim == 32 and extras.seqlen_ro == 100 and not extras.rotary_interleaved
    assert extras.rotary_advance == advance and extras.append


def test_rotary_full_headdim_and_longer_tables():
    assert check(rotary(base(), rows=5000, cols=32)).extras.rotary_dim == 64
    assert check(rotary(base(), cols=1)).extras.rotary_dim == 2


def test_paged_capacity_and_rotary_length():
    call = check(rotary(base(paged=True), rows=112), causal=True)
    assert call.page_size == 16 and call.capacity == 112 and call.max_pages == 7


def test_int_cache_seqlens_checked_with_rotary_positions():
    # seqlen_q 3 > seqlen_new 2: under the causal mask q reaches position cache_seqlens + 2.
    assert check(rotary(base(), rows=100), cache_seqlens=97, causal=True).fixed_seqlen == 97
    with pytest.raises(ValueError, match=r"rotary_cos.*position 100"):
        check(rotary(base(), rows=100), cache_seqlens=98, causal=True)
    assert check(rotary(base(), rows=100), cache_seqlens=98, causal=False).fixed_seqlen == 98


# ------------------------------------------------------------------ rejections


@pytest.mark.parametrize("kw,exc,match", [
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size"),
    (dict(window_size=(3,)), TypeError, "window_size"),
    (dict(window_size=None), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap="30"), TypeError, "softcap"),
    (dict(rotary_interleaved="yes"), TypeError, "rotary_interleaved"),
    (dict(causal=2), TypeError, "causal"),
    (dict(num_splits=-1), ValueError, "num_splits"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
])
def test_bad_options(kw, exc, match):
    with pytest.raises(exc, match=match):
        check(base(), **kw)


@pytest.mark.parametrize("change,exc,match", [
    (dict(rotary_cos=info("rotary_cos", (100, 16), "bfloat16")), TypeError, r"rotary_cos.*dtype"),
    (dict(rotary_sin=info("rotary_sin", (100, 16), "float32")), TypeError, r"rotary_sin.*dtype"),
    (dict(rotary_cos=info("rotary_cos", (100, 16, 1))), ValueError, r"rotary_cos.*2-D"),
    (dict(rotary_cos=info("rotary_cos", (100, 0))), ValueError, r"rotary_cos.*2-D"),
    (dict(rotary_sin=info("rotary_sin", (100, 8))), ValueError, r"rotary_cos.*rotary_sin.*same shape"),
    (dict(rotary_cos=info("rotary_cos", (100, 33)), rotary_sin=info("rotary_sin", (100, 33))), ValueError,
     r"rotary_dim = 66.*headdim = 64"),
    (dict(rotary_cos=info("rotary_cos", (99, 16)), rotary_sin=info("rotary_sin", (99, 16))), ValueError,
     r"rotary_cos.*99 rows.*100"),
])
def test_bad_rotary(change, exc, match):
    with pytest.raises(exc, match=match):
        check(dict(rotary(base()), **change))


def test_rotary_needs_both_tables():
    infos = rotary(base())
    del infos["rotary_sin"]
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin"):
        check(infos)


@pytest.mark.parametrize("shape,dtype,exc", [
    ((8,), "float16", TypeError), ((8,), "float64", TypeError), ((4,), "float32", ValueError),
    ((2, 4), "float32", ValueError), ((1, 8), "float32", ValueError), ((2, 8, 1), "float32", ValueError),
])
def test_bad_alibi_slopes(shape, dtype, exc):
    with pytest.raises(exc, match=r"alibi_slopes.*(float32|\(8,\) or \(2, 8\))"):
        check(dict(base(), alibi_slopes=info("alibi_slopes", shape, dtype)))


@pytest.mark.parametrize("shape,dtype", [((2,), "int64"), ((3,), "int32"), ((2, 1), "int32"), ((2,), "float32")])
def test_bad_cache_leftpad(shape, dtype):
    with pytest.raises(ValueError, match=r"cache_leftpad must be int32 \(batch,\)"):
        check(dict(base(), cache_leftpad=info("cache_leftpad", shape, dtype)))


def test_leftpad_not_with_block_table():
    with pytest.raises(ValueError, match=r"cache_leftpad.*block_table"):
        check(dict(base(paged=True), cache_leftpad=info("cache_leftpad", (2,), "int32")))


def test_existing_checks_still_hold():
    with pytest.raises(ValueError, match=r"\bv\b"):
        infos = base()
        del infos["v"]
        check(infos)
    with pytest.raises(TypeError, match=r"\bk\b"):
        check(dict(base(), k=info("k", (2, 2, 2, 64), "float32")))
    with pytest.raises(ValueError, match="cache_seqlens"):
        check(base(), cache_seqlens=99)  # 99 + 2 new > 100
    with pytest.raises(ValueError, match="cache_batch_idx"):
        check(dict(base(paged=True), cache_batch_idx=info("cache_batch_idx", (2,), "int32")))

    with pytest.raises(ValueError, match="k_cache has headdim 32 but q has 64"):  # q's is checked first
        check(dict(base(new=0), k_cache=info("k_cache", (2, 100, 2, 32))))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dv", [128, 32, 8])
def test_v_cache_head_dim_of_its_own(paged, dv):
    infos = base(paged=paged)
    vc = infos["v_cache"].shape
    infos.update(v_cache=info("v_cache", vc[:3] + (dv,)), v=info("v", (2, 2, 2, dv)))
    call = check(infos)
    assert (call.headdim, call.headdim_v, call.dv) == (64, dv, dv)
    assert check(base(paged=paged)).headdim_v == 0  # (the same head dim: kept as 0, one cached plan key)


@pytest.mark.parametrize("change,match", [
    (dict(v_cache=info("v_cache", (2, 100, 2, 132))), r"v_cache has headdim=132.*multiple of 8"),
    (dict(v_cache=info("v_cache", (2, 100, 2, 264))), r"v_cache has headdim=264.*multiple of 8 up to 256"),
    (dict(v_cache=info("v_cache", (2, 100, 1, 128))), r"k_cache .* and v_cache .* every axis but the last"),
    (dict(v_cache=info("v_cache", (2, 99, 2, 64))), r"k_cache .* and v_cache .* every axis but the last"),
    (dict(v_cache=info("v_cache", (2, 100, 2, 128))), r"v must be \(batch, seqlen_new, nheads_kv, v_cache's "
                                                       r"headdim\) = \(2, \*, 2, 128\)"),
    (dict(v=info("v", (2, 3, 2, 64))), r"k .* and v .* same seqlen_new"),
])
def test_bad_v_cache_head_dim(change, match):
    with pytest.raises(ValueError, match=match):
        check(dict(base(), **change))


# ------------------------------------------------------------------ through the public function (NumPy arrays:
# every check above runs before anything touches a GPU)


def _numpy_args():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 4, 64)).astype(np.float16)
    cache = rng.standard_normal((2, 64, 2, 64)).astype(np.float16)
    return dict(q=q, k_cache=cache, v_cache=cache.copy(), cache_seqlens=np.array([3, 40], np.int32))


@pytest.mark.parametrize("change,exc,match", [
    (dict(window_size=(-3, 0)), ValueError, "window_size"),
    (dict(softcap=-2.0), ValueError, "softcap"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.ones(4, np.float16)), TypeError, "alibi_slopes"),
    (dict(cache_leftpad=np.zeros(2, np.int64)), ValueError, "cache_leftpad"),
    (dict(rotary_cos=np.ones((64, 40), np.float16), rotary_sin=np.ones((64, 40), np.float16)), ValueError,
     "rotary_dim"),
    (dict(rotary_cos=np.ones((64, 8), np.float16)), ValueError, "rotary_sin"),
    (dict(rotary_cos=[[1.0]], rotary_sin=[[1.0]]), TypeError, "rotary_cos"),
])
def test_public_function_rejects_before_touching_a_gpu(change, exc, match):
    import fa2cupy

    args = dict(_numpy_args(), **change)
    before = args["k_cache"].copy()
    with pytest.raises(exc, match=match):
        fa2cupy.flash_attn_with_kvcache(**args)
    assert np.array_equal(args["k_cache"], before)
