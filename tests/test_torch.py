"""fa2cupy.torch: the autograd wrapper (custom ops + register_autograd).

CPU tests check the plumbing (fake implementations, autograd wiring, what is saved, argument errors), with
fa2cupy's kernels replaced by the float64 reference so that they run on any machine with torch. GPU tests
(marked ``gpu``) check the real kernels: gradients equal ``fa2cupy.flash_attn_backward`` and match the float64
reference, and the op works under ``torch.compile(fullgraph=True)`` and ``torch.cuda.graph``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fa2cupy  # noqa: E402
from fa2cupy import attention, paging, reference  # noqa: E402
from fa2cupy.torch import flash_attn_func  # noqa: E402

from torch_stand_ins import (  # noqa: E402,F401 -- fixtures, and the calls they record
    _np, backward_calls, calls, cpu_kernels, cpu_varlen_kernels)

def _cpu_qkv(b=2, sq=5, sk=7, h=4, hkv=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def test_import_fa2cupy_does_not_import_the_wrappers():
    import subprocess
    import sys

    code = "import sys, fa2cupy; print('fa2cupy.torch' in sys.modules, 'fa2cupy.jax' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["False", "False"]


def test_ops_are_registered_with_schemas():
    schema = {name: str(getattr(torch.ops.fa2cupy, name).default._schema) for name in (
        "flash_attn_forward", "flash_attn_backward", "flash_attn_varlen_forward", "flash_attn_varlen_backward")}
    options = "float softmax_scale, bool causal, SymInt window_left, SymInt window_right, bool deterministic"
    dropout = "float dropout_p, SymInt dropout_seed, SymInt dropout_offset"
    kernel = "SymInt kernel_options"
    varlen = "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
    assert (f"(Tensor q, Tensor k, Tensor v, {options}, float softcap, Tensor? alibi_slopes, {dropout}, {kernel}) -> "
            "(Tensor, Tensor)") in schema["flash_attn_forward"]
    assert (f"Tensor lse, {options}, float softcap, {dropout}, Tensor? alibi_slopes, {kernel}) -> "
            "(Tensor, Tensor, Tensor)" in schema["flash_attn_backward"])
    assert (f"(Tensor q, Tensor k, Tensor v, {varlen}{options}, float softcap, Tensor? alibi_slopes, {dropout}, "
            f"Tensor? block_table, {kernel}) -> (Tensor, Tensor)") in schema["flash_attn_varlen_forward"]
    assert (f"Tensor lse, {varlen}{options}, float softcap, {dropout}, Tensor? alibi_slopes, Tensor? block_table, "
            f"{kernel}) -> (Tensor, Tensor, Tensor)") in schema["flash_attn_varlen_backward"]


#: The trailing arguments of the ops after (..., window_right, deterministic): no softcap, ALiBi or dropout, the
#: default kernel options (handle 0).
PLAIN_FWD = (0.0, None, 0.0, 0, 0, 0)
PLAIN_BWD = (0.0, 0.0, 0, 0, None, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_shapes_dtypes_strides(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 5, 4, 40, dtype=dtype)
        k = torch.empty(2, 7, 2, 40, dtype=dtype)
        # a (b, h, s, d) tensor seen as (b, s, h, d): outputs are still contiguous
        v = torch.empty(2, 2, 7, 40, dtype=dtype).transpose(1, 2)
        out, lse = torch.ops.fa2cupy.flash_attn_forward(q, k, v, 0.1, True, -1, 0, False, *PLAIN_FWD)
        assert (out.shape, out.dtype, out.stride()) == ((2, 5, 4, 40), dtype, (800, 160, 40, 1))
        assert (lse.shape, lse.dtype, lse.stride()) == ((2, 4, 5), torch.float32, (20, 5, 1))
        dq, dk, dv = torch.ops.fa2cupy.flash_attn_backward(out, q, k, v, out, lse, 0.1, True, -1, 0, False,
                                                           *PLAIN_BWD)
        assert (dq.shape, dq.dtype, dq.is_contiguous()) == (q.shape, dtype, True)
        assert (dk.shape, dk.dtype, dk.is_contiguous()) == (k.shape, dtype, True)
        assert (dv.shape, dv.dtype, dv.is_contiguous()) == (v.shape, dtype, True)


def test_fake_shapes_with_v_head_dim_of_its_own():
    """v's head dim (96) differs from q's and k's (192): out and dout have v's, dv v's shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(2, 5, 4, 192, dtype=torch.bfloat16), torch.empty(2, 7, 2, 192, dtype=torch.bfloat16)
        v = torch.empty(2, 7, 2, 96, dtype=torch.bfloat16)
        out, lse = torch.ops.fa2cupy.flash_attn_forward(q, k, v, 0.1, True, -1, 0, False, *PLAIN_FWD)
        assert out.shape == (2, 5, 4, 96) and out.is_contiguous() and lse.shape == (2, 4, 5)
        dq, dk, dv = torch.ops.fa2cupy.flash_attn_backward(out, q, k, v, out, lse, 0.1, True, -1, 0, False,
                                                           *PLAIN_BWD)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        out, lse = torch.ops.fa2cupy.flash_attn_varlen_forward(
            q[0], k[0], v[0], torch.empty(2, dtype=torch.int32), torch.empty(2, dtype=torch.int32), 5, 7, 0.1, True,
            -1, 0, False, 0.0, None, 0.0, 0, 0, None, 0)
        assert out.shape == (5, 4, 96) and lse.shape == (4, 5)


