"""v with a head dim of its own (q, k: ``(..., d_qk)``, v: ``(..., d_v)``, output ``(..., d_v)``) on a GPU, forward
and backward, padded and varlen, fa2cupy's functions and the torch wrapper: every result matches the float64
reference, outputs poisoned before each launch. The kernels run on one head dim, the larger of the two padded to a
multiple of 8 (the narrower arrays zero-padded to it, the outputs sliced back), so any pair of 1..256 works on
every GPU; on an H100/H200 the padded Hopper forward reads each array at its own head dim instead (TMA copies read
zeros past an array's columns), which test_hopper_forward_reads_each_array_as_it_is forces for short masked calls
too. The default softmax scale is 1 / sqrt(d_qk).
"""

from __future__ import annotations

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from gpu_helpers import cupy_module, debug_poison, kernel_options, torch_cuda
from test_varlen_mods_gpu import run_mods_case, run_varlen_case

pytestmark = pytest.mark.gpu

EXAMPLES = max(10, settings().max_examples // 4)
PAIRS = [(192, 128), (128, 64), (64, 128), (96, 64), (256, 128), (40, 24), (8, 256)]


@pytest.fixture(autouse=True, scope="module")
def poison_outputs():
    with debug_poison():
        yield


def _case(b, sq, sk, h, hkv, d, dv, causal, window=(-1, -1), dtype="bfloat16", seed=0, softcap=0.0):
    """A case dict of test_varlen_mods_gpu.run_mods_case with v's head dim ``dv``."""
    return dict(batch=b, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_kv=hkv, headdim=d, headdim_v=dv, causal=causal,
                window_size=window, softcap=softcap, alibi=None, dtype=dtype, softmax_scale=None, deterministic=False,
                seed=seed)


@pytest.mark.parametrize("d,dv", PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_pairs_match_reference(d, dv, causal):
    run_mods_case(_case(2, 200, 260, 4, 2, d, dv, causal, seed=d + dv))


@pytest.mark.parametrize("d,dv", [(192, 128), (64, 128), (128, 64), (60, 130), (256, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_forward_reads_each_array_as_it_is(d, dv, causal):
    if int(cupy_module().cuda.Device().compute_capability) != 90:
        pytest.skip("the Hopper forward runs on compute capability 9.0 only")
    with kernel_options(hopper_masked_min_seqlen=0):  # (short masked calls on the Hopper forward too)
        run_mods_case(_case(2, 200, 260, 4, 2, d, dv, causal, seed=7 * d + dv))
        run_mods_case(_case(1, 77, 300, 2, 1, d, dv, causal, window=(30, 5), softcap=5.0, seed=d))


@pytest.mark.parametrize("d,dv", [(192, 128), (176, 64)])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_hopper_kernels_at_v_head_dim(d, dv, mask, deterministic, monkeypatch):
    """The 192 row's forward and dK/dV kernels at v's own head dim 128 (configs.FORWARD_HOPPER_V_TABLE: V's tiles, P V
    and O at 128 columns; configs.HOPPER_BWD_V_DIMS: dP^T over v's columns, dV at N = 128) run these calls, and the
    output and gradients match the reference: every mask variant, both modes and types."""
    if int(cupy_module().cuda.Device().compute_capability) != 90:
        pytest.skip("the Hopper backward runs on compute capability 9.0 only")
    from fa2cupy import build

    names, get_kernel = [], build.get_kernel
    monkeypatch.setattr(build, "get_kernel", lambda family, name, *rest: names.append(name) or get_kernel(
        family, name, *rest))
    window = (90, 17) if mask == "window" else (-1, -1)
    run_mods_case(dict(_case(2, 300 + dv, 333, 4, 2, d, dv, mask == "causal", window=window,
                             dtype="float16" if deterministic else "bfloat16", seed=d + 3 * dv),
                       deterministic=deterministic))
    assert any(n.startswith("fa2::bwd_dkdv_hopper") and n.endswith(", 192, false, 128>>") for n in names), names
    assert any(n.startswith("fa2::flash_fwd_hopper") and n.endswith(", false, false, false, false, 128>>")
               for n in names), names


def test_window_softcap_and_sq_above_sk():
    run_mods_case(_case(1, 300, 150, 2, 1, 192, 128, True, seed=1))
    run_mods_case(_case(1, 250, 250, 4, 4, 192, 128, False, window=(40, 8), seed=2))
    run_mods_case(_case(1, 130, 140, 2, 2, 128, 64, True, softcap=5.0, seed=3, dtype="float16"))


@settings(max_examples=EXAMPLES, deadline=None)
@given(d=st.integers(1, 256), dv=st.integers(1, 256), causal=st.booleans(), group=st.sampled_from([1, 2]),
       sq=st.sampled_from([1, 17, 64, 129]), sk=st.sampled_from([1, 33, 128, 200]), seed=st.integers(0, 2**31))
def test_any_pair(d, dv, causal, group, sq, sk, seed):
    note(dict(d=d, dv=dv, causal=causal, group=group, sq=sq, sk=sk))
    run_mods_case(_case(1, sq, sk, 2 * group, 2, d, dv, causal, seed=seed))


@pytest.mark.parametrize("d,dv", [(192, 128), (64, 128)])
def test_varlen(d, dv):
    """Packed sequences (an empty one, one row, ragged ends, rows past the last sequence): out and gradients match
    the reference over the rows of every sequence, and rows past the last one get zero gradients (run_varlen_case)."""
    run_varlen_case(dict(lengths_q=[70, 0, 1, 200], lengths_k=[70, 0, 1, 200], nheads=4, nheads_kv=2, headdim=d,
                         headdim_v=dv, causal=True, window_size=(-1, -1), softcap=0.0, alibi=None, extra_rows=3,
                         slack=0, dtype="bfloat16", deterministic=False, seed=d + dv))


@pytest.mark.parametrize("d,dv", [(192, 128), (136, 192)])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_hopper_varlen_reads_each_array_as_it_is(d, dv, mask, monkeypatch):
    """Varlen calls whose head dims both lie in the 192 row's last 64-column pass (configs.hopper_varlen_own_widths)
    run the Hopper forward on q, k and v as they are (and the Hopper backward on v, dout and out too, where v is the
    narrower): whole tiles by TMA, a sequence's ragged tiles and output rows stopping at each array's own head dim.
    The output is allocated at v's head dim (contiguous, not a slice of a wider one) and matches the reference, as
    do the gradients (deterministic too)."""
    if int(cupy_module().cuda.Device().compute_capability) != 90:
        pytest.skip("the Hopper kernels run on compute capability 9.0 only")
    import numpy as np

    import fa2cupy
    from fa2cupy import attention, pipeline

    from fa2cupy import build

    pipeline.forget_plans()  # (so that the plans are made here)
    names, get_kernel = [], build.get_kernel
    monkeypatch.setattr(build, "get_kernel", lambda family, name, *rest: names.append(name) or get_kernel(
        family, name, *rest))
    planned = []
    plan_backward = attention.backward.plan_backward
    monkeypatch.setattr(attention.backward, "plan_backward",
                        lambda *a, **kw: planned.append(kw.get("headdim_v")) or plan_backward(*a, **kw))
    cp = cupy_module()
    window = (50, 9) if mask == "window" else (-1, -1)
    with kernel_options(hopper_masked_min_seqlen=0):  # (short masked calls on the Hopper forward too)
        run_varlen_case(dict(lengths_q=[70, 0, 1, 200, 131], lengths_k=[70, 0, 1, 200, 67], nheads=4, nheads_kv=2,
                             headdim=d, headdim_v=dv, causal=mask == "causal", window_size=window, softcap=0.0,
                             alibi=None, extra_rows=3, slack=0, dtype="bfloat16" if d == 192 else "float16",
                             deterministic=mask == "window", seed=d + dv))
        assert planned == [dv if dv < d else None]
        # (v at 128: the forward's HeadDimV kernel, varlen)
        assert any(n.startswith("fa2::flash_fwd_hopper") and n.endswith(", true, false, false, false, 128>>")
                   for n in names) == (dv == 128), names
        rng = np.random.default_rng(d)
        cu = cp.asarray([0, 90, 300], dtype=cp.int32)
        q, k = (cp.asarray(rng.standard_normal((300, 2, d)), dtype=cp.float16) for _ in range(2))
        v = cp.asarray(rng.standard_normal((300, 2, dv)), dtype=cp.float16)
        out = fa2cupy.flash_attn_varlen_func(q, k, v, cu, cu, 210, 210, causal=mask == "causal", window_size=window)
        assert out.shape == (300, 2, dv) and out.flags.c_contiguous


@pytest.mark.parametrize("mods", ["softcap", "alibi"])
def test_hopper_varlen_at_own_widths_with_modifiers(mods):
    """As test_hopper_varlen_reads_each_array_as_it_is, on the modifier kernels' varlen rows (192 / 128)."""
    if int(cupy_module().cuda.Device().compute_capability) != 90:
        pytest.skip("the Hopper kernels run on compute capability 9.0 only")
    with kernel_options(hopper_masked_min_seqlen=0):
        run_varlen_case(dict(lengths_q=[70, 0, 1, 130, 65], lengths_k=[70, 0, 1, 130, 65], nheads=4, nheads_kv=2,
                             headdim=192, headdim_v=128, causal=mods == "softcap",
                             window_size=(40, 7) if mods == "alibi" else (-1, -1),
                             softcap=5.0 if mods == "softcap" else 0.0, alibi="batch" if mods == "alibi" else None,
                             extra_rows=3, slack=0, dtype="bfloat16", deterministic=mods == "alibi",
                             seed=len(mods)))


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
