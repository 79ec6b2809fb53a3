"""Quick decode check and KV-bandwidth timing on the GPU (development aid; tests/test_kvcache.py is the real test).

    python bench/decode_smoke.py [--no-bench]
"""

import sys

import cupy as cp
import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
import fa2cupy  # noqa: E402
from tune_fwd import bench  # noqa: E402  (the one CUDA-event median timer of bench/)


def check(batch, sq, h, hkv, d, cap, causal, paged, splits, seqlen_new, dtype=cp.float16, page=32):
    rng = np.random.default_rng(batch * 31 + sq + d + cap)
    lens = rng.integers(0, cap - seqlen_new + 1, size=batch).astype(np.int32)
    lens[0] = cap - seqlen_new
    q = cp.asarray(rng.standard_normal((batch, sq, h, d), dtype=np.float32)).astype(dtype)
    kc = cp.asarray(rng.standard_normal((batch, cap, hkv, d), dtype=np.float32)).astype(dtype)
    vc = cp.asarray(rng.standard_normal((batch, cap, hkv, d), dtype=np.float32)).astype(dtype)
    kn = cp.asarray(rng.standard_normal((batch, seqlen_new, hkv, d), dtype=np.float32)).astype(dtype) if seqlen_new else None
    vn = cp.asarray(rng.standard_normal((batch, seqlen_new, hkv, d), dtype=np.float32)).astype(dtype) if seqlen_new else None
    # expected cache after append
    ke, ve = kc.copy(), vc.copy()
    for b in range(batch):
        if seqlen_new:
            ke[b, lens[b]:lens[b] + seqlen_new] = kn[b]
            ve[b, lens[b]:lens[b] + seqlen_new] = vn[b]
    kwargs = {}
    if paged:
        pages_per = cap // page
        perm = rng.permutation(batch * pages_per).astype(np.int32)
        table = cp.asarray(perm.reshape(batch, pages_per))
        kp = cp.empty((batch * pages_per, page, hkv, d), dtype=dtype)
        vp = cp.empty_like(kp)
        for b in range(batch):
            for i in range(pages_per):
                kp[perm[b * pages_per + i]] = kc[b, i * page:(i + 1) * page]
                vp[perm[b * pages_per + i]] = vc[b, i * page:(i + 1) * page]
        kc_in, vc_in = kp, vp
        kwargs["block_table"] = table
    else:
        kc_in, vc_in = kc, vc
    out, lse = fa2cupy.flash_attn_with_kvcache(q, kc_in, vc_in, k=kn, v=vn, cache_seqlens=cp.asarray(lens),
                                               causal=causal, num_splits=splits, return_softmax_lse=True, **kwargs)
    worst = 0.0
    for b in range(batch):
        n = int(lens[b]) + seqlen_new
        if n == 0:
            ok0 = bool((out[b] == 0).all())
            worst = max(worst, 0.0 if ok0 else 1.0)
            continue
        ref = fa2cupy.flash_attn_func(q[b:b + 1], ke[b:b + 1, :n], ve[b:b + 1, :n], causal=causal)
        worst = max(worst, float(cp.abs(out[b:b + 1].astype(cp.float32) - ref.astype(cp.float32)).max()))
    if paged and seqlen_new:  # appended rows landed in the right pages
        for b in range(batch):
            for j in range(int(lens[b]), int(lens[b]) + seqlen_new):
                pg = int(table[b, j // page])
                assert bool((kc_in[pg, j % page] == kn[b, j - int(lens[b])]).all())
    if not paged and seqlen_new:
        assert bool((kc_in == ke).all()) and bool((vc_in == ve).all())
    ok = worst < 3e-3
    print(f"{'PASS' if ok else 'FAIL'} b{batch} sq{sq} h{h}/{hkv} d{d} cap{cap} causal={causal} paged={paged} "
          f"splits={splits} new={seqlen_new}: max|diff vs flash_attn_func| {worst:.2e}", flush=True)
    return ok



def bandwidth(b, sk, h=32, hkv=8, d=128):
    kc = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), sk, device="cuda", dtype=torch.int32)
    nbytes = 2 * kc.numel() * 2
    ms = bench(lambda: fa2cupy.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens))
    res = {"fa2cupy": nbytes / ms / 1e9}  # bytes per ms / 1e9 = TB/s
    qt = q.transpose(1, 2)
    kt = kc.transpose(1, 2)
    vt = vc.transpose(1, 2)
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
            res[name] = nbytes / ms / 1e9
        except Exception as e:  # noqa: BLE001
            res[name] = float("nan")
            print(name, "failed", str(e)[:100])
    print(f"decode b={b} sk={sk}: KV TB/s fa2cupy {res['fa2cupy']:.2f}  flash {res['flash']:.2f}  "
          f"cudnn {res['cudnn']:.2f}", flush=True)


def main():
    ok = True
    for paged in (False, True):
        for causal in (False, True):
            ok &= check(3, 1, 32, 8, 128, 256, causal, paged, 0, 0)
            ok &= check(2, 4, 8, 2, 64, 320, causal, paged, 3, 2)
            ok &= check(4, 3, 6, 3, 256, 128, causal, paged, 1, 1)
            ok &= check(2, 8, 16, 16, 96, 192, causal, paged, 7, 0)
            ok &= check(1, 1, 4, 1, 128, 64, causal, paged, 0, 3, dtype=cp.float16)
    print("ALL PASS" if ok else "SOME FAILED", flush=True)
    if "--no-bench" in sys.argv:
        return
    for b, sk in ((1, 1024), (1, 4096), (1, 16384), (1, 65536), (8, 4096), (8, 16384), (8, 65536), (64, 1024),
                  (64, 4096), (64, 16384)):
        bandwidth(b, sk)


if __name__ == "__main__":
    main()
