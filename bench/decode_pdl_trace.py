"""What a programmatic launch overlaps between consecutive decode calls, queued on a stream and replayed from a
CUDA graph. Two traced builds of the shipped decode kernel (each with its own trace array, cuda/decode.cu's
FA2_DECODE_TRACE_ARRAY) take turns, A B A B ..., so the last B and the A before it both keep their marks. For
that B, per block: its start (point 0, before griddepcontrol.wait), its release from the wait (22) and its first
tiles landed (1), against the end of the A before it (its last merging block's merge, point 16, or its last rows
written, 14). Same call as the decode bar: torch bf16, hq=32 hkv=8 d=128, seqlen_q=1, cache_seqlens a tensor.

    python bench/decode_pdl_trace.py [--cases 1x16384,1x4096] [--calls 8]
"""

import argparse
import sys

import cupy
import numpy as np

sys.path.insert(0, ".")
from fa2cupy import benchmark as B  # noqa: E402
from fa2cupy import build, decode, device_errors  # noqa: E402
from decode_ab import D, HKV, bar_inputs  # noqa: E402

POINTS = 24  # kTracePoints
ARRAYS = ("fa2_decode_trace", "fa2_decode_trace_b")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="1x16384,1x4096")
    parser.add_argument("--calls", type=int, default=8, help="calls per sequence (even: the last is B)")
    args = parser.parse_args()
    torch = B._torch()
    device = cupy.cuda.runtime.getDevice()
    arch = int(cupy.cuda.Device().compute_capability)
    errors = device_errors.pointers(device)
    events = B.TorchEvents()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in args.cases.split(","):
        b, sk = map(int, case.split("x"))
        q, kc, vc, lens = bar_inputs(torch, gen, b, sk)

        def plan():
            strides = {name: tuple(2 * s for s in t.stride()) for name, t in (("q", q), ("k_cache", kc),
                                                                               ("v_cache", vc))}
            return decode.plan_decode(tuple(q.shape), strides, "bfloat16", nheads_kv=HKV, cache_rows=b, capacity=sk,
                                      page_size=0, max_pages=0, seqlen_new=0, max_seqlen_k=sk,
                                      softmax_scale=D ** -0.5, causal=False, arch=arch, device=device,
                                      num_splits=0, item=2)

        shipped = plan()
        name = shipped.config.name_expression("bfloat16", False, False)
        smem = decode._opt_in_smem(shipped.config, device)
        launches, traces = [], []
        for array in ARRAYS:
            module = build.install_traced("decode", name, smem, ["-DFA2_DECODE_TRACE",
                                                                 f"-DFA2_DECODE_TRACE_ARRAY={array}"])
            traces.append(module.get_global(array))
            launches.append((plan(), torch.empty_like(q)))
        inputs = [q.data_ptr(), kc.data_ptr(), vc.data_ptr(), 0, 0, lens.data_ptr(), 0, 0]

        def sequence():
            stream = torch.cuda.current_stream().cuda_stream
            for i in range(args.calls):
                p, out = launches[i % 2]
                decode.run_decode(p, inputs, out.data_ptr(), 0, sk, stream, p.workspace(stream, "torch", device),
                                  errors)

        host = np.zeros(8192 * POINTS * 2, dtype=np.uint64)

        def read():
            torch.cuda.synchronize()
            raw = []
            for trace in traces:
                trace.copy_to_host(host.ctypes.data, host.nbytes)
                raw.append(host.reshape(-1, POINTS, 2)[:, :, 0].astype(np.int64).copy())
            return raw

        def clear():
            torch.cuda.synchronize()
            for trace in traces:
                trace.memset_async(0, host.nbytes)
            cupy.cuda.runtime.deviceSynchronize()

        print(f"\n{case}: splits={shipped.splits} grid={shipped.attention.grid[0]} "
              f"programmatic={shipped.attention._config is not None} {name}")
        # queued: the sequence enqueued behind a spinning kernel
        for _ in range(3):
            sequence()
        for attempt in range(4):
            clear()
            held = events.hold(2.0 * 2 ** attempt)
            sequence()
            if not held.query():
                break
        report("queued", *read())
        # graph: the same sequence captured, replayed
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            sequence()
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            sequence()
        for _ in range(3):
            graph.replay()
        clear()
        graph.replay()
        report("graph", *read())


def report(mode, a, b):
    """The last B's blocks against the end of the A before it (microseconds)."""
    a_end = max(a[:, 16].max(), a[:, 14].max())
    a_start = a[a[:, 0] > 0, 0].min()
    seen = b[:, 0] > 0
    start, release, landed = b[seen, 0], b[seen, 22], b[seen, 1]
    b_end = max(b[:, 16].max(), b[:, 14].max())

    def pct(x):
        x = (x - a_end) / 1e3
        return f"min {x.min():6.2f}  median {np.median(x):6.2f}  max {x.max():6.2f}"

    print(f"  {mode}: A ran {(a_end - a_start) / 1e3:.2f} us (its first block's start to its end); "
          f"B ended {(b_end - a_end) / 1e3:.2f} us after A's end; {seen.sum()} B blocks; times from A's end:")
    print(f"    B block start            {pct(start)}")
    print(f"    B released from the wait {pct(release)}")
    print(f"    B first tiles landed     {pct(landed)}")
    lead = (release - start) / 1e3
    print(f"    wait (release - start)   min {lead.min():6.2f}  median {np.median(lead):6.2f}  max {lead.max():6.2f}")


if __name__ == "__main__":
    main()