def test_gradients_with_v_head_dim_of_its_own(cpu_kernels):
    """d_qk = 16, d_v = 8 through the autograd wrapper (the float64 reference standing in for the kernels): out
    has v's head dim, the default scale is 1/sqrt(d_qk), and the gradients are the reference's."""
    q, k, _ = _cpu_qkv()
    v = torch.randn(2, 7, 2, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == (2, 5, 4, 8)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    (call,) = cpu_kernels
    assert call["softmax_scale"] == pytest.approx(0.25)
    want = reference.attention_ref_backward(_np(dout), _np(q), _np(k), _np(v), None, True)
    for got, ref in zip((q.grad, k.grad, v.grad), want):
        np.testing.assert_allclose(_np(got), ref, rtol=1e-5, atol=1e-5)


def test_fake_autograd_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.empty(s, dtype=torch.bfloat16, requires_grad=True)
                   for s in ((1, 9, 6, 64), (1, 3, 2, 64), (1, 3, 2, 64)))
        out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        assert probs is None and out.requires_grad and not lse.requires_grad
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.dtype == torch.bfloat16


def test_opcheck_with_reference_kernels(cpu_kernels):
    q, k, v = (x.detach() for x in _cpu_qkv())
    torch.library.opcheck(torch.ops.fa2cupy.flash_attn_forward.default,
                          (q, k, v, 0.25, True, 3, 0, False) + PLAIN_FWD)
    out, lse = torch.ops.fa2cupy.flash_attn_forward(q, k, v, 0.25, True, 3, 0, False, *PLAIN_FWD)
    torch.library.opcheck(torch.ops.fa2cupy.flash_attn_backward.default,
                          (torch.randn_like(out), q, k, v, out, lse, 0.25, True, 3, 0, True) + PLAIN_BWD)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_flow_through_the_backward_op(cpu_kernels, causal):
    q, k, v = _cpu_qkv()
    out = flash_attn_func(q, k, v, causal=causal, softmax_scale=0.3, deterministic=True)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    (call,) = cpu_kernels
    assert call["softmax_scale"] == 0.3 and call["causal"] is causal and call["deterministic"] is True
    assert call["dout"].stride()[-1] == 1
    want = reference.attention_ref_backward(_np(dout), _np(q), _np(k), _np(v), 0.3, causal)
    for got, ref in zip((q.grad, k.grad, v.grad), want):
        np.testing.assert_allclose(_np(got), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["qkv", "kv"])
