"""Where a decode launch spends its time, block by block: builds decode_attention with FA2_DECODE_TRACE (thread 0
of each block records %globaltimer at numbered points, cuda/decode.cu's decode_mark) and prints, per case, when
the blocks start and how long each phase takes (median and max over blocks, microseconds from the first block's
start). Same shape as the decode bar (hq=32 hkv=8 d=128, seqlen_q=1, full caches).

    python bench/decode_trace.py [--cases 1x16384,64x1024] [--config 32,2,4,1] [--splits 0]
"""

import argparse
import sys

import cupy
import numpy as np

sys.path.insert(0, ".")
from fa2cupy import benchmark as B  # noqa: E402
from fa2cupy import build, configs, decode, device_errors  # noqa: E402
from tune_decode import D, HKV, decode_caches, decode_step  # noqa: E402

POINTS = 24  # kTracePoints
PHASES = (  # (label, from point, to point)
    ("prologue (Q + first tiles landed)", 0, 1),
    ("tile 0 wait", 1, 2),
    ("tiles 1-7 (per tile)", 3, 10),
    ("loop end (warp 0)", 1, 12),
    ("other warps' loops", 12, 13),
    ("warp rows to shared memory", 13, 20),
    ("block lse and weights", 20, 21),
    ("block rows written", 21, 14),
    ("fence + arrival", 14, 15),
    ("split lse and weights (last block)", 15, 17),
    ("split sums", 17, 18),
    ("split rows written", 18, 16),
)


def traced_kernel(name, smem_bytes):
    module = cupy.RawModule(code=build.source("decode"), options=build.NVRTC_OPTIONS + ("-DFA2_DECODE_TRACE",),
                            name_expressions=(name,))
    raw = module.get_function(name)
    raw.max_dynamic_shared_size_bytes = smem_bytes
    return module, raw.kernel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="1x4096,1x16384,8x1024,64x1024,8x65536")
    parser.add_argument("--config", default=None, help="block_n,stages,warps,l2_prefetch (default: shipped)")
    parser.add_argument("--splits", default="0", help="comma-separated num_splits (0 = heuristic)")
    args = parser.parse_args()
    device = cupy.cuda.runtime.getDevice()
    config = configs.decode_config(int(cupy.cuda.Device().compute_capability), D)
    if args.config:
        bn, st, w, pf = (int(x) for x in args.config.split(","))
        config = configs.DecodeConfig(D, bn, st, w, bool(pf))
    name = decode.attention_name_expression(config, "float16", False, False, False)
    module, kernel = traced_kernel(name, decode._opt_in_smem(config, device))
    build._kernels[("decode", name, device)] = kernel  # plan_decode picks the traced build
    trace = module.get_global("fa2_decode_trace")
    trace_host = np.zeros(8192 * POINTS * 2, dtype=np.uint64)  # fa2_decode_trace's size
    errors = device_errors.pointers(device)
    events = B.CupyEvents()
    rng = cupy.random.default_rng(0)
    print(f"config bn{config.block_n} st{config.stages} w{config.warps} pf{int(config.l2_prefetch)}")
    for case in args.cases.split(","):
        b, sk = map(int, case.split("x"))
        q, kc, vc = decode_caches(rng, b, sk)
        nbytes = B.kv_cache_bytes(b, sk, HKV, D)
        for splits in map(int, args.splits.split(",")):
            plan, run, _ = decode_step(q, kc, vc, config, splits, errors)
            t = B.time_gpu(run, events, warmup=10, repeats=50)
            trace.memset_async(0, trace_host.nbytes)  # then one launch, warm, read back
            run()
            cupy.cuda.runtime.deviceSynchronize()
            trace.copy_to_host(trace_host.ctypes.data, trace_host.nbytes)
            stamps = trace_host.reshape(-1, POINTS, 2)[:, :, 0].astype(np.int64)
            print(f"\n{case} splits={plan.splits}: {nbytes / (t.median_ms * 1e-3) / 1e12:.2f} TB/s, "
                  f"{t.median_ms * 1e3:.1f} us per call (events, back to back)")
            blocks = stamps[stamps[:, 0] > 0]
            start = blocks[:, 0].min()
            rel = np.where(blocks > 0, blocks - start, -1) / 1e3
            ends = np.maximum(rel[:, 14], rel[:, 16])
            print(f"  {len(blocks)} blocks on {len(np.unique(blocks[:, POINTS - 1]))} SMs; entry spread "
                  f"median {np.median(rel[:, 0]):.2f} max {rel[:, 0].max():.2f} us; last block done at "
                  f"{ends.max():.2f} us (median block {np.median(ends):.2f})")
            sms = blocks[:, POINTS - 1]
            gaps = []  # an SM's idle time between one block's end and its next block's start
            for sm in np.unique(sms):
                mine = np.argsort(rel[sms == sm, 0])
                entry, done = rel[sms == sm, 0][mine], ends[sms == sm][mine]
                gaps += list(entry[1:] - done[:-1])
            if gaps:
                print(f"  SM idle between blocks: median {np.median(gaps):.2f} max {max(gaps):.2f} us "
                      f"({len(gaps)} gaps)")
            for label, a, z in PHASES:
                ok = (rel[:, a] >= 0) & (rel[:, z] >= 0)
                if not ok.any():
                    continue
                span = (rel[ok, z] - rel[ok, a]) / (z - a if label.endswith("(per tile)") else 1)
                print(f"    {label:36s} median {np.median(span):6.2f}  max {span.max():6.2f} us"
                      f"  ({ok.sum()} blocks)")


if __name__ == "__main__":
    main()
