"""Times every forward tile candidate (bench/dev/candidates.py) beside torch SDPA flash and cuDNN.

Run on the GPU: ``python bench/dev/tune_fwd.py [--seqlens 2048,8192] [--json out.json]``. Each candidate is first
checked against SDPA's math backend (fp32 upcast); a wrong candidate is reported, never timed.
FA2 paper grid: 16k tokens per batch, hidden 2048.
"""

import argparse
import json
import sys

import cupy
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".")
from fa2cupy import arrays, forward  # noqa: E402

import candidates  # noqa: E402  (bench/dev/, this script's folder)


def bench(fn, iters=30, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    arch = int(cupy.cuda.Device().compute_capability)
    stream = arrays.caller_stream("torch", torch.cuda.current_device())
    rows = []
    for d in map(int, args.headdims.split(",")):
        for s in map(int, args.seqlens.split(",")):
            b, h = 16384 // s, 2048 // d
            for causal in (False, True):
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                flops = 4 * b * s * s * h * d / (2 if causal else 1)
                res = {"headdim": d, "seqlen": s, "causal": causal}
                for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel([backend]):
                            ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                        res[name] = flops / ms / 1e9
                    except Exception as e:  # noqa: BLE001
                        res[name] = None
                        print(name, "failed:", e)
                with sdpa_kernel([SDPBackend.MATH]):
                    ref = torch.nn.functional.scaled_dot_product_attention(
                        qt[:1].float(), kt[:1].float(), vt[:1].float(), is_causal=causal).transpose(1, 2)
                out = torch.empty_like(q)
                lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
                for cfg in candidates.FORWARD_CANDIDATES[d]:
                    key = f"{cfg.block_m}x{cfg.block_n}w{cfg.warps}s{cfg.stages}{'q' if cfg.q_in_regs else ''}"
                    plan = forward.plan_forward(q.shape, k.shape, tuple(x.stride() for x in (q, k, v, out)),
                                                "bfloat16", d ** -0.5, causal, arch, config=cfg)
                    pointers = dict(forward.NO_POINTERS, q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(),
                                    out=out.data_ptr(), softmax_lse=lse.data_ptr())
                    launch = lambda: forward.run_forward(plan, pointers, (0, 0), stream.ptr)  # noqa: E731
                    out.fill_(float("nan"))
                    launch()
                    torch.cuda.synchronize()
                    err = ((out[:1].float() - ref).norm() / ref.norm()).item()
                    if not err < 2e-2:
                        res[key] = f"WRONG rel err {err}"
                        continue
                    res[key] = flops / bench(launch) / 1e9
                rows.append(res)
                print(json.dumps(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