def test_packed_forms_are_views_with_gradients_into_the_pack(cpu_kernels, form):
    # The packed inputs reach the op as strided views (no copies), and the gradient lands in the packed tensor
    # in the same slots as the unpacked gradients.
    from fa2cupy.torch import flash_attn_kvpacked_func, flash_attn_qkvpacked_func

    q, k, v = _cpu_qkv(sq=5, sk=5, hkv=4) if form == "qkv" else _cpu_qkv(hkv=4)
    if form == "qkv":
        pack = torch.stack([x.detach() for x in (q, k, v)], dim=2).requires_grad_()
        out = flash_attn_qkvpacked_func(pack, causal=True, softmax_scale=0.3)
    else:
        pack = torch.stack([x.detach() for x in (k, v)], dim=2).requires_grad_()
        out = flash_attn_kvpacked_func(q, pack, causal=True, softmax_scale=0.3)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    (call,) = cpu_kernels
    assert call["k"].data_ptr() == pack.data_ptr() + pack.stride(2) * pack.element_size() * (form == "qkv")
    want = reference.attention_ref_backward(_np(dout), _np(q), _np(k), _np(v), 0.3, True)
    grads = [pack.grad[:, :, i] for i in range(pack.shape[2])]
    if form == "kv":
        np.testing.assert_allclose(_np(q.grad), want[0], rtol=1e-5, atol=1e-5)
        want = want[1:]
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(_np(got), ref, rtol=1e-5, atol=1e-5)


def test_packed_shape_errors_name_the_argument():
    from fa2cupy.torch import flash_attn_kvpacked_func, flash_attn_qkvpacked_func

    q, k, v = _cpu_qkv()
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seqlen, 3, nheads, headdim\)"):
        flash_attn_qkvpacked_func(torch.stack([k, v], dim=2))  # two tensors packed, not three
    with pytest.raises(ValueError, match=r"kv must be \(batch, seqlen_k, 2, nheads_k, headdim\)"):
        flash_attn_kvpacked_func(q, k)


