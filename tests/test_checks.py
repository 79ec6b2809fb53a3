"""check_forward_args: valid calls pass, and each rejection names its argument (CPU only)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fa2cupy.arrays import ArrayInfo, describe
from fa2cupy.checks import (
    MAX_HEADDIM,
    SUPPORTED_DTYPES,
    UNLIMITED_WINDOW,
    AttnShape,
    check_dropout_rng,
    check_forward_args,
    check_varlen_args,
    default_scale,
    window_bounds,
)


def _c_strides(shape):
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def info(name, shape, dtype="float16", framework="cupy", device=("cuda", 0), strides=None):
    """An ArrayInfo as describe() would build it for a device array."""
    return ArrayInfo(name, framework, tuple(shape), dtype,
                     _c_strides(shape) if strides is None else tuple(strides), device)


def qkv(b=2, sq=5, sk=7, h=4, hkv=2, d=64, dtype="float16", **kw):
    return (info("q", (b, sq, h, d), dtype, **kw), info("k", (b, sk, hkv, d), dtype, **kw),
            info("v", (b, sk, hkv, d), dtype, **kw))


# ------------------------------------------------------------------ valid calls

@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_valid_returns_shape(dtype):
    shape = check_forward_args(*qkv(dtype=dtype))
    assert shape == AttnShape(batch=2, seqlen_q=5, seqlen_k=7, nheads=4, nheads_kv=2,
                              headdim=64, dtype=dtype)


@pytest.mark.parametrize("d", [1, 3, 8, 100, MAX_HEADDIM])
def test_valid_headdims(d):
    assert check_forward_args(*qkv(d=d)).headdim == d


def test_valid_mqa_and_options():
    q, k, v = qkv(h=8, hkv=1)
    s = check_forward_args(q, k, v, dropout_p=0.0, softmax_scale=0.1, causal=True,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=True, return_attn_probs=True)
    assert s.nheads == 8 and s.nheads_kv == 1


def test_valid_options_in_other_spellings():
    check_forward_args(*qkv(), softmax_scale=np.float32(-0.5), causal=np.bool_(True),
                       window_size=[-1, -1], dropout_p=0, softcap=0, deterministic=1)
    check_forward_args(*qkv(), softmax_scale=2)  # ints are real numbers too


def test_valid_transposed_layout():
    # (b, h, s, d) memory seen as (b, s, h, d): any strides except the last axis.
    b, s, h, d = 2, 9, 3, 32
    q = info("q", (b, s, h, d), strides=(h * s * d, d, s * d, 1))
    k = info("k", (b, s, h, d), strides=(h * s * d, d, s * d, 1))
    v = info("v", (b, s, h, d))
    assert check_forward_args(q, k, v).seqlen_k == s


def test_valid_numpy_arrays():
    arrs = [np.zeros((1, 3, 2, 8), np.float16) for _ in range(3)]
    infos = [describe(a, n) for a, n in zip(arrs, "qkv")]
    assert check_forward_args(*infos).seqlen_q == 3


def test_default_scale():
    assert default_scale(64) == 0.125
    assert default_scale(3) == pytest.approx(1 / math.sqrt(3))
    with pytest.raises(ValueError, match="^headdim must be a positive integer"):
        default_scale(0)


# ------------------------------------------------------------------ array errors

def test_rank_q():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^q must be 4-D \(batch, seqlen_q, nheads, headdim\), got 3-D"):
        check_forward_args(info("q", (2, 5, 64)), k, v)


def test_rank_v():
    q, k, _ = qkv()
    with pytest.raises(ValueError, match=r"^v must be 4-D \(batch, seqlen_k, nheads_kv, headdim\), got 5-D"):
        check_forward_args(q, k, info("v", (2, 7, 2, 64, 1)))


@pytest.mark.parametrize("axis,pos", [("batch", 0), ("seqlen_q", 1), ("nheads", 2), ("headdim", 3)])
def test_zero_length_q_axis(axis, pos):
    q, k, v = qkv()
    shape = list(q.shape)
    shape[pos] = 0
    with pytest.raises(ValueError, match=rf"^q has zero-length axis {axis} "):
        check_forward_args(info("q", shape), k, v)


def test_zero_length_k_axis():
    q, _, v = qkv()
    with pytest.raises(ValueError, match=r"^k has zero-length axis seqlen_k "):
        check_forward_args(q, info("k", (2, 0, 2, 64)), v)


@pytest.mark.parametrize("pos,axis", [(0, "batch"), (1, "seqlen_k"), (2, "nheads_kv")])
def test_k_v_mismatch(pos, axis):
    q, k, _ = qkv()
    shape = list(k.shape)
    shape[pos] += 1
    with pytest.raises(ValueError, match=rf"^v has {axis}={shape[pos]} but k has {axis}={k.shape[pos]}; k and v "
                                         rf"must have the same shape but for the head dim"):
        check_forward_args(q, k, info("v", shape))


@pytest.mark.parametrize("dv", [1, 32, 128, 256])
def test_v_head_dim_of_its_own(dv):
    """v may have a head dim of its own (d_qk = 64 here): the shape carries it (AttnShape.dv, the output's),
    headdim_v 0 where it equals q's; above 256 it is refused naming v."""
    q, k, _ = qkv()
    shape = check_forward_args(q, k, info("v", (2, 7, 2, dv)))
    assert shape.headdim == 64 and shape.dv == dv and shape.headdim_v == (0 if dv == 64 else dv)
    with pytest.raises(ValueError, match=r"^v has headdim=264; fa2cupy supports head dimensions 1..256"):
        check_forward_args(q, k, info("v", (2, 7, 2, 264)))


def test_batch_mismatch_with_q():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^k has batch=3 but q has batch=2"):
        check_forward_args(q, info("k", (3, 7, 2, 64)), info("v", (3, 7, 2, 64)))


def test_headdim_mismatch_with_q():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^k has headdim=32 but q has headdim=64"):
        check_forward_args(q, info("k", (2, 7, 2, 32)), info("v", (2, 7, 2, 32)))


def test_head_grouping():
    with pytest.raises(ValueError, match=r"^q has nheads=5, which is not a multiple of nheads_kv=2"):
        check_forward_args(*qkv(h=5, hkv=2))


def test_headdim_too_large():
    with pytest.raises(ValueError, match=rf"^q has headdim=257; fa2cupy supports head dimensions 1..{MAX_HEADDIM}"):
        check_forward_args(*qkv(d=257))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_unsupported_dtype_q(dtype):
    q, k, v = qkv()
    bad = info("q", q.shape, dtype)
    with pytest.raises(TypeError) as err:
        check_forward_args(bad, k, v)
    assert str(err.value) == (
        f"fa2cupy computes in float16 or bfloat16; got {dtype} for q "
        f"(cast with .half() / .to(torch.bfloat16) / astype)"
    )


def test_unsupported_dtype_v():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"got float32 for v "):
        check_forward_args(q, k, info("v", v.shape, "float32"))


