"""Quick backward check and timing on the GPU (development aid; the real tests are tests/test_backward_gpu.py).

    python bench/bwd_smoke.py            # correctness on small cases, then bwd TFLOPs/s beside SDPA
"""

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
import fa2cupy  # noqa: E402
from tune_fwd import bench  # noqa: E402  (the one CUDA-event median timer of bench/)
from fa2cupy.benchmark import gradient_errors  # noqa: E402


def check(b, sq, sk, h, hkv, d, causal, dtype, deterministic, scale=None):
    torch.manual_seed(b * 7 + sq + sk + d)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
    dq, dk, dv = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal,
                                             deterministic=deterministic)
    torch.cuda.synchronize()
    host = [x.float().cpu().numpy() for x in (dq, dk, dv, dout, q, k, v, out)]
    errs = gradient_errors(host[:3], *host[3:], str(dtype).rpartition(".")[2], scale, causal)
    ok = all(err <= bound for _, err, bound in errs)
    print(f"{'PASS' if ok else 'FAIL'} b{b} sq{sq} sk{sk} h{h}/{hkv} d{d} causal={causal} {dtype} det={deterministic}"
          " err/bound " + " ".join(f"{n} {e / b:.2f}" for n, e, b in errs), flush=True)
    if deterministic:
        again = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal,
                                            deterministic=True)
        same = all(torch.equal(a, b) for a, b in zip((dq, dk, dv), again))
        print("   deterministic repeat bitwise equal:", same)
        ok = ok and same
    return ok



def timing(d, s, causal, deterministic=False):
    b, h = 16384 // s, 2048 // d
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    flops = 2.5 * 4 * b * s * s * h * d / (2 if causal else 1)
    ms = bench(lambda: fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=causal,
                                                   deterministic=deterministic))
    res = {"fa2cupy": flops / ms / 1e9}
    qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dt = dout.transpose(1, 2).contiguous()
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel([backend]):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            ms = bench(lambda: torch.autograd.grad(o, (qt, kt, vt), dt, retain_graph=True))
        res[name] = flops / ms / 1e9
    print(f"bwd d={d} s={s} causal={causal} det={deterministic}: fa2cupy {res['fa2cupy']:.0f}  flash {res['flash']:.0f}"
          f"  cudnn {res['cudnn']:.0f}  ratio vs flash {res['fa2cupy'] / res['flash']:.2f}", flush=True)


def main():
    ok = True
    for dtype in (torch.bfloat16, torch.float16):
        for case in [
            (1, 1, 1, 1, 1, 64, False),
            (2, 128, 128, 4, 4, 64, False),
            (1, 129, 257, 4, 2, 128, True),
            (1, 257, 65, 4, 1, 128, True),
            (2, 97, 383, 6, 3, 40, False),
            (1, 200, 200, 2, 2, 256, True),
            (1, 130, 70, 3, 1, 160, False),
            (1, 64, 100, 2, 1, 96, True),
            (1, 300, 300, 2, 2, 32, True),
            (1, 75, 75, 2, 2, 192, False),
            (1, 75, 88, 2, 1, 224, True),
        ]:
            for det in (False, True):
                ok &= check(*case, dtype, det)
    ok &= check(1, 77, 99, 2, 2, 64, False, torch.bfloat16, False, scale=-0.3)
    print("ALL PASS" if ok else "SOME FAILED", flush=True)
    if "--no-bench" in sys.argv:
        return
    for d in (64, 128):
        for s in (2048, 8192):
            for causal in (False, True):
                timing(d, s, causal)
    timing(128, 8192, False, deterministic=True)


if __name__ == "__main__":
    main()