def test_window_reaches_both_ops(cpu_kernels):
    q, k, v = _cpu_qkv(sq=6, sk=9)
    out = flash_attn_func(q, k, v, window_size=(2, 1), softmax_scale=0.3)
    want_out, _ = reference.attention_ref(_np(q), _np(k), _np(v), 0.3, False, (2, 1))
    np.testing.assert_allclose(_np(out), want_out, rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    (call,) = cpu_kernels
    assert tuple(call["window_size"]) == (2, 1)
    want = reference.attention_ref_backward(_np(dout), _np(q), _np(k), _np(v), 0.3, False, (2, 1))
    for got, ref in zip((q.grad, k.grad, v.grad), want):
        np.testing.assert_allclose(_np(got), ref, rtol=1e-5, atol=1e-5)


def test_default_scale_and_expanded_dout(cpu_kernels):
    q, k, v = _cpu_qkv(d=9)
    flash_attn_func(q, k, v).sum().backward()  # autograd hands over an expanded gradient: strides all 0
    (call,) = cpu_kernels
    assert call["softmax_scale"] == pytest.approx(1 / math.sqrt(9))
    assert call["dout"].stride()[-1] == 1


# ------------------------------------------------------------------------------ varlen (and paged K/V) on CPU


@pytest.mark.parametrize("paged", [False, True])
def test_varlen_gradients_reach_packed_or_paged_keys(cpu_varlen_kernels, paged):
    from fa2cupy.torch import flash_attn_varlen_func

    g = torch.Generator().manual_seed(3)
    lengths_q, lengths_k, page_size = [4, 0, 6], [7, 3, 9], 4
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32)
    q = torch.randn(sum(lengths_q), 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths_k), 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    table = None
    if paged:  # sequence b's keys on pages table[b] of a shuffled pool (with two spare pages)
        table_h, num_pages = paging.shuffled_block_table(np.random.default_rng(0), lengths_k, page_size, spare_pages=2)
        table = torch.from_numpy(table_h)
        k_pages = torch.randn(num_pages, page_size, 2, 16, generator=g, dtype=torch.float64)
        v_pages = torch.randn(k_pages.shape, generator=g, dtype=torch.float64)
        for pages, packed in ((k_pages, k), (v_pages, v)):
            paging.write_pages(torch, pages, packed, cu_k.numpy(), table_h)
        k_in, v_in = k_pages.requires_grad_(), v_pages.requires_grad_()
    else:
        k_in, v_in = k.requires_grad_(), v.requires_grad_()
    q.requires_grad_()
    out = flash_attn_varlen_func(q, k_in, v_in, cu_q, cu_k, 6, 9, causal=True, softmax_scale=0.3, block_table=table)
    want_out, _ = reference.attention_ref_varlen(_np(q), _np(k), _np(v), cu_q.numpy(), cu_k.numpy(), 0.3, True)
    np.testing.assert_allclose(_np(out), want_out, rtol=1e-12, atol=1e-12)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * dout).sum().backward()
    (call,) = cpu_varlen_kernels
    assert call["block_table"] is table or torch.equal(call["block_table"], table)
    dq, dk, dv = reference.attention_ref_varlen_backward(_np(dout), _np(q), _np(k), _np(v), cu_q.numpy(),
                                                         cu_k.numpy(), 0.3, True)
    np.testing.assert_allclose(_np(q.grad), dq, rtol=1e-12, atol=1e-12)
    for got, want in ((k_in.grad, dk), (v_in.grad, dv)):
        if paged:  # each key's gradient lands in its page row; rows no key came from get 0
            assert got.shape == k_pages.shape
            landed = torch.zeros(k_pages.shape, dtype=torch.float64)
            for b, n in enumerate(lengths_k):
                for j in range(n):
                    landed[table[b, j // page_size], j % page_size] = torch.from_numpy(want[cu_k[b] + j])
            want = landed.numpy()
        np.testing.assert_allclose(_np(got), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", ["dense", "qkvpacked", "varlen"])
def test_dropout_forward_never_builds_probabilities(cpu_kernels, cpu_varlen_kernels, monkeypatch, form):
    # With dropout, fa2cupy.flash_attn_func(return_attn_probs=True) builds the float32 (batch, nheads, seqlen_q,
    # seqlen_k) probabilities for its caller: seqlen^2 memory and time on every training step if the autograd
    # forward asked for them. It must get (out, lse) from fa2cupy's forward_with_lse entry points instead.
    from fa2cupy.torch import flash_attn_qkvpacked_func, flash_attn_varlen_func

    probabilities = []

    def generic(*args, return_attn_probs=False, dropout_p=0.0, **kw):  # the public functions: record the request
        if return_attn_probs and dropout_p:
            probabilities.append(kw)
        raise AssertionError("the autograd forward must not call the generic forward")

    monkeypatch.setattr(fa2cupy, "flash_attn_func", generic)
    monkeypatch.setattr(fa2cupy, "flash_attn_varlen_func", generic)
    monkeypatch.setattr(fa2cupy.torch, "_draw_dropout_rng", lambda device: (5, 6))  # (torch's CUDA generator)
    q, k, v = _cpu_qkv(sq=6, sk=6, hkv=4)
    if form == "dense":
        out = flash_attn_func(q, k, v, dropout_p=0.1, causal=True)
    elif form == "qkvpacked":
        out = flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), dropout_p=0.1, causal=True)
    else:
        cu = torch.tensor([0, 6, 12], dtype=torch.int32)
        out = flash_attn_varlen_func(*(x.reshape(12, *x.shape[2:]) for x in (q, k, v)), cu, cu, 6, 6, dropout_p=0.1,
                                     causal=True)
    assert not probabilities
    assert [c["dropout_p"] for c in calls] == [0.1]  # the forward ran once, through the (out, lse) entry point
    out.sum().backward()


@pytest.mark.parametrize("varlen", [False, True])
def test_kernel_options_reach_forward_and_backward(cpu_kernels, cpu_varlen_kernels, monkeypatch, varlen):
    # The ops take a KernelOptions as its handle (an int; fa2cupy.options.handle) and hand it on, forward and
    # backward alike.
    from fa2cupy.options import KernelOptions
    from fa2cupy.torch import flash_attn_varlen_func

    seen = []

    def recording(real):
        def call(*args, kernel_options=None, **kwargs):
            seen.append(kernel_options)
            return real(*args, **kwargs)
        return call

    name = "varlen_forward_with_lse" if varlen else "forward_with_lse"
    monkeypatch.setattr(attention, name, recording(getattr(attention, name)))
    name = "flash_attn_varlen_backward" if varlen else "flash_attn_backward"
    monkeypatch.setattr(fa2cupy, name, recording(getattr(fa2cupy, name)))
    mma = KernelOptions(hopper_forward=False, hopper_backward=False)
    q, k, v = _cpu_qkv(sq=6, sk=6, hkv=4)
    if varlen:
        cu = torch.tensor([0, 6, 12], dtype=torch.int32)
        out = flash_attn_varlen_func(*(x.reshape(12, *x.shape[2:]) for x in (q, k, v)), cu, cu, 6, 6,
                                     kernel_options=mma)
    else:
        out = flash_attn_func(q, k, v, kernel_options=mma)
    out.sum().backward()
    assert seen == [mma, mma]  # the forward's, the backward's
    if not varlen:
        flash_attn_func(q, k, v)
        assert seen[-1] == KernelOptions()  # (None: the defaults)
    with pytest.raises(TypeError, match=r"^kernel_options must be a fa2cupy.KernelOptions or None, got str"):
        flash_attn_func(q, k, v, kernel_options="hopper")


@pytest.mark.parametrize("with_options", [False, True])
def test_compiles_without_graph_breaks(cpu_kernels, with_options):
    # torch.compile(fullgraph=True) traces the wrapper, the kernel_options argument included (None and a
    # KernelOptions alike), and the compiled step matches the eager one.
    from fa2cupy.options import KernelOptions

    torch._dynamo.reset()
    kw = dict(kernel_options=KernelOptions(hopper_forward=False)) if with_options else {}
    q, k, v = _cpu_qkv()

    def step(q, k, v):
        return flash_attn_func(q, k, v, causal=True, **kw).sum()

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v))