def test_mixed_supported_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^k has dtype bfloat16 but q has float16; q, k and v must share"):
        check_forward_args(q, info("k", k.shape, "bfloat16"), v)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_last_axis_not_contiguous(name):
    arrays = dict(zip("qkv", qkv(d=8)))
    a = arrays[name]
    arrays[name] = info(name, a.shape, strides=(a.strides[0] * 2, a.strides[1] * 2, 16, 2))
    with pytest.raises(ValueError, match=rf"^{name} must be contiguous in its last \(headdim\) axis.*other axes may have any stride"):
        check_forward_args(arrays["q"], arrays["k"], arrays["v"])


def test_devices_differ():
    q, k, v = qkv()
    k = info("k", k.shape, device=("cuda", 1))
    with pytest.raises(ValueError, match=r"^k is on cuda:1 but q is on cuda:0; all arrays must be on one device"):
        check_forward_args(q, k, v)


def test_host_numpy_mixed_with_device():
    q, k, v = qkv()
    v = info("v", v.shape, framework="numpy", device=("cpu", 0))
    with pytest.raises(ValueError, match=r"^v is a host NumPy array but q is a CuPy array on cuda:0"):
        check_forward_args(q, k, v)


def test_frameworks_differ():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^k is a PyTorch tensor but q is a CuPy array"):
        check_forward_args(q, info("k", k.shape, framework="torch"), v)


