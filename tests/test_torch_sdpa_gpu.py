"""fa2cupy as torch SDPA's flash-attention implementation, on a GPU (every test marked ``gpu``).

With ``torch.nn.attention.activate_flash_attention_impl("fa2cupy")``, SDPA on its flash backend must give bit for
bit what fa2cupy's own autograd wrapper gives on the transposed views (forward and gradients), eagerly and under
``torch.compile``, for causal, GQA, dropout and torch's varlen API; torch's own kernel agrees with it within rounding
(the lse's layout and units included); ``restore_flash_attention_impl()`` brings torch's kernel back. Outputs are
poisoned with NaN before each launch (KernelOptions.debug_poison), inputs are fresh random tensors. The backward
comparisons run with torch's deterministic algorithms on, so dQ is summed in a fixed order on both sides.
"""

from __future__ import annotations

import inspect

import pytest

from gpu_helpers import torch_cuda

pytestmark = pytest.mark.gpu


@pytest.fixture
def torch():
    return torch_cuda()


@pytest.fixture
def sdpa(torch, monkeypatch):
    """The module, activated for the test with poisoned outputs; restored afterwards. Also yields the poisoning
    KernelOptions for the direct calls."""
    from fa2cupy import KernelOptions
    from fa2cupy.integrations import torch_sdpa

    poison = KernelOptions(debug_poison=True)
    monkeypatch.setattr(torch_sdpa, "_KERNEL_OPTIONS", poison)
    torch.nn.attention.activate_flash_attention_impl("fa2cupy")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield torch_sdpa, poison
    finally:
        torch.use_deterministic_algorithms(was)
        torch.nn.attention.restore_flash_attention_impl()


def _qkv(torch, b=2, h=8, hkv=8, sq=256, sk=256, d=64, dtype=None):
    dtype = dtype or torch.float16
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype).transpose(1, 2)  # (b, h, s, d) over a (b, s, h, d) buffer
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype).transpose(1, 2)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype).transpose(1, 2)
    return [x.requires_grad_() for x in (q, k, v)]


def _flash(torch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _run_sdpa(torch, q, k, v, dout, fn=None, **kw):
    fn = fn or torch.nn.functional.scaled_dot_product_attention
    for x in (q, k, v):
        x.grad = None
    with _flash(torch):
        out = fn(q, k, v, **kw)
    out.backward(dout)
    return out.detach(), [x.grad.clone() for x in (q, k, v)]


def _run_direct(torch, q, k, v, dout, poison, causal=False, dropout_p=0.0, scale=None):
    import fa2cupy.torch

    for x in (q, k, v):
        x.grad = None
    out = fa2cupy.torch.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
                                        softmax_scale=scale, causal=causal, deterministic=True,
                                        kernel_options=poison).transpose(1, 2)
    out.backward(dout)
    return out.detach(), [x.grad.clone() for x in (q, k, v)]


def _assert_bitwise(torch, got, want):
    (out, grads), (want_out, want_grads) = got, want
    assert not out.isnan().any()
    assert torch.equal(out, want_out)
    for name, g, w in zip("qkv", grads, want_grads):
        assert not g.isnan().any(), f"d{name} has NaN (an element the backward did not write)"
        assert torch.equal(g, w), f"d{name} differs"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [8, 2])
def test_sdpa_equals_fa2cupy_bitwise(torch, sdpa, dtype, causal, hkv):
    _, poison = sdpa
    q, k, v = _qkv(torch, hkv=hkv, sq=200, sk=200, dtype=getattr(torch, dtype))
    dout = torch.randn_like(q)
    got = _run_sdpa(torch, q, k, v, dout, is_causal=causal, enable_gqa=hkv != 8)
    _assert_bitwise(torch, got, _run_direct(torch, q, k, v, dout, poison, causal=causal))