def test_saves_only_q_k_v_out_lse(cpu_kernels):
    q, k, v = _cpu_qkv()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert [tuple(t.shape) for t in saved] == [tuple(q.shape), tuple(k.shape), tuple(v.shape),
                                              tuple(out.shape), tuple(lse.shape)]
    for t, want in zip(saved, (q, k, v, out, lse)):
        assert t.data_ptr() == want.data_ptr()


def test_lse_is_not_differentiable(cpu_kernels):
    q, k, v = _cpu_qkv()
    out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True)
    assert probs is None and out.requires_grad and not lse.requires_grad
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(dropout_p=1.5), ValueError, r"^dropout_p must be in \[0, 1\)"),
    (dict(window_size=4), TypeError, r"^window_size must be a pair of ints"),
    (dict(softcap=-1.0), ValueError, r"^softcap must be a finite number >= 0"),
    (dict(alibi_slopes=[0.5] * 4), TypeError, r"^alibi_slopes must be a float32 torch.Tensor"),
    (dict(causal="yes"), TypeError, r"^causal must be a bool"),
    (dict(deterministic=None), TypeError, r"^deterministic must be a bool"),
])
def test_bad_options(cpu_kernels, kwargs, error, message):
    q, k, v = _cpu_qkv()
    with pytest.raises(error, match=message):
        flash_attn_func(q, k, v, **kwargs)


def test_defaults_in_other_spellings_are_accepted(cpu_kernels):
    q, k, v = _cpu_qkv()
    flash_attn_func(q, k, v, dropout_p=0, window_size=[-1, -1], softcap=0, causal=np.bool_(True), deterministic=1)


def test_cpu_tensors_get_fa2cupys_error():
    q, k, v = (x.to(torch.float16) for x in _cpu_qkv())
    with pytest.raises(ValueError, match=r"^q is a PyTorch tensor on the CPU; fa2cupy runs on a CUDA GPU"):
        flash_attn_func(q, k, v)


# ============================================================================== GPU

gpu = pytest.mark.gpu

#: Unit roundoff of the input dtypes.
_U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _cuda_unavailable():
    if not torch.cuda.is_available():
        return "needs a CUDA build of torch and a GPU"
    return None


needs_torch_cuda = pytest.mark.skipif(_cuda_unavailable() is not None, reason=str(_cuda_unavailable()))