# ------------------------------------------------------------------ option errors

@pytest.mark.parametrize("p", [0.1, 0.5, 0.999])
def test_dropout_accepted(p):
    assert check_forward_args(*qkv(), dropout_p=p).headdim == 64


@pytest.mark.parametrize("seed,offset,message", [
    (None, 0, r"^dropout_seed must be an int in \[0, 2\*\*64\), got None \(dropout_p > 0 needs it"),
    (-1, 0, r"^dropout_seed must be an int"),
    (1 << 64, 0, r"^dropout_seed must be an int"),
    (3, -2, r"^dropout_offset must be an int"),
    (3, 1.5, r"^dropout_offset must be an int"),
])
def test_dropout_rng_rejected(seed, offset, message):
    with pytest.raises(ValueError, match=message):
        check_dropout_rng(0.1, seed, offset)


def test_dropout_rng_ignored_without_dropout():
    assert check_dropout_rng(0.0, None, None) == (0, 0)
    assert check_dropout_rng(0.2, 5, 7) == (5, 7)


@pytest.mark.parametrize("p", [-0.1, 1.0, float("nan")])
def test_dropout_out_of_range(p):
    with pytest.raises(ValueError, match=r"^dropout_p must be in \[0, 1\)"):
        check_forward_args(*qkv(), dropout_p=p)


def test_dropout_type():
    with pytest.raises(TypeError, match="^dropout_p must be a real number"):
        check_forward_args(*qkv(), dropout_p="0.1")


@pytest.mark.parametrize("w", [(128, 0), (-1, 0), (4, 4), [0, -1], (0, 0)])
def test_window_accepted(w):
    check_forward_args(*qkv(), window_size=w)


@pytest.mark.parametrize("w", [(-2, 0), (0, -5)])
def test_window_sides_below_minus_one(w):
    with pytest.raises(ValueError, match=r"^window_size must be \(left, right\) with each side >= 0"):
        check_forward_args(*qkv(), window_size=w)


@pytest.mark.parametrize("causal,w,want", [
    (False, (-1, -1), ("none", UNLIMITED_WINDOW, UNLIMITED_WINDOW)),
    (True, (-1, -1), ("causal", UNLIMITED_WINDOW, 0)),
    (False, (-1, 0), ("causal", UNLIMITED_WINDOW, 0)),  # the same mask, the same kernel
    (True, (64, 7), ("window", 64, 0)),  # causal forces the right side to 0, as in flash-attn
    (False, (64, 7), ("window", 64, 7)),
    (False, (-1, 3), ("window", UNLIMITED_WINDOW, 3)),
])
def test_window_bounds(causal, w, want):
    assert window_bounds(causal, w) == want


@pytest.mark.parametrize("w", [-1, (-1,), (-1, -1, -1), (-1.0, -1), (True, -1), None, "-1,-1"])
def test_window_type(w):
    with pytest.raises(TypeError, match=r"^window_size must be a pair of ints \(left, right\)"):
        check_forward_args(*qkv(), window_size=w)


def test_softcap_accepted():
    assert check_forward_args(*qkv(), softcap=30.0).headdim == 64


@pytest.mark.parametrize("c", [-1.0, float("inf"), float("nan")])
def test_softcap_value(c):
    with pytest.raises(ValueError, match="^softcap must be a finite number >= 0"):
        check_forward_args(*qkv(), softcap=c)


@pytest.mark.parametrize("shape", [(4,), (2, 4)])
def test_alibi_accepted(shape):
    assert check_forward_args(*qkv(), alibi_slopes=info("alibi_slopes", shape, "float32")).nheads == 4


@pytest.mark.parametrize("shape,dtype,error,message", [
    ((2,), "float32", ValueError, r"^alibi_slopes must have shape \(nheads,\) = \(4,\) or \(batch, nheads\)"),
    ((3, 4), "float32", ValueError, r"^alibi_slopes must have shape"),
    ((4,), "float16", TypeError, r"^alibi_slopes must be float32"),
])
def test_alibi_rejected(shape, dtype, error, message):
    with pytest.raises(error, match=message):
        check_forward_args(*qkv(), alibi_slopes=info("alibi_slopes", shape, dtype))


