"""One decode step of fa2cupy, SDPA flash and SDPA cuDNN per case, for Nsight Compute: warm-up outside the
profiled range, then each implementation once inside it (cudaProfilerStart/Stop). Shows which kernels the SDPA
backends launch (grid, block, shared memory) and how many DRAM bytes each one reads.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum,\\
        launch__grid_size,launch__block_size,launch__shared_mem_per_block_dynamic,launch__registers_per_thread \\
        python bench/decode_ncu.py 8x65536 64x16384
"""

import contextlib
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402


def main(cases):
    gen = torch.Generator(device="cuda").manual_seed(0)
    steps = []
    for case in cases:
        batch, seqlen = (int(x) for x in case.split("x"))
        q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        kc = torch.randn(batch, seqlen, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        vc = torch.randn(batch, seqlen, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        lens = torch.full((batch,), seqlen, device="cuda", dtype=torch.int32)
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        steps.append((f"{case} fa2cupy", lambda q=q, kc=kc, vc=vc, lens=lens: fa2cupy.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lens), None))
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            steps.append((f"{case} sdpa {name}", lambda qt=qt, kt=kt, vt=vt: torch.nn.functional.
                          scaled_dot_product_attention(qt, kt, vt, enable_gqa=True), backend))
    def run(fn, backend):
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            fn()

    for _ in range(3):
        for _, fn, backend in steps:
            run(fn, backend)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn, backend in steps:
        torch.cuda.nvtx.range_push(name)
        run(fn, backend)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(name for name, _, _ in steps))


if __name__ == "__main__":
    main(sys.argv[1:] or ["8x65536", "64x16384", "1x16384"])