def _gpu_qkv(b=2, sq=128, sk=128, h=4, hkv=4, d=64, dtype=torch.float16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, device="cuda", dtype=torch.float32).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=g, device="cuda", dtype=torch.float32).to(dtype)
    v = torch.randn(b, sk, hkv, d, generator=g, device="cuda", dtype=torch.float32).to(dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def _grads(q, k, v, dout, **kw):
    for x in (q, k, v):
        x.grad = None
    out = flash_attn_func(q, k, v, **kw)
    (out * dout).sum().backward()
    return out, [x.grad.clone() for x in (q, k, v)]


def _assert_close_to_reference(grads, dout, q, k, v, softmax_scale=None, causal=False):
    # The shared backward rule (fa2cupy.testing.gradient_errors): float64 gradients for the out the kernel
    # computed, 16 u max|ref| plus a floor for gradients that are exactly 0 (e.g. one visible key per row).
    from fa2cupy import testing

    out = fa2cupy.flash_attn_func(q.detach(), k.detach(), v.detach(), softmax_scale=softmax_scale, causal=causal)
    dtype = str(q.dtype).rpartition(".")[2]
    for name, err, bound in testing.gradient_errors([_np(g) for g in grads], _np(dout), _np(q), _np(k), _np(v),
                                                    _np(out), dtype, softmax_scale, causal):
        assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g}"


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_gradients_equal_flash_attn_backward(dtype, causal, deterministic):
    q, k, v = _gpu_qkv(sq=200, sk=333, h=6, hkv=2, d=64, dtype=dtype)  # GQA, sq != sk
    dout = torch.randn(q.shape, device="cuda", dtype=dtype)
    out, grads = _grads(q, k, v, dout, causal=causal, deterministic=deterministic)
    o2, lse, _ = fa2cupy.flash_attn_func(*(x.detach() for x in (q, k, v)), causal=causal, return_attn_probs=True)
    assert torch.equal(out, o2)
    want = fa2cupy.flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), o2, lse, causal=causal,
                                       deterministic=deterministic)
    for got, w in zip(grads, want):
        if deterministic:
            assert torch.equal(got, w)
        else:  # fp32 atomics in dq may add in another order
            torch.testing.assert_close(got, w, rtol=2 * _U[dtype], atol=1e-3)
    _assert_close_to_reference(grads, dout, q, k, v, causal=causal)