def test_alibi_other_framework_rejected():
    with pytest.raises(ValueError):
        check_forward_args(*qkv(), alibi_slopes=info("alibi_slopes", (4,), "float32", framework="torch"))


# ------------------------------------------------------------------ varlen


def varlen(tq=30, tk=40, h=4, hkv=2, d=64, batch=3, cu_dtype="int32"):
    return (info("q", (tq, h, d)), info("k", (tk, hkv, d)), info("v", (tk, hkv, d)),
            info("cu_seqlens_q", (batch + 1,), cu_dtype), info("cu_seqlens_k", (batch + 1,), cu_dtype))


def test_varlen_valid():
    shape, tq, tk = check_varlen_args(*varlen(), 17, 25, causal=True)
    assert (shape.batch, shape.seqlen_q, shape.seqlen_k, shape.nheads, tq, tk) == (3, 17, 25, 4, 30, 40)


@pytest.mark.parametrize("args,kw,error,message", [
    (varlen(cu_dtype="int64"), {}, TypeError, r"^cu_seqlens_q must be int32"),
    (varlen(batch=0), {}, ValueError, r"^cu_seqlens_q must be 1-D \(batch \+ 1,\) with batch >= 1"),
    (varlen()[:3] + (info("cu_seqlens_q", (4,), "int32"), info("cu_seqlens_k", (3,), "int32")), {}, ValueError,
     r"^cu_seqlens_q \(4,\) and cu_seqlens_k \(3,\) must have the same length"),
    ((info("q", (2, 30, 4, 64)),) + varlen()[1:], {}, ValueError, r"^q must be 3-D \(total_tokens, heads, headdim\)"),
    (varlen(hkv=3), {}, ValueError, r"^q has nheads=4, which is not a multiple of nheads_kv=3"),
])
def test_varlen_rejected(args, kw, error, message):
    with pytest.raises(error, match=message):
        check_varlen_args(*args, 17, 25, **kw)


@pytest.mark.parametrize("m", [-1, 2.5, None, True])
def test_varlen_max_seqlen_rejected(m):
    with pytest.raises(ValueError, match=r"^max_seqlen_q must be an int >= 0"):
        check_varlen_args(*varlen(), m, 25)


def paged(pages=9, page_size=16, hkv=2, d=64, batch=3, max_pages=4, table_dtype="int32", table_batch=None):
    q, _, _, cu_q, cu_k = varlen(hkv=hkv, d=d, batch=batch)
    return (q, info("k", (pages, page_size, hkv, d)), info("v", (pages, page_size, hkv, d)), cu_q, cu_k,
            info("block_table", (batch if table_batch is None else table_batch, max_pages), table_dtype))


def test_paged_varlen_valid():
    *arrays, table = paged()
    shape, tq, capacity = check_varlen_args(*arrays, 17, 64, causal=True, block_table=table)
    assert (shape.batch, shape.seqlen_k, shape.nheads_kv, tq, capacity) == (3, 64, 2, 30, 9 * 16)
    *arrays, table = paged(page_size=5, max_pages=1)  # any page size
    assert check_varlen_args(*arrays, 17, 5, block_table=table)[2] == 45
    q, k, _, cu_q, cu_k, table = paged()  # v's page pool with a head dim of its own
    shape = check_varlen_args(q, k, info("v", (9, 16, 2, 128)), cu_q, cu_k, 17, 64, block_table=table)[0]
    assert (shape.headdim, shape.dv) == (64, 128)


