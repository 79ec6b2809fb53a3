"""The Hopper forward (cuda/fwd_hopper.cu) against the mma.sync forward and torch SDPA, in one process.

    python bench/hopper_fwd.py [--check-only] [--window-rounds 3] [--counter-ab '1024 16384']

1. Correctness: ragged, GQA, causal, windowed and both dtypes, each against a float32 torch reference (outputs
   poisoned with NaN before every launch), the mma.sync kernel's error beside it.
2. Speed (bf16, 16k tokens per batch, hidden 2048): TFLOPs/s of the Hopper kernel, the mma.sync kernel and
   SDPA's flash and cuDNN backends, CUDA events, median.
3. The sliding-window bar: (4096, 0) over 64k tokens against full causal, h16 d128, rounds of causal and window
   back to back on each kernel.
"""

import argparse
import statistics
import sys

import torch

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402
from fa2cupy import benchmark as B  # noqa: E402
from fa2cupy import configs, forward, interface  # noqa: E402


def use_hopper(on: bool) -> None:
    forward.HOPPER = on
    if on:  # the Hopper kernel whatever the length of a masked call
        configs.HOPPER_MASKED_MIN_SEQLEN.update(dict.fromkeys(configs.HOPPER_MASKED_MIN_SEQLEN, 0))
    interface._cached_calls.clear()


