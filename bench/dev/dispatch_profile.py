"""Host time of one cached fa2cupy call, and where it goes (cProfile), for torch and CuPy callers.

Run on the GPU: ``python bench/dev/dispatch_profile.py``. A tiny problem (b1 s128 h1 d64) keeps the GPU out of the
picture; the host loop is not synchronised, so this is the dispatch cost a training loop would see.
"""

import cProfile
import itertools
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


def profile(name, fn, calls=2000):
    """Host time per call of ``fn``, then where it goes (cProfile, the 14 most expensive functions)."""
    print(f"{name}: {per_call_us(fn):.1f} us per call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def main():
    import torch

    q = torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16)
    qc = cupy.from_dlpack(q)
    for name, args in (("torch", (q, q, q)), ("cupy", (qc, qc, qc))):
        profile(name, lambda: fa2cupy.flash_attn_func(*args))
    # Other arrays every call, as in training: on the Hopper forward the call encodes its tensor maps anew.
    calls = itertools.cycle([(q, q, q), (torch.randn_like(q),) * 3])
    profile("torch, other arrays each call", lambda: fa2cupy.flash_attn_func(*next(calls)))
    if int(cupy.cuda.Device().compute_capability) == 90:
        # A causal call on the Hopper forward that zeroes a tile counter per launch (its two work items on a
        # pretend one-SM GPU, so the call stays tiny): the host time the counter adds to a cached call.
        from fa2cupy import forward
        from fa2cupy.options import KernelOptions

        options = KernelOptions(hopper_masked_min_seqlen=0, sm_count=1)
        real_plan, plans = forward.plan_forward, []
        forward.plan_forward = lambda *a, **kw: plans.append(real_plan(*a, **kw)) or plans[-1]
        qh = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
        qhc = cupy.from_dlpack(qh)
        for name, args in (("torch causal, tile counter", (qh, qh, qh)), ("cupy causal, tile counter",
                                                                         (qhc, qhc, qhc))):
            profile(name, lambda: fa2cupy.flash_attn_func(*args, causal=True, kernel_options=options))
        forward.plan_forward = real_plan
        assert plans and all(plan.tile_counter for plan in plans)
    # Decode step: b1, one query, 32/8 heads, d128, a 1k cache (the GPU work is ~3 us: this is host time).
    qd = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((1,), 1024, device="cuda", dtype=torch.int32)
    qdc, kcc, lensc = cupy.from_dlpack(qd), cupy.from_dlpack(kc), cupy.from_dlpack(lens)
    for name, args in (("kvcache torch", (qd, kc, kc, lens)), ("kvcache cupy", (qdc, kcc, kcc, lensc)),
                       ("kvcache torch int", (qd, kc, kc, 1024))):
        profile(name, lambda: fa2cupy.flash_attn_with_kvcache(args[0], args[1], args[2], cache_seqlens=args[3]))
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
        with torch.nn.attention.sdpa_kernel([getattr(torch.nn.attention.SDPBackend, backend)]):
            qt, kt = qd.transpose(1, 2), kc.transpose(1, 2).contiguous()
            fn = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, kt, enable_gqa=True)  # noqa: E731
            print(f"SDPA {backend} decode: {per_call_us(fn):.1f} us per call")
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
        qt = q.transpose(1, 2)
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(qt, qt, qt)  # noqa: E731
        print(f"SDPA flash: {per_call_us(fn):.1f} us per call")


if __name__ == "__main__":
    main()
