"""How the queued eager timing of a decode step depends on the number of calls between its pairs of events, for
fa2cupy and both SDPA backends (the decode bar's call: torch bf16, hq=32 hkv=8 d=128, seqlen_q=1, full caches,
``cache_seqlens`` a tensor). An event recorded between two calls is a stream operation between two kernels, so
the second kernel cannot start early (programmatic launch) after the first; with ``batch`` calls per pair of
events, one call in ``batch`` pays for that. Best of ``--rounds`` rounds, implementations taking turns; beside
them, 16 calls replayed from a CUDA graph (first round).

    python bench/decode_queued_batch.py [--cases 1x16384,1x4096] [--batches 1,8,32,96] [--rounds 3]
"""

import argparse
import contextlib
import sys

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402
from fa2cupy import benchmark as B  # noqa: E402
from decode_ab import D, HKV, bar_inputs  # noqa: E402



def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="1x16384,1x4096")
    parser.add_argument("--batches", default="1,8,32,96")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch = B._torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    events = B.TorchEvents()
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [int(x) for x in args.batches.split(",")]
    for case in args.cases.split(","):
        b, sk = map(int, case.split("x"))
        q, kc, vc, lens = bar_inputs(torch, gen, b, sk)
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        nbytes = B.kv_cache_bytes(b, sk, HKV, D)

        def ours():
            return fa2cupy.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        runners = [("fa2cupy", ours, contextlib.nullcontext),  # (name, call, context it runs in)
                   ("sdpa_flash", sdpa, lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])),
                   ("sdpa_cudnn", sdpa, lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION]))]
        best = {}
        for r in range(args.rounds):
            for name, fn, context in runners:
                with context():
                    for batch in batches:
                        ms = B.time_gpu(fn, events, warmup=10, repeats=max(5, 240 // batch), queued=True,
                                        batch=batch).median_ms
                        best[name, batch] = min(best.get((name, batch), float("inf")), ms)
                if r == 0:  # (the graph replays are steady: one round)
                    best[name, "graph"] = B.graph_ms_per_call(fn, events, context=context)
        print(f"\n{case} ({nbytes / 2**20:.0f} MiB): us per call and TB/s, queued with N calls per pair of events; "
              f"graph of 16 calls")
        for name, _, _ in runners:
            cells = [f"N={n}: {best[name, n] * 1e3:6.1f} us {nbytes / (best[name, n] * 1e-3) / 1e12:4.2f}"
                     for n in batches]
            g = best[name, "graph"]
            print(f"  {name:11s} " + "  ".join(cells) + f"  graph {g * 1e3:6.1f} us {nbytes / (g * 1e-3) / 1e12:4.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
