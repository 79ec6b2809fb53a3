"""Times every decode tile candidate (bench/dev/candidates.py, plus the shipped row) and a few split
counts, at the decode bar's shape (hq=32 hkv=8 d=128 bf16, seqlen_q=1, full caches).

Run on the GPU from the repository root, after ``pip install -e .`` (the harness is the installed package
``fa2cupy_bench``): ``python bench/dev/tune_decode.py [--cases 1x16384,8x65536]``. Each candidate's output is compared
with the shipped row's first (a wrong candidate is reported, never timed). Same timer as ``fa2cupy bench``
(CUDA events per call, calls back to back, median).
"""

import argparse
import sys

import cupy

sys.path.insert(0, ".")
from fa2cupy_bench import harness as B  # noqa: E402
from fa2cupy import configs, decode  # noqa: E402

import candidates  # noqa: E402  (bench/dev/, this script's folder)


H, HKV, D = 32, 8, 128  # the decode bar's query heads, KV heads and head dim


def decode_caches(rng, b, sk, layout="bshd"):
    """q (b, 1, H, D) and full K/V caches of sk keys, fp16, random; layout "bhsd" keeps each head's keys
    contiguous and views them as (b, s, h, d) through strides."""
    q = rng.standard_normal((b, 1, H, D), dtype=cupy.float32).astype(cupy.float16)
    shape = (b, sk, HKV, D) if layout == "bshd" else (b, HKV, sk, D)
    kc = rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    vc = rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    if layout == "bhsd":
        kc, vc = kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3)
    return q, kc, vc


def decode_step(q, kc, vc, config, splits):
    """(plan, run, out): the plan of one decode step over full caches with a given tile row and split count (0 =
    heuristic), and a closure that launches it into out (NaN before the first launch) on the current stream."""
    b, sk = kc.shape[:2]
    device = cupy.cuda.runtime.getDevice()
    arch = int(cupy.cuda.Device().compute_capability)
    plan = decode.plan_decode(q.shape, {"q": q.strides, "k_cache": kc.strides, "v_cache": kc.strides}, "float16",
                              nheads_kv=HKV, cache_rows=b, capacity=sk, page_size=0, max_pages=0, seqlen_new=0,
                              max_seqlen_k=sk, softmax_scale=D ** -0.5, causal=False, arch=arch, device=device,
                              num_splits=splits, item=2, config=config)
    out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
    stream = cupy.cuda.get_current_stream().ptr
    pointers = dict(decode.NO_POINTERS, q=q.data.ptr, k_cache=kc.data.ptr, v_cache=vc.data.ptr, out=out.data.ptr)

    def run():
        decode.run_decode(plan, pointers, (sk,), stream, "cupy", device)

    return plan, run, out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="1x4096,1x16384,1x65536,8x16384,8x65536,64x4096,64x16384")
    parser.add_argument("--splits", default="0", help="comma-separated num_splits to try (0 = heuristic)")
    parser.add_argument("--layouts", default="bshd",
                        help="cache layouts: bshd (flash-attn's, contiguous) and/or bhsd (each head's keys "
                             "contiguous, viewed as (b, s, h, d) through strides)")
    parser.add_argument("--shipped-only", action="store_true", help="time only the shipped tile row")
    args = parser.parse_args()
    shipped = configs.decode_config(int(cupy.cuda.Device().compute_capability), D)
    configs_timed = [shipped] + ([] if args.shipped_only
                                 else [c for c in candidates.DECODE_CANDIDATES if c != shipped])
    events = B.CupyEvents()
    rng = cupy.random.default_rng(0)
    for case, layout in ((c, lay) for c in args.cases.split(",") for lay in args.layouts.split(",")):
        b, sk = map(int, case.split("x"))
        q, kc, vc = decode_caches(rng, b, sk, layout)
        nbytes = B.kv_cache_bytes(b, sk, HKV, D)
        reference = None
        for config in configs_timed:
            for splits in map(int, args.splits.split(",")):
                plan, run, out = decode_step(q, kc, vc, config, splits)
                run()
                cupy.cuda.runtime.deviceSynchronize()
                if reference is None:
                    reference = out.astype(cupy.float32)
                err = float(cupy.abs(out.astype(cupy.float32) - reference).max())
                name = (f"{layout} bn{config.block_n} st{config.stages} w{config.warps}"
                        f"{' pf' if config.l2_prefetch else ''} splits={plan.splits}")
                if not err < 2e-3:
                    print(f"b{b} sk{sk} {name}: WRONG (max|diff| {err:.2e} vs the shipped row)", flush=True)
                    continue
                t = B.time_gpu(run, events, warmup=10, repeats=50)
                print(f"b{b} sk{sk} {name}{' (shipped)' if config == shipped else ''}: "
                      f"{nbytes / (t.median_ms * 1e-3) / 1e12:.2f} TB/s, {t.median_ms * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
