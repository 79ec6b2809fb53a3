"""Host time of one cached fa2cupy call, and where it goes (cProfile), for torch and CuPy callers.

Run on the GPU: ``python bench/dispatch_profile.py``. A tiny problem (b1 s128 h1 d64) keeps the GPU out of the
picture; the host loop is not synchronised, so this is the dispatch cost a training loop would see.
"""

import cProfile
import pstats
import sys
import time

import cupy

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n // 5):
            fn()
        times.append((time.perf_counter() - t) / (n // 5) * 1e6)
        cupy.cuda.runtime.deviceSynchronize()
    return sorted(times)[2]


def main():
    import torch

    q = torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16)
    qc = cupy.from_dlpack(q)
    for name, args in (("torch", (q, q, q)), ("cupy", (qc, qc, qc))):
        fn = lambda: fa2cupy.flash_attn_func(*args)  # noqa: E731
        print(f"{name}: {per_call_us(fn):.1f} us per call")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
        qt = q.transpose(1, 2)
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(qt, qt, qt)  # noqa: E731
        print(f"SDPA flash: {per_call_us(fn):.1f} us per call")


if __name__ == "__main__":
    main()
