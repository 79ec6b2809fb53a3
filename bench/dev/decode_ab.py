"""A/B timing of decode variants in one process, through the call the decode bar times (``fa2cupy bench --mode
decode``: torch bf16 tensors, hq=32 hkv=8 d=128, seqlen_q=1, full caches, ``cache_seqlens`` a tensor). Each case
runs every variant in turn for several rounds (the order alternating), so clock drift and the machine-to-machine
spread fall on all variants alike; each variant keeps its best round. Eager: CUDA-event time per call, calls back
to back; queued: 8 calls per pair of events, enqueued behind a spinning kernel (GPU time per eager call); graph:
16 calls captured in a CUDA graph, GPU time per call. Outputs are compared with the first variant's before
timing.

    python bench/dev/decode_ab.py [--cases 1x16384,64x1024] [--variants base,walk132] [--rounds 4]
    python bench/dev/decode_ab.py --trees base=ab_trees/base/cuda,new=cuda   (kernels built from each copy of cuda/)
    python bench/dev/decode_ab.py --trees base=ab_trees/base/cuda,new+pdl=cuda   (a tree with a variant's settings)
    python bench/dev/decode_ab.py --paged 256 [--in-order] ...   (the same keys and values in shuffled pages of 256 keys)
    (from the repository root, after ``pip install -e .``: the harness is the installed package ``fa2cupy_bench``)

Variants: ``base`` (the shipped plan), ``deep``/``shallow`` (the deep-ring twin of the d=128 row forced on or
off), ``block``/``solo``/``solodeep``/``soloshallow`` (warp items forced off, or on with either ring), ``solost3``
(warp items with 3 ring stages), ``walkN`` (N blocks wherever blocks walk items), ``wN`` (N warps per block),
``st3`` (3 ring stages), ``bn16`` / ``bn16st3`` / ``bn16st4`` (16-key tiles, 2-4 ring stages), ``nopdl`` /
``pdl`` (plain or programmatic launches whatever the split count, instead of from
KernelOptions.decode_programmatic_min_splits splits on),
``ef`` / ``noef`` (K/V copies under L2 evict-first or under none whatever the call's size),
``splitsN`` (N splits wherever the rule splits: 33 at 1 x 16k is 264 items that 132 walking blocks take two at a
time, every SM streaming).
"""

import argparse
import dataclasses
import statistics
import sys

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402
from fa2cupy_bench import harness as B  # noqa: E402
from fa2cupy import build, configs, decode, pipeline  # noqa: E402
from fa2cupy.options import KernelOptions  # noqa: E402

H, HKV, D = 32, 8, 128  # the decode bar's query heads, KV heads and head dim
#: The functions a variant may replace (experiments on the planner's code, not options), as shipped.
_originals = {"_attention_grid": decode._attention_grid, "decode_config": configs.decode_config,
              "choose_num_splits": decode.choose_num_splits, "plan_decode": decode.plan_decode}
OPTIONS = [KernelOptions()]  # the variant in use: its KernelOptions
PLANS = []  # the decode plans made since the variant was set


def _walk_blocks(blocks):
    """_attention_grid with ``blocks`` blocks wherever blocks walk items (the shipped rule picks 128 of 132 for
    64 x 1k; 132 is the rule before it)."""
    def grid(function, config, device, items, sms):
        count, smem = _originals["_attention_grid"](function, config, device, items, sms)
        return (min(blocks, items), smem) if count < items else (count, smem)
    return grid


def _recording_plan_decode(*args, **kwargs):
    PLANS.append(_originals["plan_decode"](*args, **kwargs))
    return PLANS[-1]


def _row(**fields):
    """The d=128 decode rows (and their deep-ring twins) with other DecodeConfig fields."""
    def config(arch, headdim, *args, **kwargs):
        return dataclasses.replace(_originals["decode_config"](arch, headdim, *args, **kwargs), **fields)
    return config


# variant -> KernelOptions fields (lower case) and functions of decode (or configs.decode_config) to set
VARIANTS = {"base": {}}
for _n in (132, 128, 120):
    VARIANTS[f"walk{_n}"] = {"_attention_grid": _walk_blocks(_n)}
VARIANTS["deep"] = {"decode_deep_ring": True}  # the deep-ring twin wherever a row has one
VARIANTS["shallow"] = {"decode_deep_ring": False}  # the table's rows only
VARIANTS["block"] = {"decode_warp_items": False}  # no warp items: blocks split every item across their warps
VARIANTS["solo"] = {"decode_warp_items": True}  # warp items wherever there is one split
VARIANTS["solodeep"] = {"decode_warp_items": True, "decode_deep_ring": True}
VARIANTS["soloshallow"] = {"decode_warp_items": True, "decode_deep_ring": False}
VARIANTS["solost3"] = {"decode_warp_items": True, "decode_deep_ring": False, "decode_config": _row(stages=3)}
for _w in (2, 3, 5, 6):
    VARIANTS[f"w{_w}"] = {"decode_config": _row(warps=_w)}
