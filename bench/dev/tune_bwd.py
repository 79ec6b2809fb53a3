"""Times every backward tile candidate (bench/dev/candidates.py) beside torch SDPA flash and cuDNN.

Run on the GPU: ``python bench/dev/tune_bwd.py [--seqlens 2048,8192]``. Each candidate's gradients are first compared
with those of the shipped table entry (itself validated by tests/test_backward_gpu.py); a candidate that
disagrees is reported as WRONG and not timed. FA2 paper grid, FLOPs = 2.5 x forward.
"""

import argparse
import json
import sys

import cupy
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402
from fa2cupy import arrays, backward  # noqa: E402

import candidates  # noqa: E402  (bench/dev/, this script's folder)

sys.path.insert(0, "bench")
from tune_fwd import bench  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--headdims", default="64,128")
    args = parser.parse_args()
    arch = int(cupy.cuda.Device().compute_capability)
    stream = arrays.caller_stream("torch", torch.cuda.current_device())
    for d in map(int, args.headdims.split(",")):
        for s in map(int, args.seqlens.split(",")):
            b, h = 16384 // s, 2048 // d
            for causal in (False, True):
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
                want = fa2cupy.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)
                flops = 2.5 * 4 * b * s * s * h * d / (2 if causal else 1)
                res = {"headdim": d, "seqlen": s, "causal": causal}
                qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
                dt = dout.transpose(1, 2).contiguous()
                for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                    with sdpa_kernel([backend]):
                        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        ms = bench(lambda: torch.autograd.grad(o, (qt, kt, vt), dt, retain_graph=True))
                    res[name] = flops / ms / 1e9
                dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
                dsum = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
                accum = torch.empty(b, h, s, d, device="cuda", dtype=torch.float32)
                names = ("q", "k", "v", "dout", "out", "dq", "dk", "dv")
                tensors = (q, k, v, dout, out, dq, dk, dv)
                strides = {n: x.stride() for n, x in zip(names, tensors)}
                ptrs = dict(backward.NO_POINTERS, **{n: x.data_ptr() for n, x in zip(names, tensors)})
                ptrs.update(softmax_lse=lse.data_ptr(), dsum=dsum.data_ptr(), dq_accum=accum.data_ptr())
                for cfg in candidates.BACKWARD_CANDIDATES[d]:
                    key = f"{cfg.block_m}x{cfg.block_n}w{cfg.warps}k{cfg.warps_keys}-{cfg.warps_keys2}s{cfg.stages}"
                    plan = backward.plan_backward(q.shape, k.shape, strides, "bfloat16", d ** -0.5, causal, False,
                                                  arch, config=cfg)
                    launch = lambda: backward.run_backward(plan, ptrs, (0, 0), stream.ptr)  # noqa: E731
                    for g in (dq, dk, dv):
                        g.fill_(float("nan"))
                    launch()
                    torch.cuda.synchronize()
                    err = max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
                              for g, w in zip((dq, dk, dv), want))
                    if not err < 2e-2:
                        res[key] = f"WRONG rel err {err}"
                        continue
                    res[key] = flops / bench(launch) / 1e9
                print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