@gpu
@needs_torch_cuda
def test_gpu_deterministic_is_bitwise_reproducible():
    q, k, v = _gpu_qkv(sq=300, sk=300, h=8, hkv=2, d=128, dtype=torch.bfloat16)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    _, first = _grads(q, k, v, dout, causal=True, deterministic=True)
    for _ in range(3):
        _, again = _grads(q, k, v, dout, causal=True, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("sq,sk,h,hkv,d", [(1, 1, 1, 1, 8), (77, 513, 8, 1, 128), (513, 77, 4, 2, 96),
                                           (130, 130, 3, 3, 40), (64, 256, 2, 1, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_against_reference(sq, sk, h, hkv, d, causal):
    q, k, v = _gpu_qkv(b=1, sq=sq, sk=sk, h=h, hkv=hkv, d=d, dtype=torch.float16, seed=sq + sk)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    scale = 0.7 / math.sqrt(d)
    _, grads = _grads(q, k, v, dout, causal=causal, softmax_scale=scale)
    _assert_close_to_reference(grads, dout, q, k, v, softmax_scale=scale, causal=causal)


@gpu
@needs_torch_cuda
def test_gpu_non_contiguous_inputs():
    b, s, h, d = 2, 150, 4, 64
    base = [torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    q, k, v = (x.transpose(1, 2) for x in base)  # (b, s, h, d) views of (b, h, s, d) memory
    assert not q.is_contiguous()
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
    out = flash_attn_func(q, k, v, causal=True)
    (out * dout).sum().backward()
    qc, kc, vc = (x.detach().contiguous().requires_grad_() for x in (q, k, v))
    out_c, grads_c = _grads(qc, kc, vc, dout.contiguous(), causal=True, deterministic=True)
    torch.testing.assert_close(out, out_c, rtol=0, atol=0)
    for x, gc in zip(base, grads_c):
        assert x.grad.shape == (b, h, s, d)
        torch.testing.assert_close(x.grad.transpose(1, 2), gc, rtol=2e-2, atol=2e-2)
    _assert_close_to_reference([x.grad.transpose(1, 2) for x in base], dout, q, k, v, causal=True)


@gpu
@needs_torch_cuda
def test_gpu_saved_tensors_are_q_k_v_out_lse():
    q, k, v = _gpu_qkv()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = flash_attn_func(q, k, v)
    assert len(saved) == 5
    assert [t.data_ptr() for t in saved[:4]] == [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()]
    assert saved[4].shape == (2, 4, 128) and saved[4].dtype == torch.float32
    extra = sum(t.numel() * t.element_size() for t in saved[3:])
    assert extra == out.numel() * 2 + 2 * 4 * 128 * 4  # out + lse: no seqlen^2 probabilities


@gpu
@needs_torch_cuda
def test_gpu_dropout_training_step_memory_is_linear_in_seqlen():
    # A training step with dropout at seqlen 8k allocates what its outputs and workspaces need, O(seqlen): no
    # (batch, nheads, seqlen_q, seqlen_k) probabilities (1 GiB here, 128x the bound) through torch's allocator or
    # CuPy's pool. The pool keeps freed blocks, so its total after the step bounds whatever went through it.
    import cupy

    b, s, h, d = 1, 8192, 4, 128
    q, k, v = _gpu_qkv(b=b, sq=s, sk=s, h=h, hkv=h, d=d, dtype=torch.bfloat16)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def step():
        for x in (q, k, v):
            x.grad = None
        out = flash_attn_func(q, k, v, dropout_p=0.1, causal=True)
        torch.cuda.synchronize()
        forward_peak = torch.cuda.max_memory_allocated() - base
        out.backward(dout)
        torch.cuda.synchronize()
        return forward_peak, torch.cuda.max_memory_allocated() - base

    base = torch.cuda.memory_allocated()
    step()  # compiles and plans (the kernel cache's and the device-error report's memory are made once)
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    for x in (q, k, v):
        x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    forward_peak, step_peak = step()
    linear = b * s * h * d * 2  # one (b, s, h, d) bf16 array: 8 MiB
    assert forward_peak <= 2 * linear, forward_peak  # out and lse (and a tile counter)
    assert step_peak <= 8 * linear, step_peak  # + dq, dk, dv, the fp32 dQ accumulator and row sums
    assert pool.total_bytes() <= 1 << 20, pool.total_bytes()  # torch callers' memory all comes from torch


@gpu
@needs_torch_cuda
def test_gpu_torch_compile_fullgraph():
    q, k, v = _gpu_qkv(sq=96, sk=160, h=4, hkv=2, d=64, dtype=torch.bfloat16)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def step(q, k, v, dout):
        out = flash_attn_func(q, k, v, causal=True)
        return (out.float() * dout.float()).sum()

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(q, k, v, dout)
    grads = torch.autograd.grad(loss, (q, k, v))
    loss_e = step(q, k, v, dout)
    grads_e = torch.autograd.grad(loss_e, (q, k, v))
    torch.testing.assert_close(loss, loss_e)
    for g, ge in zip(grads, grads_e):
        torch.testing.assert_close(g, ge, rtol=2e-2, atol=2e-2)


@gpu
@needs_torch_cuda
def test_gpu_cuda_graph_capture_forward_backward():
    q, k, v = _gpu_qkv(sq=128, sk=192, h=4, hkv=2, d=64, dtype=torch.float16)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def step():
        for x in (q, k, v):
            x.grad = None
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        (out * dout).sum().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, fills the caches
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    static_grads = (q.grad, k.grad, v.grad)

    g = torch.Generator(device="cuda").manual_seed(123)
    with torch.no_grad():
        for x in (q, k, v, dout):
            x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()

    qe, ke, ve = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out_e, grads_e = _grads(qe, ke, ve, dout, causal=True, deterministic=True)
    assert torch.equal(static_out, out_e)
    for a, b in zip(static_grads, grads_e):
        assert torch.equal(a, b)