def reference(q, k, v, causal, window):
    """float32 attention with flash-attn's bottom-right aligned causal / window mask, and its lse."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    kf = kf.repeat_interleave(h // hkv, dim=1)
    vf = vf.repeat_interleave(h // hkv, dim=1)
    s = qf @ kf.transpose(-1, -2) * d ** -0.5
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    left, right = window if window else (-1, -1)
    if causal:
        right = 0
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= j <= i + sk - sq + right
    if left >= 0:
        visible &= j >= i + sk - sq - left
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2), lse


def check(cases):
    forward._debug_poison = True
    worst = 0.0
    for b, sq, sk, h, hkv, d, causal, window, dtype in cases:
        torch.manual_seed(sq * 7 + sk)
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
        ref, ref_lse = reference(q, k, v, causal, window)
        errs = {}
        for name, on in (("hopper", True), ("mma.sync", False)):
            use_hopper(on)
            out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=causal, window_size=window or (-1, -1),
                                                  return_attn_probs=True)
            torch.cuda.synchronize()
            finite = bool(torch.isfinite(out).all())
            e_out = float((out.float() - ref).abs().max())
            rows = torch.isfinite(ref_lse)
            e_lse = float((lse - ref_lse)[rows].abs().max()) if rows.any() else 0.0
            e_lse = e_lse if bool((torch.isinf(lse) == ~rows).all()) else float("inf")
            errs[name] = (finite, e_out, e_lse)
        hf, he, hl = errs["hopper"]
        _, me, ml = errs["mma.sync"]
        ok = hf and he <= max(2 * me, 2e-2) and hl <= max(2 * ml, 1e-3)
        worst = max(worst, he)
        print(f"{'ok  ' if ok else 'FAIL'} b={b} sq={sq} sk={sk} h={h}/{hkv} d={d} causal={causal} window={window} "
              f"{str(dtype)[6:]}: hopper out {he:.2e} lse {hl:.2e} | mma.sync out {me:.2e} lse {ml:.2e}",
              flush=True)
    forward._debug_poison = False
    return worst


def speed(cases, repeats):
    events = B.TorchEvents()
    print(f"{'case':34s} {'hopper':>8s} {'mma':>8s} {'flash':>8s} {'cudnn':>8s}  hopper/flash hopper/cudnn")
    for d, s, causal in cases:
        h = 2048 // d
        b = 16384 // s
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * s * s * h * d / (2 if causal else 1)
        res = {}
        for name, on in (("hopper", True), ("mma", False)):
            use_hopper(on)
            res[name] = B.time_gpu(lambda: fa2cupy.flash_attn_func(q, k, v, causal=causal), events,
                                   repeats=repeats).median_ms
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            with sdpa_kernel([backend]):
                res[name] = B.time_gpu(lambda: torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=causal), events, repeats=repeats).median_ms
        tf = {n: flops / ms / 1e9 for n, ms in res.items()}
        print(f"d={d} s={s} b={b} h={h} causal={causal!s:5s}      {tf['hopper']:8.1f} {tf['mma']:8.1f} "
              f"{tf['flash']:8.1f} {tf['cudnn']:8.1f}  {tf['hopper'] / tf['flash']:8.3f} "
              f"{tf['hopper'] / tf['cudnn']:8.3f}", flush=True)


def window_bar(rounds, seqlen=65536, window=(4096, 0)):
    events = B.TorchEvents()
    q, k, v = (torch.randn(1, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name, on in (("hopper", True), ("mma.sync", False)):
        use_hopper(on)
        causal_ms, window_ms = [], []
        for _ in range(rounds):
            causal_ms.append(B.time_gpu(lambda: fa2cupy.flash_attn_func(q, k, v, causal=True), events, warmup=2,
                                        repeats=5).median_ms)
            window_ms.append(B.time_gpu(lambda: fa2cupy.flash_attn_func(q, k, v, causal=True, window_size=window),
                                        events, warmup=2, repeats=10).median_ms)
        c, w = statistics.median(causal_ms), statistics.median(window_ms)
        print(f"window bar {name}: causal {c:.2f} ms ({4 * seqlen ** 2 * 16 * 128 / 2 / c / 1e9:.0f} "
              f"TFLOPs/s), window {w:.2f} ms, speed-up {c / w:.2f}x (rounds: "
              f"{', '.join(f'{a / b:.2f}' for a, b in zip(causal_ms, window_ms))})", flush=True)


def counter_ab(lengths, repeats, rounds=2):
    """Masked calls on the Hopper kernel with the grid stride against the tile counter at several L2 group sizes
    (and the mma.sync kernel, SDPA flash), variants taking turns, best round each: TFLOPs/s."""
    events = B.TorchEvents()
    shipped = configs.HOPPER_L2_GROUP_BYTES
    variants = [("stride", True, False, shipped)] + [(f"ctr{mb}M", True, True, mb << 20) for mb in (8, 16, 32)] + [
        ("mma", False, False, shipped)]
    # (the same batch as equal-length varlen sequences, on the Hopper kernel with the counter and on mma.sync)
    variants += [("hop-vl", True, True, shipped), ("mma-vl", False, False, shipped)]
    print(f"{'case':30s} " + " ".join(f"{n:>8s}" for n, *_ in variants) + f" {'flash':>8s}")
    for d in (64, 128):
        for s in lengths:
            h, b = 2048 // d, max(1, 16384 // s)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            cu = torch.arange(0, b * s + 1, s, device="cuda", dtype=torch.int32)
            qv, kv, vv = (x.reshape(b * s, h, d) for x in (q, k, v))
            flops = 4 * b * s * s * h * d / 2
            best = {}
            for _ in range(rounds):
                for name, hopper, counter, group in variants:
                    use_hopper(hopper)
                    forward.TILE_COUNTER, configs.HOPPER_L2_GROUP_BYTES = counter, group
                    if name.endswith("-vl"):
                        step = lambda: fa2cupy.flash_attn_varlen_func(qv, kv, vv, cu, cu, s, s, causal=True)
                    else:
                        step = lambda: fa2cupy.flash_attn_func(q, k, v, causal=True)
                    ms = B.time_gpu(step, events, repeats=repeats).median_ms
                    best[name] = min(best.get(name, ms), ms)
            forward.TILE_COUNTER, configs.HOPPER_L2_GROUP_BYTES = True, shipped
            from torch.nn.attention import SDPBackend, sdpa_kernel
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                best["flash"] = B.time_gpu(lambda: torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=True), events, repeats=repeats).median_ms
            print(f"d={d} s={s} b={b} h={h} causal    " +
                  " ".join(f"{flops / best[n] / 1e9:8.1f}" for n in [v[0] for v in variants] + ["flash"]), flush=True)


def window_sweep(repeats, seqlen=65536, lefts=(1024, 2048, 4096, 8192, 16384)):
    """Forward time of (left, 0) windows over 64k tokens (h16 d128) against the key tiles they visit: the fit's
    slope is the time per 128 x 128 tile, its intercept per work item the cost an item pays whatever its length."""
    import numpy as np

    events = B.TorchEvents()
    use_hopper(True)
    q, k, v = (torch.randn(1, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    m_blocks, items = seqlen // 128, seqlen // 128 * 16
    rows = []
    for left in lefts + (None,):
        window = (left, 0) if left else (-1, -1)
        tiles = 16 * sum(min(m + 1, (left + 127) // 128 + 1) if left else m + 1 for m in range(m_blocks))
        ms = B.time_gpu(lambda: fa2cupy.flash_attn_func(q, k, v, causal=True, window_size=window), events,
                        warmup=2, repeats=repeats).median_ms
        rows.append((left, tiles, ms))
        print(f"window {window}: {tiles} tiles, {ms:.3f} ms, {ms * 1e3 * 132 / tiles:.3f} us per tile per SM",
              flush=True)
    t = np.array([r[1] for r in rows[:-1]], float)
    y = np.array([r[2] for r in rows[:-1]], float) * 1e3 * 132  # SM-microseconds
    slope, intercept = np.polyfit(t, y, 1)
    print(f"fit over the windows: {slope:.3f} us per tile per SM, {intercept / items:.3f} us per item "
          f"(= {intercept / items / slope:.2f} tiles); causal {rows[-1][2] * 1e3 * 132 / rows[-1][1]:.3f} us per tile")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--window-rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--window-sweep", action="store_true", help="window sizes against tiles visited (then exit)")
    ap.add_argument("--counter-ab", default="", help="lengths, e.g. '1024 4096 16384': causal TFLOPs/s with the "
                                                     "grid stride and the tile counter (then exit)")
    ap.add_argument("--rows", default="", help="rows to compare, e.g. '128:128,2,3,2 128:128,3,3,1' (d:block_n,"
                                               "k_stages,v_stages,q_buffers): speed and window bar on each, no check")
    args = ap.parse_args()
    if args.window_sweep:
        window_sweep(args.repeats)
        return
    if args.counter_ab:
        counter_ab([int(x) for x in args.counter_ab.split()], args.repeats)
        return
    if args.rows:
        shipped = dict(configs.FORWARD_HOPPER_TABLE)
        for spec in args.rows.split():
            d, rest = spec.split(":")
            configs.FORWARD_HOPPER_TABLE[int(d)] = configs.HopperFwdConfig(int(d), *map(int, rest.split(",")))
            print(f"--- row {configs.FORWARD_HOPPER_TABLE[int(d)]}", flush=True)
            check([(2, 1000, 1000, 4, 2, int(d), True, None, torch.bfloat16),
                   (1, 3000, 3000, 2, 2, int(d), True, (1000, 0), torch.bfloat16)])
            speed([(int(d), 2048, False), (int(d), 8192, False), (int(d), 8192, True), (int(d), 2048, True)],
                  args.repeats)
            if int(d) == 128:
                window_bar(args.window_rounds)
            configs.FORWARD_HOPPER_TABLE.update(shipped)
        return
    bf, fp = torch.bfloat16, torch.float16
    check([
        (2, 256, 256, 4, 4, 128, False, None, bf),
        (2, 200, 333, 4, 2, 128, True, None, bf),
        (1, 1000, 1000, 2, 1, 64, False, (100, 50), fp),
        (3, 128, 1024, 4, 4, 64, True, None, bf),
        (1, 77, 77, 3, 3, 64, False, None, bf),
        (2, 1024, 1000, 8, 2, 128, False, (256, 0), bf),
        (1, 333, 128, 2, 2, 128, True, None, fp),
        (1, 3000, 3000, 2, 2, 128, True, (1000, 0), bf),
        (2, 1, 500, 4, 1, 64, True, None, bf),
    ])
    if args.check_only:
        return
    speed([(128, 2048, False), (128, 8192, False), (128, 8192, True), (64, 8192, False), (64, 8192, True),
           (128, 2048, True)], args.repeats)
    window_bar(args.window_rounds)


if __name__ == "__main__":
    main()