@pytest.mark.parametrize("case,kw,error,message", [
    (paged(), {"max_seqlen_k": 65}, ValueError, r"^max_seqlen_k = 65 exceeds what block_table can address: "
                                                r"max_pages 4 x page_size 16 = 64"),
    (paged(table_dtype="int64"), {}, TypeError, r"^block_table must be int32"),
    (paged(table_batch=2), {}, ValueError, r"^block_table must be 2-D \(batch, max_pages\) = \(3, >= 1\)"),
    (paged(max_pages=0), {}, ValueError, r"^block_table must be 2-D"),
    (varlen() + (info("block_table", (3, 4), "int32"),), {}, ValueError,
     r"^k must be 4-D \(num_pages, page_size, nheads_kv, headdim\) with block_table"),
    (paged(hkv=3), {}, ValueError, r"^q has nheads=4, which is not a multiple of nheads_kv=3"),
    ((varlen()[0],) + paged(d=32)[1:], {}, ValueError, r"^k has headdim=32 but q has headdim=64"),
    (paged()[:2] + (info("v", (9, 8, 2, 64)),) + paged()[3:], {}, ValueError,
     r"^v has shape \(9, 8, 2, 64\) but k has \(9, 16, 2, 64\); with block_table they must agree on every axis "
     r"but the last"),
    (paged()[:2] + (info("v", (9, 16, 2, 260)),) + paged()[3:], {}, ValueError, r"v has headdim=260"),
])
def test_paged_varlen_rejected(case, kw, error, message):
    *arrays, table = case
    with pytest.raises(error, match=message):
        check_varlen_args(*arrays, 17, kw.get("max_seqlen_k", 25), block_table=table)


def test_paged_varlen_other_framework_rejected():
    *arrays, _ = paged()
    with pytest.raises(ValueError):
        check_varlen_args(*arrays, 17, 25, block_table=info("block_table", (3, 4), "int32", framework="torch"))


@pytest.mark.parametrize("s", [float("nan"), float("inf"), -float("inf")])
def test_scale_not_finite(s):
    with pytest.raises(ValueError, match="^softmax_scale must be None or a finite number"):
        check_forward_args(*qkv(), softmax_scale=s)


@pytest.mark.parametrize("s", ["0.1", True, [0.1]])
def test_scale_type(s):
    with pytest.raises(TypeError, match="^softmax_scale must be a real number"):
        check_forward_args(*qkv(), softmax_scale=s)


@pytest.mark.parametrize("arg", ["causal", "deterministic", "return_attn_probs"])
@pytest.mark.parametrize("value", ["yes", 0.5, None, 2])
def test_bool_options(arg, value):
    with pytest.raises(TypeError, match=rf"^{arg} must be a bool \(True or False\)"):
        check_forward_args(*qkv(), **{arg: value})


def test_batch_or_nheads_beyond_grid_limit_is_rejected():
    from fa2cupy.arrays import ArrayInfo

    def info(name, shape):
        strides = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
        return ArrayInfo(name, "cupy", shape, "float16", strides, ("cuda", 0))

    big = (65536, 1, 1, 8)
    with pytest.raises(ValueError, match="batch=65536"):
        check_forward_args(info("q", big), info("k", big), info("v", big))


def test_headdim_one_may_have_any_last_stride():
    from fa2cupy.arrays import ArrayInfo

    q = ArrayInfo("q", "cupy", (1, 4, 2, 1), "float16", (8, 2, 1, 7), ("cuda", 0))
    assert check_forward_args(q, q, q).headdim == 1


# ------------------------------------------------------------------ check_backward_args

from fa2cupy.checks import check_backward_args  # noqa: E402


def bwd_args(b=2, sq=5, sk=7, h=4, hkv=2, d=64, dtype="float16", **kw):
    """dout, q, k, v, out, softmax_lse as describe() would report them for a valid backward call."""
    q, k, v = qkv(b, sq, sk, h, hkv, d, dtype, **kw)
    return {
        "dout": info("dout", q.shape, dtype, **kw), "q": q, "k": k, "v": v,
        "out": info("out", q.shape, dtype, **kw), "softmax_lse": info("softmax_lse", (b, h, sq), "float32", **kw),
    }


def call_bwd(args, **options):
    return check_backward_args(args["dout"], args["q"], args["k"], args["v"], args["out"], args["softmax_lse"],
                               **options)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_bwd_valid_returns_shape(dtype):
    assert call_bwd(bwd_args(dtype=dtype)) == AttnShape(batch=2, seqlen_q=5, seqlen_k=7, nheads=4, nheads_kv=2,
                                                        headdim=64, dtype=dtype)