def test_sdpa_scale_and_non_square(torch, sdpa):
    _, poison = sdpa
    q, k, v = _qkv(torch, sq=100, sk=333, d=128, dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    got = _run_sdpa(torch, q, k, v, dout, scale=0.05)
    _assert_bitwise(torch, got, _run_direct(torch, q, k, v, dout, poison, scale=0.05))


def test_sdpa_bhsd_contiguous_inputs_get_meta_strides(torch, sdpa):
    # a truly (b, h, s, d)-contiguous query: the output is copied into that layout, as torch's meta function says
    _, poison = sdpa
    q, k, v = (x.detach().contiguous().requires_grad_() for x in _qkv(torch))
    dout = torch.randn_like(q)
    got = _run_sdpa(torch, q, k, v, dout)
    assert got[0].stride() == q.stride() and all(g.stride() == x.stride() for g, x in zip(got[1], (q, k, v)))
    _assert_bitwise(torch, got, _run_direct(torch, q, k, v, dout, poison))


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_under_torch_compile(torch, sdpa, causal):
    _, poison = sdpa
    torch._dynamo.reset()
    q, k, v = _qkv(torch, hkv=2, dtype=torch.bfloat16)
    dout = torch.randn_like(q)

    @torch.compile(fullgraph=True)
    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    got = _run_sdpa(torch, q, k, v, dout, fn=lambda q, k, v, **kw: attend(q, k, v))
    _assert_bitwise(torch, got, _run_direct(torch, q, k, v, dout, poison, causal=causal))


def test_sdpa_dropout_equals_fa2cupy_with_the_same_generator_state(torch, sdpa):
    # forward and backward regenerate one mask: the gradients equal those of fa2cupy's wrapper, whose backward reads
    # the seed and offset it drew itself; here they travel through aten's rng_state
    _, poison = sdpa
    q, k, v = _qkv(torch, hkv=4, dtype=torch.float16)
    dout = torch.randn_like(q)
    torch.manual_seed(1234)
    got = _run_sdpa(torch, q, k, v, dout, dropout_p=0.3, enable_gqa=True)
    torch.manual_seed(1234)
    want = _run_direct(torch, q, k, v, dout, poison, dropout_p=0.3)
    _assert_bitwise(torch, got, want)
    torch.manual_seed(1234)
    again = _run_sdpa(torch, q, k, v, dout, dropout_p=0.3, enable_gqa=True)
    _assert_bitwise(torch, again, want)
    dropped = _run_sdpa(torch, q, k, v, dout, dropout_p=0.3, enable_gqa=True)  # the generator moved on
    assert not torch.equal(dropped[0], want[0])


def test_sdpa_dropout_under_torch_compile(torch, sdpa):
    _, poison = sdpa
    torch._dynamo.reset()
    q, k, v = _qkv(torch, dtype=torch.bfloat16)
    dout = torch.randn_like(q)

    @torch.compile(fullgraph=True)
    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.2)

    torch.manual_seed(7)
    got = _run_sdpa(torch, q, k, v, dout, fn=lambda q, k, v, **kw: attend(q, k, v))
    torch.manual_seed(7)
    _assert_bitwise(torch, got, _run_direct(torch, q, k, v, dout, poison, dropout_p=0.2))


def test_lse_layout_and_units_match_torchs_kernel(torch, sdpa):
    torch_sdpa, _ = sdpa
    q, k, v = (x.detach() for x in _qkv(torch, sq=300, sk=300, dtype=torch.float16))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[:2]
    torch.nn.attention.restore_flash_attention_impl()
    try:
        ref_out, ref_lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[:2]
    finally:
        torch.nn.attention.activate_flash_attention_impl("fa2cupy")
    assert lse.shape == ref_lse.shape and lse.dtype == ref_lse.dtype and lse.stride() == ref_lse.stride()
    assert out.stride() == ref_out.stride()
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=2e-3)


def test_restore_brings_back_torchs_kernel(torch, sdpa, monkeypatch):
    torch_sdpa, _ = sdpa
    from fa2cupy import attention

    seen = []
    real = attention.forward_with_lse
    monkeypatch.setattr(attention, "forward_with_lse", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    q, k, v = (x.detach() for x in _qkv(torch))
    with _flash(torch):
        ours = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert len(seen) == 1
    torch.nn.attention.restore_flash_attention_impl()
    try:
        assert "torch_sdpa.py" not in torch._C._dispatch_dump("aten::_scaled_dot_product_flash_attention")
        with _flash(torch):
            theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        assert len(seen) == 1  # torch's kernel ran
    finally:
        torch.nn.attention.activate_flash_attention_impl("fa2cupy")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3)


def _varlen_module(torch):
    return pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no torch.nn.attention.varlen")


@pytest.mark.parametrize("causal", [False, True])
def test_torch_varlen_attn_equals_fa2cupy_varlen(torch, sdpa, causal):
    import fa2cupy.torch

    _, poison = sdpa
    varlen = _varlen_module(torch)
    params = inspect.signature(varlen.varlen_attn).parameters
    lengths = [37, 0, 128, 250]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    total, hkv = sum(lengths), (2 if "enable_gqa" in params else 8)
    q = torch.randn(total, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(total, hkv, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    kw = {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kw["is_causal"] = causal
    if hkv != 8:
        kw["enable_gqa"] = True

    def run(fn):
        for x in (q, k, v):
            x.grad = None
        out = fn()
        out.backward(dout)
        return out.detach(), [x.grad.clone() for x in (q, k, v)]

    got = run(lambda: varlen.varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), **kw))
    want = run(lambda: fa2cupy.torch.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                                            causal=causal, deterministic=True,
                                                            kernel_options=poison))
    _assert_bitwise(torch, got, want)


def test_debug_mask_is_refused(torch, sdpa):
    q, k, v = (x.detach() for x in _qkv(torch))
    with pytest.raises(NotImplementedError, match="return_debug_mask"):
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, True)
