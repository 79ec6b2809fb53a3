"""float64 reference stand-ins for fa2cupy's kernels, so that fa2cupy.torch's custom ops (and what is built on
them) run on CPU tensors: the fixtures ``cpu_kernels`` (dense forward and backward) and ``cpu_varlen_kernels``
(varlen, with or without paged K/V) monkeypatch the entry points the ops call with fa2cupy.reference. Dropout is
recorded but not applied (the reference would need the kernel's mask); windows and softcap are applied.

Test modules that use them import torch first (``pytest.importorskip("torch")``), then
``from torch_stand_ins import cpu_kernels, cpu_varlen_kernels`` (pytest finds fixtures imported into a module).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fa2cupy
from fa2cupy import attention, paging, reference


def _np(t):
    return t.detach().to(torch.float64).cpu().numpy()


def _ref_forward(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, **_):
    """(out, lse) as fa2cupy's forward_with_lse returns them (dropout, which the reference would need a mask for,
    is not applied: these tests check the plumbing)."""
    calls.append(dict(forward="forward_with_lse", dropout_p=dropout_p))
    out, lse = reference.attention_ref(_np(q), _np(k), _np(v), softmax_scale, causal, window_size, softcap)
    return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).to(torch.float32)


def _ref_backward(dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False, window_size=(-1, -1),
                  deterministic=False, softcap=0.0, **_):
    backward_calls.append(dict(dout=dout, q=q, k=k, v=v, out=out, lse=softmax_lse, softmax_scale=softmax_scale,
                               causal=causal, window_size=window_size, deterministic=deterministic))
    grads = reference.attention_ref_backward(_np(dout), _np(q), _np(k), _np(v), softmax_scale, causal, window_size,
                                             softcap)
    return tuple(torch.from_numpy(g).to(x.dtype) for g, x in zip(grads, (q, k, v)))


def _ref_block_backward(dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False, window_size=(-1, -1),
                        deterministic=False, softcap=0.0, **_):
    """The backward as the kernels compute it, from the given ``out`` and ``lse`` rather than from a softmax of its
    own (reference.attention_ref_backward's ``out=``/``lse=``): the stand-in for calls over part of the keys (ring
    attention's blocks), whose lse is that of all of them. No dropout or ALiBi."""
    backward_calls.append(dict(q=q, k=k, lse=softmax_lse, window_size=window_size))
    grads = reference.attention_ref_backward(_np(dout), _np(q), _np(k), _np(v), softmax_scale, causal, window_size,
                                             softcap, out=_np(out), lse=_np(softmax_lse))
    return tuple(torch.from_numpy(g).to(x.dtype) for g, x in zip(grads, (q, k, v)))


def _ref_varlen_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False,
                               window_size=(-1, -1), deterministic=False, softcap=0.0, **_):
    """_ref_block_backward for a varlen call (lse ``(h, total_q)``)."""
    grads = reference.attention_ref_varlen_backward(_np(dout), _np(q), _np(k), _np(v), cu_q.numpy(), cu_k.numpy(),
                                                    softmax_scale, causal, window_size, softcap, out=_np(out),
                                                    lse=_np(lse))
    return tuple(torch.from_numpy(g).to(x.dtype) for g, x in zip(grads, (q, k, v)))


calls: list = []  # the forward stand-ins' calls
backward_calls: list = []  # the backward stand-ins' calls


@pytest.fixture
def cpu_kernels(monkeypatch):
    """Route the custom ops to the float64 reference on CPU tensors; returns the backward calls."""
    calls.clear()
    backward_calls.clear()
    monkeypatch.setattr(attention, "forward_with_lse", _ref_forward)
    monkeypatch.setattr(fa2cupy, "flash_attn_backward", _ref_backward, raising=False)
    return backward_calls


def _packed_keys(k, v, cu_k, max_k, block_table):
    """float64 packed K/V and their cu_seqlens: as given, or gathered from pages (fa2cupy.paging, as the GPU
    backward does)."""
    cu_k = cu_k.numpy()
    if block_table is None:
        return _np(k), _np(v), cu_k
    table = block_table.numpy()
    packed_cu, page, slot, inside = paging.key_pages(np, cu_k, table, table.shape[0] * max_k, k.shape[1], k.shape[0])
    return paging.gather(np, _np(k), page, slot, inside), paging.gather(np, _np(v), page, slot, inside), packed_cu


def _ref_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False,
                        window_size=(-1, -1), block_table=None, softcap=0.0, **_):
    """(out, lse) as fa2cupy's varlen_forward_with_lse returns them (no dropout applied, as in _ref_forward)."""
    calls.append(dict(forward="varlen_forward_with_lse", dropout_p=dropout_p, paged=block_table is not None))
    kp, vp, packed_cu = _packed_keys(k, v, cu_k, max_k, block_table)
    out, lse = reference.attention_ref_varlen(_np(q), kp, vp, cu_q.numpy(), packed_cu, softmax_scale, causal,
                                              window_size, softcap)
    return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).to(torch.float32)


def _ref_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False,
                         window_size=(-1, -1), block_table=None, softcap=0.0, **_):
    backward_calls.append(dict(k=k, block_table=block_table, max_seqlen_k=max_k))
    kp, vp, packed_cu = _packed_keys(k, v, cu_k, max_k, block_table)
    dq, dk, dv = reference.attention_ref_varlen_backward(_np(dout), _np(q), kp, vp, cu_q.numpy(), packed_cu,
                                                         softmax_scale, causal, window_size, softcap)
    if block_table is not None:  # summed back onto the pages (float64: this is the stand-in, not the GPU path)
        table = block_table.numpy()
        _, page, slot, inside = paging.key_pages(np, cu_k.numpy(), table, dk.shape[0], k.shape[1], k.shape[0])
        dk, dv = (paging.sum_onto_pages(np, g, k.shape, page, slot, inside) for g in (dk, dv))
    return tuple(torch.from_numpy(g).to(x.dtype) for g, x in zip((dq, dk, dv), (q, k, v)))


@pytest.fixture
def cpu_varlen_kernels(monkeypatch):
    calls.clear()
    backward_calls.clear()
    monkeypatch.setattr(attention, "varlen_forward_with_lse", _ref_varlen_forward)
    monkeypatch.setattr(fa2cupy, "flash_attn_varlen_backward", _ref_varlen_backward)
    return backward_calls