VARIANTS["st3"] = {"decode_config": _row(stages=3)}
VARIANTS["nopdl"] = {"decode_programmatic_launch": False}  # plain launches (no programmatic stream serialization)
VARIANTS["pdl"] = {"decode_programmatic_launch": True}  # programmatic launches whatever the split count
VARIANTS["ef"] = {"decode_stream_evict_first": True}  # K/V under L2 evict-first whatever their size
VARIANTS["noef"] = {"decode_stream_evict_first": False}  # K/V under no policy (evict-unchanged) whatever their size
VARIANTS["bn16"] = {"decode_config": _row(block_n=16)}  # 16-key tiles: two walking blocks per SM fit
for _n in (32, 33, 66):  # a fixed split count wherever the rule would split
    VARIANTS[f"splits{_n}"] = {"choose_num_splits": lambda blocks, sms, keys, tile, n=_n: n if blocks < sms else 1}
VARIANTS["bn16st3"] = {"decode_config": _row(block_n=16, stages=3)}
VARIANTS["bn16st4"] = {"decode_config": _row(block_n=16, stages=4)}


TREES = {}  # tree variant -> its copy of cuda/ (--trees)


def bar_inputs(torch, gen, b, sk):
    """(q, k_cache, v_cache, cache_seqlens) of the decode bar's call: random bf16 (never zeros), full caches of
    ``sk`` keys per row, ``cache_seqlens`` a tensor."""
    q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    kc = torch.randn(b, sk, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(b, sk, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, kc, vc, torch.full((b,), sk, device="cuda", dtype=torch.int32)


def use(variant: str) -> None:
    """Sets the variant's KernelOptions (OPTIONS, which the calls pass) and functions (of decode, or
    configs.decode_config), or its source tree; then drops the remembered plans, which the functions and the
    kernels they hold are not part of the key of."""
    attributes = dict(_originals, plan_decode=_recording_plan_decode)
    for part in variant.split("+"):  # a tree's name may add variants: "new+pdl" is tree "new" with "pdl"
        attributes.update(VARIANTS.get(part, {}))
    fields = {field.name for field in dataclasses.fields(KernelOptions)}
    OPTIONS[0] = KernelOptions(**{name: value for name, value in attributes.items() if name in fields})
    for name, value in attributes.items():
        if name in _originals:
            setattr(configs if name == "decode_config" else decode, name, value)
    if TREES:
        build.use_sources(TREES[variant])
    pipeline.forget_plans()
    PLANS.clear()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="1x1024,1x4096,1x16384,1x65536,8x1024,8x4096")
    parser.add_argument("--variants", default="base,walk132")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--trees", default="", help="name=DIR,... : the shipped plans on kernels from each tree")
    parser.add_argument("--paged", type=int, default=0, help="page size: the caches in shuffled pages")
    parser.add_argument("--in-order", action="store_true", help="with --paged: pages in order, not shuffled")
    args = parser.parse_args()
    if args.trees:
        TREES.update(pair.split("=", 1) for pair in args.trees.split(","))
        args.variants = ",".join(TREES)
    torch = B._torch()
    events = B.TorchEvents()
    gen = torch.Generator(device="cuda").manual_seed(0)
    names = args.variants.split(",")
    for case in args.cases.split(","):
        b, sk = map(int, case.split("x"))
        q, kc, vc, lens = bar_inputs(torch, gen, b, sk)
        nbytes = B.kv_cache_bytes(b, sk, HKV, D)

        if args.paged:
            k_pages, v_pages, table = B.paged_copy(torch, gen, kc, vc, args.paged, shuffled=not args.in_order)

            def call():
                return fa2cupy.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens, block_table=table,
                                                       kernel_options=OPTIONS[0])
        else:
            def call():
                return fa2cupy.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, kernel_options=OPTIONS[0])

        reference, eager, queued, graph, label = None, {}, {}, {}, {}
        for name in names:
            use(name)
            out = call().float()
            if reference is None:
                reference = out
            err = float((out - reference).abs().max())
            if not err < 2e-2:
                print(f"{case} {name}: WRONG (max|diff| {err:.2e} vs {names[0]})", flush=True)
                continue
            plan = PLANS[-1]
            label[name] = (f"splits={plan.splits} grid={plan.attention.grid[0]}"
                           f"{' warp' if plan.config.warp_items else ''}{' deep' if plan.config.deep_ring else ''}")
            eager[name], queued[name], graph[name] = [], [], []
        for r in range(args.rounds):
            for name in (list(label) if r % 2 == 0 else list(label)[::-1]):
                use(name)
                eager[name].append(B.time_gpu(call, events, warmup=10, repeats=60).median_ms * 1e3)
                queued[name].append(B.time_gpu(call, events, warmup=10, repeats=30, queued=True,
                                               batch=8).median_ms * 1e3)
                graph[name].append(B.graph_ms_per_call(call, events) * 1e3)
        first = names[0] if names[0] in label else None
        for name in label:
            e, qd, g = min(eager[name]), min(queued[name]), min(graph[name])
            rel = (f"  vs {first}: eager {e / min(eager[first]):.3f}x queued {qd / min(queued[first]):.3f}x "
                   f"graph {g / min(graph[first]):.3f}x" if first else "")
            print(f"{case:>9} {name:>11} {label[name]:<28} eager {e:7.1f} us (median {statistics.median(eager[name]):6.1f})"
                  f"  queued {qd:7.1f} us = {nbytes / (qd * 1e-6) / 1e12:.2f} TB/s"
                  f"  graph {g:7.1f} us = {nbytes / (g * 1e-6) / 1e12:.2f} TB/s{rel}", flush=True)
    use(names[0])


if __name__ == "__main__":
    main()