def test_bwd_valid_options_and_strided_dout_out():
    args = bwd_args(b=2, sq=9, h=3, hkv=3, d=32)
    # (b, h, s, d) memory seen as (b, s, h, d) for dout and out; lse with a size-1 axis of odd stride.
    args["dout"] = info("dout", (2, 9, 3, 32), strides=(3 * 9 * 32, 32, 9 * 32, 1))
    args["out"] = info("out", (2, 9, 3, 32), strides=(3 * 9 * 32, 32, 9 * 32, 1))
    s = call_bwd(args, softmax_scale=0.3, causal=True, window_size=(-1, -1), deterministic=True)
    assert s.seqlen_q == 9
    args["softmax_lse"] = info("softmax_lse", (1, 3, 9), "float32", strides=(5, 9, 1))
    args.update({n: info(n, (1,) + a.shape[1:], a.dtype, strides=a.strides) for n, a in args.items()
                 if n != "softmax_lse"})
    assert call_bwd(args).batch == 1


def test_bwd_reuses_forward_checks():
    args = bwd_args()
    args["k"] = info("k", (2, 7, 2, 64), "bfloat16")
    with pytest.raises(TypeError, match=r"^k has dtype bfloat16 but q has float16"):
        call_bwd(args)
    with pytest.raises(ValueError, match=r"^window_size must be \(left, right\)"):
        call_bwd(bwd_args(), window_size=(8, -3))
    with pytest.raises(TypeError, match=r"^deterministic must be a bool"):
        call_bwd(bwd_args(), deterministic="yes")
    with pytest.raises(ValueError, match=r"^softmax_scale must be None or a finite number"):
        call_bwd(bwd_args(), softmax_scale=float("nan"))


@pytest.mark.parametrize("name", ["dout", "out"])
def test_bwd_rank_dout_out(name):
    args = bwd_args()
    args[name] = info(name, (2, 5, 256))
    with pytest.raises(ValueError, match=rf"^{name} must be 4-D \(batch, seqlen_q, nheads, headdim\) like q, got 3-D"):
        call_bwd(args)


@pytest.mark.parametrize("name", ["dout", "out"])
@pytest.mark.parametrize("pos", [0, 1, 2, 3])
def test_bwd_shape_dout_out(name, pos):
    args = bwd_args()
    shape = list(args["q"].shape)
    shape[pos] += 1
    args[name] = info(name, shape)
    with pytest.raises(ValueError) as err:
        call_bwd(args)
    assert str(err.value) == (f"{name} has shape {tuple(shape)}, expected (2, 5, 4, 64): q's (batch, seqlen_q, "
                              f"nheads) and v's head dim (the forward's output shape)")


def test_bwd_dout_out_take_v_head_dim():
    """With v's head dim (32) different from q's (64), dout and out have v's; q's is refused."""
    args = bwd_args()
    args["v"] = info("v", (2, 7, 2, 32))
    args["dout"], args["out"] = info("dout", (2, 5, 4, 32)), info("out", (2, 5, 4, 32))
    assert call_bwd(args).dv == 32
    args["out"] = info("out", (2, 5, 4, 64))
    with pytest.raises(ValueError, match=r"^out has shape \(2, 5, 4, 64\), expected \(2, 5, 4, 32\)"):
        call_bwd(args)


