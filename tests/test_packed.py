"""The packed-input forms (flash_attn_qkvpacked_func, flash_attn_kvpacked_func): the split into views (CPU), and
on the GPU bitwise equality with flash_attn_func on the unpacked arrays."""

from __future__ import annotations

import numpy as np
import pytest

from fa2cupy import packed


def test_split_gives_views_in_order():
    qkv = np.random.default_rng(0).standard_normal((2, 5, 3, 4, 8)).astype(np.float16)
    q, k, v = packed.split(qkv, "qkv", 3)
    for i, x in enumerate((q, k, v)):
        assert x.shape == (2, 5, 4, 8) and np.shares_memory(x, qkv)
        assert np.array_equal(x, qkv[:, :, i])


@pytest.mark.parametrize("shape", [(2, 5, 2, 4, 8), (2, 5, 4, 8), (2, 5, 3, 4, 8, 1)])
def test_split_rejects_other_shapes(shape):
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seqlen, 3, nheads, headdim\)"):
        packed.split(np.zeros(shape, np.float16), "qkv", 3)
    with pytest.raises(ValueError, match=r"kv must be \(batch, seqlen_k, 2, nheads_k, headdim\)"):
        packed.split(np.zeros(shape + (1,) if len(shape) == 4 else shape[:2] + (3,) + shape[3:], np.float16),
                     "kv", 2)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_packed_equal_unpacked_bitwise(causal):
    import cupy as cp

    import fa2cupy

    rng = cp.random.default_rng(1)
    qkv = rng.standard_normal((2, 150, 3, 4, 64), dtype=cp.float32).astype(cp.float16)
    want = fa2cupy.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal)
    got = fa2cupy.flash_attn_qkvpacked_func(qkv, causal=causal)
    assert bool((got == want).all())
    q = rng.standard_normal((2, 70, 8, 64), dtype=cp.float32).astype(cp.float16)
    kv = rng.standard_normal((2, 150, 2, 2, 64), dtype=cp.float32).astype(cp.float16)  # GQA 4
    want = fa2cupy.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=causal, return_attn_probs=True)
    got = fa2cupy.flash_attn_kvpacked_func(q, kv, causal=causal, return_attn_probs=True)
    assert bool((got[0] == want[0]).all()) and bool((got[1] == want[1]).all()) and got[2] is None
