"""fa2cupy.integrations.torch_sdpa: fa2cupy as torch SDPA's flash-attention implementation, on the CPU.

The registration with torch's registry (listed, never active after import, activate/restore round-trips), the
schemas of the aten ops it overrides against its functions' signatures (a torch release that changes them fails
here), and the mapping of each op's arguments onto fa2cupy's generic functions, with those functions replaced by
float64 reference stand-ins (fa2cupy.reference) so the mapping's outputs, lse layout and gradients can be compared
with ``torch.nn.functional.scaled_dot_product_attention`` in float64. The varlen and autograd paths also run through
the dispatcher, with the mapping registered on the CPU key for the test's duration. The GPU tests are in
test_torch_sdpa_gpu.py.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.nn.attention, "register_flash_attention_impl"):
    pytest.skip(f"torch {torch.__version__} has no flash-attention registry (torch.nn.attention."
                f"register_flash_attention_impl)", allow_module_level=True)

import fa2cupy  # noqa: E402
import fa2cupy.torch  # noqa: E402
from fa2cupy import attention, reference  # noqa: E402
from fa2cupy.integrations import torch_sdpa  # noqa: E402

F = torch.nn.functional
A = torch.nn.attention

# ============================================================================== registration


def test_import_registers_without_activating():
    code = ("import torch, fa2cupy.integrations.torch_sdpa as m; a = torch.nn.attention; "
            "print(m.IMPL_NAME in a.list_flash_attention_impls(), a.current_flash_attention_impl())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["True", "None"]
    assert "fa2cupy" in A.list_flash_attention_impls()


def _cuda_kernels() -> dict:
    return {name: torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CUDA")
            for name in torch_sdpa.overridden_ops()}


def test_activate_and_restore_round_trip():
    assert A.current_flash_attention_impl() is None
    before = _cuda_kernels()
    dumps = {name: torch._C._dispatch_dump(f"aten::{name}") for name in before}
    A.activate_flash_attention_impl("fa2cupy")
    try:
        assert A.current_flash_attention_impl() == "fa2cupy"
        for name in before:
            assert "torch_sdpa.py" in torch._C._dispatch_dump(f"aten::{name}"), name
        # the fp8 overloads stay torch's
        assert "torch_sdpa.py" not in torch._C._dispatch_dump("aten::_flash_attention_forward.quantized")
    finally:
        A.restore_flash_attention_impl()
    assert A.current_flash_attention_impl() is None
    assert _cuda_kernels() == before
    assert {name: torch._C._dispatch_dump(f"aten::{name}") for name in before} == dumps
    # and again: a second activation registers anew
    A.activate_flash_attention_impl("fa2cupy")
    A.restore_flash_attention_impl()
    assert _cuda_kernels() == before


def test_handle_remove_is_idempotent():
    handle = torch_sdpa.register()
    handle.remove()
    handle.remove()
    assert handle.library is None


def test_import_error_names_the_torch_version_needed():
    code = ("import torch.nn.attention as a; del a.register_flash_attention_impl\n"
            "try:\n    import fa2cupy.integrations.torch_sdpa\nexcept ImportError as e:\n    print(e)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "needs torch >= 2.11 (torch.nn.attention.register_flash_attention_impl)" in res.stdout
    assert res.stdout.count("\n") == 1


# ============================================================================== schemas

#: The returns of each overridden op, as the implementations return them.
RETURNS = {
    "_scaled_dot_product_flash_attention": 9,
    "_scaled_dot_product_flash_attention_backward": 3,
    "_flash_attention_forward": 5,
    "_flash_attention_forward_no_dropout_inplace": 1,
    "_flash_attention_backward": 3,
}


@pytest.mark.parametrize("name", sorted(torch_sdpa.overridden_ops()))
def test_aten_schema_matches_the_implementation(name):
    schema = getattr(torch.ops.aten, name).default._schema
    params = inspect.signature(torch_sdpa.overridden_ops()[name]).parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword = {p.name: p for p in params if p.kind is p.KEYWORD_ONLY}
    assert [a.name for a in schema.arguments if not a.kwarg_only] == positional, str(schema)
    schema_keywords = [a.name for a in schema.arguments if a.kwarg_only]
    assert set(schema_keywords) <= set(keyword), f"arguments the implementation does not take: {schema}"
    # keywords a newer torch has and this one lacks must be optional
    assert all(keyword[n].default is None for n in keyword), keyword
    assert len(schema.returns) == RETURNS[name], str(schema)


def test_the_core_ops_are_overridden():
    assert {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
            "_flash_attention_forward", "_flash_attention_backward"} <= set(torch_sdpa.overridden_ops())


# ============================================================================== reference stand-ins

SEED, OFFSET = -5, 16  # what the patched generator hands out (signed int64s, as torch's state holds them)

calls: list = []


def _np(t):
    return t.detach().to(torch.float64).cpu().numpy()


def _seed_offset(kw):
    state = kw.get("dropout_rng_state")
    if state is not None:
        lo_hi = [int(x) for x in state.to(torch.int64)]
        return lo_hi[0] | lo_hi[1] << 32, lo_hi[2] | lo_hi[3] << 32
    return kw["dropout_seed"], kw["dropout_offset"]


def _mask(kw, shape):
    """The stand-ins' keep mask, a function of (seed, offset) only: the backward must see the forward's."""
    if not kw.get("dropout_p"):
        return None
    seed, offset = _seed_offset(kw)
    return np.random.default_rng([seed, offset]).random(shape) >= kw["dropout_p"]


def _forward(q, k, v, **kw):
    calls.append(("forward", kw))
    b, sq, h, _ = q.shape
    mask = _mask(kw, (b, h, sq, k.shape[1]))
    out, lse = reference.attention_ref(_np(q), _np(k), _np(v), kw["softmax_scale"], kw["causal"], kw["window_size"],
                                       alibi_slopes=None if kw["alibi_slopes"] is None else _np(kw["alibi_slopes"]),
                                       dropout_p=kw["dropout_p"], dropout_mask=mask)
    return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).to(torch.float32)


def _backward(dout, q, k, v, out, lse, **kw):
    calls.append(("backward", kw))
    b, sq, h, _ = q.shape
    mask = _mask(kw, (b, h, sq, k.shape[1]))
    grads = reference.attention_ref_backward(_np(dout), _np(q), _np(k), _np(v), kw["softmax_scale"], kw["causal"],
                                             kw["window_size"], dropout_p=kw["dropout_p"], dropout_mask=mask)
    return tuple(torch.from_numpy(g).to(x.dtype) for g, x in zip(grads, (q, k, v)))


def _varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    calls.append(("varlen_forward", dict(kw, cu_k=cu_k, max_q=max_q, max_k=max_k)))
    assert kw["block_table"] is None and not kw["dropout_p"]
    out, lse = reference.attention_ref_varlen(_np(q), _np(k), _np(v), cu_q.numpy(), cu_k.numpy(),
                                              kw["softmax_scale"], kw["causal"], kw["window_size"])
    return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).to(torch.float32)


def _varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, **kw):
    calls.append(("varlen_backward", kw))
    grads = reference.attention_ref_varlen_backward(_np(dout), _np(q), _np(k), _np(v), cu_q.numpy(), cu_k.numpy(),
                                                    kw["softmax_scale"], kw["causal"], kw["window_size"])
    return tuple(torch.from_numpy(g).to(x.dtype) for g, x in zip(grads, (q, k, v)))


@pytest.fixture
def stand_ins(monkeypatch):
    """fa2cupy's generic functions replaced by the float64 reference, the CUDA/half-precision check by a no-op and
    torch's CUDA generator by a fixed (seed, offset); returns the stand-ins' calls."""
    calls.clear()
    monkeypatch.setattr(attention, "forward_with_lse", _forward)
    monkeypatch.setattr(attention, "varlen_forward_with_lse", _varlen_forward)
    monkeypatch.setattr(fa2cupy, "flash_attn_backward", _backward, raising=False)
    monkeypatch.setattr(fa2cupy, "flash_attn_varlen_backward", _varlen_backward, raising=False)
    monkeypatch.setattr(torch_sdpa, "_check_inputs", lambda op, *tensors: None)
    monkeypatch.setattr(fa2cupy.torch, "_draw_dropout_rng", lambda device: (SEED, OFFSET))
    return calls


def _bhsd(b=2, h=4, hkv=2, sq=6, sk=6, d=8, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def _sdpa_grads(q, k, v, dout, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)
    out.backward(dout)
    return out.detach(), (q.grad, k.grad, v.grad)


def _scores(q, k, scale):
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (q @ kk.transpose(-1, -2)) * scale


# ============================================================================== SDPA ops: mapping


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_sdpa_forward_and_backward_match_torch(stand_ins, causal, scale, heads):
    q, k, v = _bhsd(h=heads[0], hkv=heads[1], sq=7, sk=7 if causal else 9)
    dout = torch.randn_like(q)
    res = torch_sdpa.sdpa_flash_forward(q, k, v, 0.0, causal, False, scale=scale)
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, debug = res
    want, grads = _sdpa_grads(q, k, v, dout, is_causal=causal, scale=scale)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert out.shape == q.shape and out.stride() == q.stride()
    # lse: float32 (batch, heads, seq_q), natural log, unpadded
    s = _scores(q, k, scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        s = s.masked_fill(torch.ones(7, 7, dtype=torch.bool).tril().logical_not(), float("-inf"))
    assert lse.dtype == torch.float32 and lse.shape == (2, heads[0], 7) and lse.is_contiguous()
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).float())
    assert (cum_q, cum_k, max_q, max_k) == (None, None, 7, k.shape[2])
    assert rng_state.dtype == torch.uint64 and rng_state.shape == (2,)
    assert unused.dtype == torch.uint64 and unused.shape == ()
    assert debug.numel() == 0 and debug.dtype == q.dtype
    kw = stand_ins[-1][1]
    assert kw["softmax_scale"] == scale and kw["causal"] is causal and kw["window_size"] == (-1, -1)
    assert kw["dropout_p"] == 0.0 and "dropout_seed" not in kw

    dq, dk, dv = torch_sdpa.sdpa_flash_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal,
                                                rng_state, unused, scale=scale)
    for got, ref, x in zip((dq, dk, dv), grads, (q, k, v)):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
        assert got.shape == x.shape and got.stride() == x.stride()
    kw = stand_ins[-1][1]
    assert kw["causal"] is causal and kw["softmax_scale"] == scale and kw["dropout_p"] == 0.0
    assert kw["deterministic"] is False


def test_sdpa_layouts_follow_the_meta_functions(stand_ins):
    # q from a (b, s, h, d) buffer (the usual projection output) and one truly (b, h, s, d) contiguous: outputs and
    # gradients have empty_like(input)'s strides either way, as torch's meta functions say
    bshd = torch.randn(2, 6, 4, 8, dtype=torch.float64).transpose(1, 2)
    _, k, v = _bhsd()
    for q in (bshd, bshd.contiguous()):
        out, lse, *rest = torch_sdpa.sdpa_flash_forward(q, k, v)
        meta_out, meta_lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention.default(
            *(x.to("meta") for x in (q, k, v)))
        assert out.stride() == meta_out.stride() and lse.stride() == meta_lse.stride()
        dout = torch.randn_like(out)
        grads = torch_sdpa.sdpa_flash_backward(dout, q, k, v, out, lse, None, None, 6, 6, 0.0, False, rest[4],
                                               rest[5])
        metas = torch.ops.aten._scaled_dot_product_flash_attention_backward.default(
            *(x.to("meta") for x in (dout, q, k, v, out, lse)), None, None, 6, 6, 0.0, False,
            *(x.to("meta") for x in rest[4:6]))
        assert [g.stride() for g in grads] == [m.stride() for m in metas]


def test_sdpa_dropout_forward_and_backward_share_the_mask(stand_ins):
    q, k, v = _bhsd(h=4, hkv=2)
    dout = torch.randn_like(q)
    p = 0.25
    out, lse, _, _, max_q, max_k, rng_state, unused, _ = torch_sdpa.sdpa_flash_forward(q, k, v, p, False, False)
    fwd = stand_ins[-1][1]
    assert (fwd["dropout_p"], fwd["dropout_seed"], fwd["dropout_offset"]) == (p, SEED % 2**64, OFFSET)
    # rng_state: uint64 {seed, offset}, which fa2cupy's dropout_rng_state reads as uint32 {lo, hi, lo, hi}
    assert rng_state.dtype == torch.uint64 and [int(x) for x in rng_state.view(torch.int64)] == [SEED, OFFSET]
    grads = torch_sdpa.sdpa_flash_backward(dout, q, k, v, out, lse, None, None, max_q, max_k, p, False, rng_state,
                                           unused)
    bwd = stand_ins[-1][1]
    assert bwd["dropout_p"] == p and bwd["dropout_rng_state"].dtype == torch.uint32
    assert _seed_offset(bwd) == (SEED % 2**64, OFFSET)
    # against autograd through an explicit float64 attention with the same keep mask
    mask = torch.from_numpy(_mask(fwd, (2, 4, 6, 6)))
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    probs = torch.softmax(_scores(qr, kr, q.shape[-1] ** -0.5), -1) * mask / (1 - p)
    want = probs @ vr.repeat_interleave(2, dim=1)
    want.backward(dout)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    for got, ref in zip(grads, (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_deterministic_algorithms_reach_the_backward(stand_ins):
    q, k, v = _bhsd()
    out, lse, _, _, mq, mk, rng, unused, _ = torch_sdpa.sdpa_flash_forward(q, k, v)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        torch_sdpa.sdpa_flash_backward(torch.randn_like(q), q, k, v, out, lse, None, None, mq, mk, 0.0, False, rng,
                                       unused)
    finally:
        torch.use_deterministic_algorithms(was)
    assert stand_ins[-1][1]["deterministic"] is True


def test_expanded_grad_out_gets_a_contiguous_last_axis(stand_ins):
    q, k, v = _bhsd()
    out, lse, _, _, mq, mk, rng, unused, _ = torch_sdpa.sdpa_flash_forward(q, k, v)
    dout = torch.ones(()).to(torch.float64).expand(q.shape)  # out.sum()'s gradient: every stride 0
    grads = torch_sdpa.sdpa_flash_backward(dout, q, k, v, out, lse, None, None, mq, mk, 0.0, False, rng, unused)
    _, want = _sdpa_grads(q, k, v, torch.ones_like(q))
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


# ============================================================================== flash ops: mapping


@pytest.mark.parametrize("window", [(None, None), (2, 0), (-1, 1), (3, 2)])
def test_flash_forward_window_sizes_and_alibi(stand_ins, window):
    q, k, v = (x.transpose(1, 2) for x in _bhsd(sq=5, sk=8))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float32)
    out, lse, rng_state, unused, debug = torch_sdpa.flash_attention_forward(
        q, k, v, None, None, 5, 8, 0.0, False, False, scale=0.2, window_size_left=window[0],
        window_size_right=window[1], alibi_slopes=slopes)
    kw = stand_ins[-1][1]
    assert kw["window_size"] == tuple(-1 if w is None else w for w in window)
    assert kw["alibi_slopes"] is slopes and kw["softmax_scale"] == 0.2
    ref, ref_lse = reference.attention_ref(_np(q), _np(k), _np(v), 0.2, False, kw["window_size"],
                                           alibi_slopes=_np(slopes))
    torch.testing.assert_close(out, torch.from_numpy(ref))
    assert lse.shape == (2, 4, 5) and out.stride() == torch.empty_like(q).stride()

    dout = torch.randn_like(out)
    torch_sdpa.flash_attention_backward(dout, q, k, v, out, lse, None, None, 5, 8, 0.0, False, rng_state, unused,
                                        scale=0.2, window_size_left=window[0], window_size_right=window[1])
    assert stand_ins[-1][1]["window_size"] == kw["window_size"]


def _packed(lengths_q=(3, 0, 5), lengths_k=(4, 2, 6), h=4, hkv=2, d=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), h, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lengths_k), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lengths_k), hkv, d, generator=g, dtype=torch.float64)
    cu = [torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32) for n in (lengths_q, lengths_k)]
    return q, k, v, cu[0], cu[1], max(lengths_q), max(lengths_k)


def _per_sequence_sdpa(q, k, v, cu_q, cu_k, dout, causal):
    """out and grads by F.scaled_dot_product_attention per sequence (bottom-right causal as an explicit mask)."""
    out = torch.zeros_like(q)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        sq, sk = qs.stop - qs.start, ks.stop - ks.start
        if sq == 0:
            continue
        mask = None
        if causal:
            mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        o, g = _sdpa_grads(*(x[s].transpose(0, 1)[None] for x, s in ((q, qs), (k, ks), (v, ks))),
                           dout[qs].transpose(0, 1)[None], attn_mask=mask)
        out[qs] = o[0].transpose(0, 1)
        for acc, gi, s in zip(grads, g, (qs, ks, ks)):
            acc[s] = gi[0].transpose(0, 1)
    return out, grads


@pytest.mark.parametrize("causal", [False, True])
def test_flash_varlen_forward_and_backward(stand_ins, causal):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    dout = torch.randn_like(q)
    out, lse, rng_state, unused, debug = torch_sdpa.flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, num_splits=1)
    assert lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32  # (heads, total_q)
    want, grads = _per_sequence_sdpa(q, k, v, cu_q.tolist(), cu_k.tolist(), dout, causal)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    kw = stand_ins[-1][1]
    assert kw["cu_k"] is cu_k and (kw["max_q"], kw["max_k"]) == (max_q, max_k) and kw["causal"] is causal
    got = torch_sdpa.flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                              rng_state, unused)
    assert stand_ins[-1][0] == "varlen_backward"
    for g, ref in zip(got, grads):
        torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-10)


def test_paged_forward_builds_cu_seqlens_k_from_seqused_k(stand_ins, monkeypatch):
    seen = {}

    def paged(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        seen.update(cu_k=cu_k, block_table=kw["block_table"])
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(attention, "varlen_forward_with_lse", paged)
    q = torch.zeros(5, 2, 8, dtype=torch.float64)
    pool = torch.zeros(4, 16, 2, 8, dtype=torch.float64)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    used = torch.tensor([20, 7], dtype=torch.int32)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    torch_sdpa.flash_attention_forward(q, pool, pool, cu_q, None, 3, 32, 0.0, False, False, seqused_k=used,
                                       block_table=table)
    assert seen["cu_k"].tolist() == [0, 20, 27] and seen["cu_k"].dtype == torch.int32
    assert seen["block_table"] is table


def test_forward_no_dropout_inplace_writes_out(stand_ins):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    out = torch.full_like(q, float("nan"))
    lse = torch_sdpa.flash_attention_forward_no_dropout_inplace(out, q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True,
                                                                 False)
    want, want_lse, *_ = torch_sdpa.flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False)
    torch.testing.assert_close(out, want, equal_nan=False)
    torch.testing.assert_close(lse, want_lse)
    with pytest.raises(ValueError, match="takes no dropout"):
        torch_sdpa.flash_attention_forward_no_dropout_inplace(out, q, k, v, cu_q, cu_k, max_q, max_k, 0.1, True,
                                                              False)


# ============================================================================== through the dispatcher (CPU key)


@pytest.fixture
def on_cpu_key(stand_ins):
    """The mapping registered on the CPU key of the aten ops for the test: torch's own callers (autograd formulas,
    torch.nn.attention.varlen) reach it with CPU tensors."""
    lib = torch.library.Library("aten", "IMPL", "CPU")
    for name, fn in torch_sdpa.overridden_ops().items():
        lib.impl(name, fn, "CPU")
    yield stand_ins
    lib._destroy()


def test_autograd_formula_feeds_the_backward_op(on_cpu_key):
    q, k, v = _bhsd(h=4, hkv=2, grad=True)
    dout = torch.randn_like(q)
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.25, True, scale=0.4)[0]
    out.backward(dout)
    fwd, bwd = on_cpu_key[-2][1], on_cpu_key[-1][1]
    assert on_cpu_key[-1][0] == "backward" and bwd["causal"] is True and bwd["softmax_scale"] == 0.4
    assert _seed_offset(bwd) == _seed_offset(fwd) and bwd["dropout_p"] == 0.25


def test_torch_varlen_attn_runs_on_the_mapping(on_cpu_key):
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    out = varlen.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0), enable_gqa=True)
    out.backward(dout)
    want, grads = _per_sequence_sdpa(q.detach(), k.detach(), v.detach(), cu_q.tolist(), cu_k.tolist(), dout, True)
    torch.testing.assert_close(out.detach(), want, rtol=1e-12, atol=1e-12)
    for g, ref in zip((q.grad, k.grad, v.grad), grads):
        torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-10)
    assert [c[0] for c in on_cpu_key] == ["varlen_forward", "varlen_backward"]


# ============================================================================== what is refused


def test_debug_mask_is_refused_with_the_alternative(stand_ins):
    q, k, v = _bhsd()
    with pytest.raises(NotImplementedError, match=r"attention probabilities \(return_debug_mask=True\).*MATH"):
        torch_sdpa.sdpa_flash_forward(q, k, v, 0.0, False, True)


def test_seqused_k_without_block_table_is_refused(stand_ins):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    with pytest.raises(NotImplementedError, match="seqused_k"):
        torch_sdpa.flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False,
                                           seqused_k=torch.tensor([1, 0, 2], dtype=torch.int32))


def test_backward_with_dropout_needs_the_rng_state(stand_ins):
    q, k, v = _bhsd()
    out, lse, *_ = torch_sdpa.sdpa_flash_forward(q, k, v, 0.1)
    with pytest.raises(ValueError, match="rng_state"):
        torch_sdpa.sdpa_flash_backward(q, q, k, v, out, lse, None, None, 6, 6, 0.1, False,
                                       torch.zeros((), dtype=torch.int64), None)


@pytest.mark.parametrize("dtype, device, message", [
    (torch.float32, "cpu", "float16 or bfloat16 only, got torch.float32"),
    (torch.float16, "cpu", "needs CUDA tensors, got one on cpu"),
])
def test_unsupported_dtype_or_device_names_the_alternative(dtype, device, message):
    q, k, v = (x.to(dtype) for x in _bhsd())
    with pytest.raises((TypeError, ValueError), match=message + ".*restore_flash_attention_impl"):
        torch_sdpa.sdpa_flash_forward(q, k, v)


def test_kernel_options_reach_forward_and_backward(stand_ins, monkeypatch):
    sentinel = object()
    monkeypatch.setattr(torch_sdpa, "_KERNEL_OPTIONS", sentinel)
    q, k, v = _bhsd()
    out, lse, _, _, mq, mk, rng, unused, _ = torch_sdpa.sdpa_flash_forward(q, k, v)
    torch_sdpa.sdpa_flash_backward(torch.randn_like(q), q, k, v, out, lse, None, None, mq, mk, 0.0, False, rng,
                                   unused)
    assert [kw["kernel_options"] for _, kw in stand_ins] == [sentinel, sentinel]
