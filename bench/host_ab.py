"""Host time of cached calls from torch, in interleaved rounds in one process (the device machine's host drifts by
up to 2x between runs, so only interleaved rounds compare): torch's allocation forms, then a cached decode step
(with and without its lse) and a cached forward beside SDPA. Rounds alternate their order; median per variant.
(bench/dispatch_profile.py gives the same calls' time one after another, with a cProfile of each.)

The session-25 comparison of the old allocation (a size tuple) against the shipped one (sizes as separate
arguments) is bench/results/host_alloc_ab_h100_20261125-s25-call{7,8}.log, made by this script as of 02e53b2,
which monkeypatched the old code in.

    python bench/host_ab.py
"""
import contextlib
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402


def ab(variants, n=400, rounds=25):
    """Prints each (name, fn[, context]) variant's median and best host time per call over interleaved rounds; a
    variant's context (SDPA's backend choice) is entered around each round's calls, not around every call."""
    variants = [(v[0], v[1], v[2] if len(v) > 2 else contextlib.nullcontext) for v in variants]
    times = {name: [] for name, *_ in variants}
    for _, fn, context in variants:
        with context():
            for _ in range(100):
                fn()
    for r in range(rounds):
        for name, fn, context in (variants if r % 2 == 0 else variants[::-1]):
            with context():
                t = time.perf_counter()
                for _ in range(n):
                    fn()
                times[name].append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    for name, *_ in variants:
        print(f"  {name:<38} median {statistics.median(times[name]):6.2f} us  min {min(times[name]):6.2f}",
              flush=True)


def sdpa_with(backend, *args, **kwargs):
    """(SDPA call, its backend context)."""
    return (lambda: torch.nn.functional.scaled_dot_product_attention(*args, **kwargs),
            lambda: torch.nn.attention.sdpa_kernel([backend]))


def main():
    dt, dev = torch.bfloat16, torch.device("cuda", 0)
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    shape = (1, 1, 32, 128)
    template = torch.empty(0, dtype=dt, device=dev)
    print("allocation forms")
    ab([("torch.empty(tuple, dtype=, device=)", lambda: torch.empty(shape, dtype=dt, device=dev)),
        ("torch.empty(*sizes, dtype=, device=)", lambda: torch.empty(*shape, dtype=dt, device=dev)),
        ("template.new_empty(tuple)", lambda: template.new_empty(shape)),
        ("torch.empty_like(q)", lambda: torch.empty_like(q))])

    k_cache = torch.randn(1, 1024, 8, 128, device=dev, dtype=dt)
    lens = torch.full((1,), 1024, device=dev, dtype=torch.int32)
    qf = torch.randn(1, 128, 1, 64, device=dev, dtype=dt)
    qt, kt, qft = q.transpose(1, 2), k_cache.transpose(1, 2).contiguous(), qf.transpose(1, 2)
    SDPBackend = torch.nn.attention.SDPBackend
    print("cached calls (b1 d128 1k cache decode; b1 s128 d64 forward)")
    ab([("decode step", lambda: fa2cupy.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=lens)),
        ("decode step, lse", lambda: fa2cupy.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=lens,
                                                                     return_softmax_lse=True)),
        ("SDPA cuDNN decode", *sdpa_with(SDPBackend.CUDNN_ATTENTION, qt, kt, kt, enable_gqa=True)),
        ("forward", lambda: fa2cupy.flash_attn_func(qf, qf, qf)),
        ("SDPA flash forward", *sdpa_with(SDPBackend.FLASH_ATTENTION, qft, qft, qft))])


if __name__ == "__main__":
    main()
