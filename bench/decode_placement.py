"""How the decode bar's queued timing moves with where the plan's workspace lies in memory (the split partials and
arrival counters): the same call timed after more and more unrelated memory was allocated, each time with a fresh
plan (so a fresh workspace), queued (8 calls per pair of events, best of 3) and from a CUDA graph (whose capture
stream has a workspace of its own). Session 31 found the queued 1 x 16k time of one kernel moving by ~1 us this way.

    python bench/decode_placement.py [--case 1x16384] [--steps 4] [--step-mib 24]
"""

import argparse
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
import fa2cupy  # noqa: E402
from fa2cupy import benchmark as B, interface  # noqa: E402
from decode_ab import bar_inputs  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="1x16384")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--step-mib", type=int, default=24)
    args = parser.parse_args()
    torch = B._torch()
    events = B.TorchEvents()
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, sk = map(int, args.case.split("x"))
    q, kc, vc, lens = bar_inputs(torch, gen, b, sk)
    nbytes = B.kv_cache_bytes(b, sk, kc.shape[2], kc.shape[3])

    def call():
        return fa2cupy.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)

    held = []
    for step in range(args.steps):
        interface._cached_calls.clear()  # a fresh plan: its workspace goes where the allocator now puts it
        queued = min(B.time_gpu(call, events, warmup=10, repeats=30, queued=True, batch=8).median_ms
                     for _ in range(3))
        graph = B.graph_ms_per_call(call, events)
        print(f"{args.case} after {sum(x.numel() for x in held) >> 20:4d} MiB more: queued {queued * 1e3:6.2f} us "
              f"= {nbytes / (queued * 1e-3) / 1e12:.2f} TB/s, graph {graph * 1e3:6.2f} us "
              f"= {nbytes / (graph * 1e-3) / 1e12:.2f} TB/s", flush=True)
        held.append(torch.empty((step + 1) * (args.step_mib << 20), dtype=torch.uint8, device="cuda"))


if __name__ == "__main__":
    main()
