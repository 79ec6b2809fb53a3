"""v with a head dim of its own (q, k: ``(..., d_qk)``, v: ``(..., d_v)``, output ``(..., d_v)``) on a GPU, forward
and backward, padded and varlen, fa2cupy's functions and the torch wrapper: every result matches the float64
reference, outputs poisoned before each launch. The kernels run on one head dim, the larger of the two padded to a
multiple of 8 (the narrower arrays zero-padded to it, the outputs sliced back), so any pair of 1..256 works on
every GPU; the default softmax scale is 1 / sqrt(d_qk).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from fa2cupy import testing
from fa2cupy.reference import (attention_ref, attention_ref_backward, attention_ref_varlen,
                               attention_ref_varlen_backward)
from gpu_helpers import cu_seqlens, cupy_module, debug_poison, fa2cupy_module, torch_cuda
from test_varlen_mods_gpu import _randn

pytestmark = pytest.mark.gpu

EXAMPLES = max(10, settings().max_examples // 4)
PAIRS = [(192, 128), (128, 64), (64, 128), (96, 64), (256, 128), (40, 24), (8, 256)]


@pytest.fixture(autouse=True, scope="module")
def poison_outputs():
    with debug_poison():
        yield


def run_case(b, sq, sk, h, hkv, d, dv, causal, window=(-1, -1), dtype="bfloat16", seed=0, softcap=0.0):
    """Forward and backward of one case against the reference (testing's bounds)."""
    fa = fa2cupy_module()
    rng = np.random.default_rng(seed)
    q, k = _randn(rng, (b, sq, h, d), dtype), _randn(rng, (b, sk, hkv, d), dtype)
    v, dout = _randn(rng, (b, sk, hkv, dv), dtype), _randn(rng, (b, sq, h, dv), dtype)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert out.shape == (b, sq, h, dv) and lse.shape == (b, h, sq)
    host = [testing.to_numpy64(x) for x in (q, k, v, dout, out)]
    ref, ref_lse = attention_ref(*host[:3], **kw)
    testing.assert_attention_close(out, ref, dtype, lse=lse, ref_lse=ref_lse)
    grads = fa.flash_attn_backward(dout, q, k, v, out, lse, **kw)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    # (with a softcap: the exact gradients for the given out; testing's correction for a rounded out has none)
    ref_grads = attention_ref_backward(host[3], *host[:3], None, causal, window, softcap,
                                       out=host[4]) if softcap else None
    testing.assert_gradients_close(grads, host[3], *host[:3], host[4], dtype, causal=causal, window_size=window,
                                   ref_grads=ref_grads)


@pytest.mark.parametrize("d,dv", PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_pairs_match_reference(d, dv, causal):
    run_case(2, 200, 260, 4, 2, d, dv, causal, seed=d + dv)


def test_window_softcap_and_sq_above_sk():
    run_case(1, 300, 150, 2, 1, 192, 128, True, seed=1)
    run_case(1, 250, 250, 4, 4, 192, 128, False, window=(40, 8), seed=2)
    run_case(1, 130, 140, 2, 2, 128, 64, True, softcap=5.0, seed=3, dtype="float16")


@settings(max_examples=EXAMPLES, deadline=None)
@given(d=st.integers(1, 256), dv=st.integers(1, 256), causal=st.booleans(), group=st.sampled_from([1, 2]),
       sq=st.sampled_from([1, 17, 64, 129]), sk=st.sampled_from([1, 33, 128, 200]), seed=st.integers(0, 2**31))
def test_any_pair(d, dv, causal, group, sq, sk, seed):
    note(dict(d=d, dv=dv, causal=causal, group=group, sq=sq, sk=sk))
    run_case(1, sq, sk, 2 * group, 2, d, dv, causal, seed=seed)


@pytest.mark.parametrize("d,dv", [(192, 128), (64, 128)])
def test_varlen(d, dv):
    """Packed sequences (an empty one, one row, ragged ends): out and gradients match the reference over the rows
    of every sequence; rows past the last sequence get zero gradients."""
    cp = cupy_module()
    fa = fa2cupy_module()
    rng = np.random.default_rng(d + dv)
    lengths = [70, 0, 1, 200]
    cu = cu_seqlens(lengths)
    total = int(cu[-1]) + 3
    q, k = _randn(rng, (total, 4, d), "bfloat16"), _randn(rng, (total, 2, d), "bfloat16")
    v, dout = _randn(rng, (total, 2, dv), "bfloat16"), _randn(rng, (total, 4, dv), "bfloat16")
    cu_d = cp.asarray(cu)
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu_d, cu_d, 200, 200, causal=True, return_attn_probs=True)
    assert out.shape == (total, 4, dv)
    host = [testing.to_numpy64(x) for x in (q, k, v, dout, out)]
    ref, _ = attention_ref_varlen(*host[:3], cu, cu, causal=True)
    rows = slice(0, int(cu[-1]))
    assert np.abs(host[4][rows] - ref[rows]).max() <= testing.out_bound("bfloat16", np.abs(ref).max())
    grads = fa.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_d, cu_d, 200, 200, causal=True)
    refs = attention_ref_varlen_backward(host[3], *host[:3], cu, cu, causal=True, out=host[4])
    floor = testing.gradient_floor(1 / math.sqrt(d), max(d, dv), np.abs(host[3]).max(), np.abs(host[2]).max(),
                                   max(np.abs(host[0]).max(), np.abs(host[1]).max()))
    for name, g, r in zip("qkv", grads, refs):
        g = testing.to_numpy64(g)
        assert g.shape == r.shape
        err = np.abs(g[rows] - r[rows]).max()
        assert err <= testing.gradient_bound("bfloat16", np.abs(r).max(), floor), f"d{name}: {err:.3g}"
        assert np.all(g[int(cu[-1]):] == 0.0)


def test_torch_autograd():
    """fa2cupy.torch: out with v's head dim, gradients equal to fa2cupy.flash_attn_backward's bitwise
    (deterministic), under torch.compile too."""
    torch = torch_cuda()
    import fa2cupy
    from fa2cupy.torch import flash_attn_func

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(s, generator=g, device="cuda").bfloat16().requires_grad_() for s in ((2, 300, 8, 192),
                                                                                              (2, 300, 2, 192)))
    v = torch.randn(2, 300, 2, 128, generator=g, device="cuda").bfloat16().requires_grad_()
    for fn in (flash_attn_func, torch.compile(flash_attn_func, fullgraph=True)):
        for x in (q, k, v):
            x.grad = None
        out = fn(q, k, v, causal=True, deterministic=True)
        assert out.shape == (2, 300, 8, 128)
        dout = torch.randn_like(out)
        (out * dout).sum().backward()
        o, lse, _ = fa2cupy.flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True, return_attn_probs=True)
        assert torch.equal(o, out)
        want = fa2cupy.flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), o, lse, causal=True,
                                           deterministic=True)
        for got, ref in zip((q.grad, k.grad, v.grad), want):
            assert torch.equal(got, ref)
