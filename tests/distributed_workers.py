"""Process bodies for the ring-attention tests: each runs as one rank (torch.multiprocessing.spawn) of a gloo group
on CPU (test_distributed.py) or of an NCCL group on GPUs (test_distributed_gpu.py), and writes what it measured to
``result_dir/rank<r>.json`` for the test to check (a spawned process's assertion would only show as an exit code).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _init(rank: int, world: int, port: int, backend: str):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)


def _use_stand_ins():
    """fa2cupy.torch's ops on the float64 reference (tests/torch_stand_ins.py), as the CPU tests of the wrappers do,
    the backward from the given out and lse as the kernels compute it (a ring block's lse is over every key)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fa2cupy
    import torch_stand_ins as s
    from fa2cupy import attention

    attention.forward_with_lse = s._ref_forward
    attention.varlen_forward_with_lse = s._ref_varlen_forward
    fa2cupy.flash_attn_backward = s._ref_block_backward
    fa2cupy.flash_attn_varlen_backward = s._ref_varlen_block_backward


def _write(result_dir: str, rank: int, result: dict) -> None:
    """The result for the test, then the group torn down, and the process ends."""
    import torch.distributed as dist

    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()  # (no rank leaves while another still talks to it)
        dist.destroy_process_group()
    # Out now: gloo's threads sometimes abort the interpreter's own shutdown (SIGABRT after the result is written),
    # which would fail the spawn for nothing the test measures.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def ring_against_full(rank: int, world: int, port: int, result_dir: str, backend: str, cases: list) -> None:
    """For each case, one ring forward and backward on this rank's slices against the full-sequence call
    (fa2cupy.torch's flash_attn_func, every rank alike), both on the same kernels: the float64 stand-ins on CPU
    (``backend`` "gloo"), fa2cupy's on a GPU ("nccl"). Also runs the ring a second time: with ``deterministic``
    every result must repeat bit for bit. Writes a list of results, one per case."""
    import torch

    results = []
    try:
        _init(rank, world, port, backend)
        cuda = backend == "nccl"
        if cuda:
            torch.cuda.set_device(rank)
        else:
            _use_stand_ins()
        for case in cases:
            results.append(_ring_case(rank, world, torch.device("cuda", rank) if cuda else torch.device("cpu"),
                                      case))
    except Exception as exc:  # reported, not raised: the test shows it
        import traceback

        results.append({"rank": rank, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
    _write(result_dir, rank, results)


def _ring_case(rank: int, world: int, device, case: dict) -> dict:
    """One case: dense slices, or (``case["documents"]``, document lengths) packed documents that cross slices."""
    import torch

    import fa2cupy.torch as fa_torch
    from fa2cupy.distributed import ring

    result = {"rank": rank}
    dtype = getattr(torch, case["dtype"])
    b, s, h, hkv, d = case["batch"], case["seqlen"], case["nheads"], case["nheads_kv"], case["headdim"]
    dv = case.get("headdim_v", d)  # (v's head dim, and the output's)
    documents = case.get("documents")
    lead = (s,) if documents else (b, s)  # packed: one sequence of s tokens
    g = torch.Generator().manual_seed(case["seed"])  # the same full tensors on every rank
    q, k, v, dout = (torch.randn(shape, generator=g, dtype=torch.float64).to(device, dtype)
                     for shape in ((*lead, h, d), (*lead, hkv, d), (*lead, hkv, dv), (*lead, h, dv)))
    kw = dict(causal=case["causal"], window_size=tuple(case["window"]), softcap=case["softcap"],
              deterministic=case["deterministic"])
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    if documents:
        cu = torch.tensor([0] + [sum(documents[:i + 1]) for i in range(len(documents))], dtype=torch.int32,
                          device=device)
        out_full, lse_full, _ = fa_torch.flash_attn_varlen_func(*full, cu, cu, max(documents), max(documents),
                                                                return_attn_probs=True, **kw)
    else:
        out_full, lse_full, _ = fa_torch.flash_attn_func(*full, return_attn_probs=True, **kw)
    out_full.backward(dout)

    layout, ax = case["layout"], 0 if documents else 1
    group = ring.Ring()
    mine = [ring.shard(x, layout=layout, dim=ax) for x in (q, k, v, dout)]

    def run():
        leaves = [x.clone().requires_grad_() for x in mine[:3]]
        settings = ring.settings_for(*leaves, case["causal"], None, tuple(case["window"]), case["softcap"], None,
                                     0.0, case["deterministic"], layout, None, world, varlen=bool(documents))
        if documents:
            kernels = ring._Varlen(settings, group, mine[0].shape[0], cu.tolist(), device)
        else:
            kernels = ring._Dense(settings, group, mine[0].shape[1])
        out, lse = ring._RingAttention.apply(*leaves, group, settings, kernels)
        out.backward(mine[3])
        return out.detach(), lse, [x.grad for x in leaves]

    out, lse, grads = run()
    want_out = ring.shard(out_full.detach(), layout=layout, dim=ax)
    want_lse = ring.shard(lse_full, layout=layout, dim=ax + 1)
    result["out"] = _max_diff(out, want_out)
    result["lse"] = _max_diff(lse, want_lse)
    result["scale"] = {"out": float(out_full.detach().abs().max()), "lse": float(lse_full.abs().max())}
    for name, got, x in zip("qkv", grads, full):
        want = ring.shard(x.grad, layout=layout, dim=ax)
        result[f"d{name}"] = _max_diff(got, want)
        result["scale"][f"d{name}"] = float(x.grad.abs().max())
    again = run()
    result["repeats"] = bool(torch.equal(again[0], out) and all(torch.equal(a, b) for a, b in zip(again[2], grads)))
    result["roundtrip"] = bool(torch.equal(ring.unshard(mine[0], layout=layout, dim=ax), q))
    return result


def argument_errors(rank: int, world: int, port: int, result_dir: str, backend: str, cases: list) -> None:
    """The public call's refusals on this group: each entry the exception type and message, or None if it
    returned."""
    import torch

    result = {}
    _init(rank, world, port, backend)
    from fa2cupy.distributed import ring

    def attempt(name, fn):
        try:
            fn()
            result[name] = None
        except Exception as exc:  # noqa: BLE001 -- recorded for the test
            result[name] = [type(exc).__name__, str(exc)]

    n = 8 if rank == 0 else 16  # unequal slices
    q = torch.zeros(1, n, 2, 16)
    attempt("group", lambda: ring.ring_flash_attn_func(q, q, q))
    attempt("unequal", lambda: ring._check_same_slices(ring.Ring(), q, q))
    _write(result_dir, rank, result)