@pytest.mark.parametrize("name", ["dout", "out"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bwd_dtype_dout_out(name, dtype):
    args = bwd_args()
    args[name] = info(name, args["q"].shape, dtype)
    with pytest.raises(TypeError) as err:
        call_bwd(args)
    assert str(err.value) == f"{name} has dtype {dtype} but q has float16; {name} must have q's dtype"


@pytest.mark.parametrize("name", ["dout", "out"])
def test_bwd_last_axis_not_contiguous(name):
    args = bwd_args(d=8)
    args[name] = info(name, args["q"].shape, strides=(2 * 5 * 4 * 8, 2 * 4 * 8, 16, 2))
    with pytest.raises(ValueError, match=rf"^{name} must be contiguous in its last \(headdim\) axis, got strides "
                                         rf"\(320, 64, 16, 2\)"):
        call_bwd(args)


def test_bwd_lse_rank():
    args = bwd_args()
    args["softmax_lse"] = info("softmax_lse", (2, 4, 5, 1), "float32")
    with pytest.raises(ValueError, match=r"^softmax_lse must be 3-D \(batch, nheads, seqlen_q\) = \(2, 4, 5\), "
                                         r"got 4-D shape \(2, 4, 5, 1\)"):
        call_bwd(args)


@pytest.mark.parametrize("shape", [(2, 5, 4), (2, 4, 7), (1, 4, 5), (2, 2, 5)])
def test_bwd_lse_shape(shape):
    args = bwd_args()
    args["softmax_lse"] = info("softmax_lse", shape, "float32")
    with pytest.raises(ValueError) as err:
        call_bwd(args)
    assert str(err.value) == (f"softmax_lse has shape {shape}, expected (batch, nheads, seqlen_q) = (2, 4, 5) from "
                              f"q's shape (2, 5, 4, 64); pass the softmax_lse that the forward returned")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_bwd_lse_dtype(dtype):
    args = bwd_args()
    args["softmax_lse"] = info("softmax_lse", (2, 4, 5), dtype)
    with pytest.raises(TypeError) as err:
        call_bwd(args)
    assert str(err.value) == f"softmax_lse must be float32 (as the forward returns it), got {dtype}"


@pytest.mark.parametrize("strides", [(20, 1, 4), (40, 10, 2), (20, 5, 0)])
def test_bwd_lse_not_contiguous(strides):
    args = bwd_args()
    args["softmax_lse"] = info("softmax_lse", (2, 4, 5), "float32", strides=strides)
    with pytest.raises(ValueError, match=rf"^softmax_lse must be C-contiguous \(batch, nheads, seqlen_q\), got "
                                         rf"strides \({strides[0]}, {strides[1]}, {strides[2]}\)"):
        call_bwd(args)


@pytest.mark.parametrize("name", ["dout", "out", "softmax_lse"])
def test_bwd_device_differs(name):
    args = bwd_args()
    a = args[name]
    args[name] = info(name, a.shape, a.dtype, device=("cuda", 1))
    with pytest.raises(ValueError, match=rf"^{name} is on cuda:1 but q is on cuda:0; all arrays must be on one device"):
        call_bwd(args)


@pytest.mark.parametrize("name", ["dout", "out", "softmax_lse"])
def test_bwd_framework_differs(name):
    args = bwd_args()
    a = args[name]
    args[name] = info(name, a.shape, a.dtype, framework="torch")
    with pytest.raises(ValueError, match=rf"^{name} is a PyTorch tensor but q is a CuPy array; all arrays must come "
                                         rf"from one framework"):
        call_bwd(args)


def test_bwd_host_numpy_mixed():
    args = bwd_args()
    args["softmax_lse"] = info("softmax_lse", (2, 4, 5), "float32", framework="numpy", device=("cpu", 0))
    with pytest.raises(ValueError, match=r"^softmax_lse is a host NumPy array but q is a CuPy array on cuda:0"):
        call_bwd(args)


def test_bwd_torch_on_cpu():
    args = bwd_args(framework="torch")
    args["dout"] = info("dout", args["q"].shape, framework="torch", device=("cpu", 0))
    with pytest.raises(ValueError, match=r"^dout is a PyTorch tensor on the CPU; fa2cupy runs on a CUDA GPU"):
        call_bwd(args)


def test_bwd_numpy_all_host_is_fine():
    arrs = {"dout": np.zeros((1, 3, 2, 8), np.float16), "q": np.zeros((1, 3, 2, 8), np.float16),
            "k": np.zeros((1, 4, 1, 8), np.float16), "v": np.zeros((1, 4, 1, 8), np.float16),
            "out": np.zeros((1, 3, 2, 8), np.float16), "softmax_lse": np.zeros((1, 2, 3), np.float32)}
    infos = {n: describe(a, n) for n, a in arrs.items()}
    assert call_bwd(infos, causal=True).nheads_kv == 1
