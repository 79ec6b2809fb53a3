"""fa2cupy.distributed on GPUs: ring attention over an NCCL group of 2 (and, where the machine has them, 4) GPUs,
one process a GPU, forward and backward against fa2cupy.torch.flash_attn_func (flash_attn_varlen_func for packed
documents that cross the slices) over the whole sequence on each rank, bf16. (The position arithmetic and the ring's algorithm on the float64 reference are in test_distributed.py.)

The bound. Each ring step's kernel call rounds its partial output, and its backward its partial dQ/dK/dV, to bf16
(u = 2**-8) before the float32 merge; the single-GPU call rounds once. So the ring differs from it by at most
about (world + 1) roundings of the largest magnitude: ``max|ring - single| <= (world + 2) u max|single|``. A wrong
mask, window or merge moves results by O(1) and fails it; ``deterministic=True`` must repeat bit for bit.
"""

from __future__ import annotations

import pytest

from test_distributed import _documents, _spawn

pytestmark = pytest.mark.gpu

U = 2.0 ** -8


def _gpus() -> int:
    torch = pytest.importorskip("torch")
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


CASES = [
    dict(layout="zigzag", causal=True, window=[-1, -1], nheads=8, nheads_kv=2),
    dict(layout="contiguous", causal=True, window=[-1, -1], nheads=4, nheads_kv=4),
    dict(layout="zigzag", causal=False, window=[-1, -1], nheads=4, nheads_kv=1),
    dict(layout="contiguous", causal=False, window=[300, 100], nheads=4, nheads_kv=2),
    dict(layout="zigzag", causal=True, window=[700, 0], nheads=4, nheads_kv=2, softcap=20.0),
    dict(layout="zigzag", causal=True, window=[-1, -1], nheads=4, nheads_kv=2, deterministic=True),
    # packed documents crossing the slices' boundaries (the varlen ring)
    dict(layout="zigzag", causal=True, window=[-1, -1], nheads=8, nheads_kv=2, documents="cross"),
    dict(layout="contiguous", causal=True, window=[500, 0], nheads=4, nheads_kv=4, documents="cross"),
    # v with a head dim of its own (the kernels on q's, v zero-padded to it)
    dict(layout="zigzag", causal=True, window=[-1, -1], nheads=8, nheads_kv=2, headdim_v=64),
]


@pytest.mark.parametrize("world", [2, 4])
def test_gpu_ring_equals_the_full_sequence(tmp_path, world):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, found {_gpus()}")
    cases = [dict(dict(batch=1, seqlen=1024 * world, headdim=128, dtype="bfloat16", softcap=0.0,
                       deterministic=False, seed=world + i), **c) for i, c in enumerate(CASES)]
    for c in cases:
        if c.get("documents"):
            c["documents"] = _documents(c["seqlen"], c["seed"])
    for rank_results in _spawn("ring_against_full", world, tmp_path, "nccl", cases):
        for case, r in zip(cases, rank_results):
            assert "error" not in r, r.get("error")
            for name in ("out", "dq", "dk", "dv"):
                bound = (world + 2) * U * r["scale"][name]
                assert r[name] <= bound, f"{case}, rank {r['rank']} {name}: {r[name]:.3g} > {bound:.3g}"
            assert r["lse"] <= 1e-5 * max(1.0, r["scale"]["lse"]), (case, r["rank"], r["lse"])  # float32 merges
            assert r["roundtrip"]
            if case["deterministic"]:
                assert r["repeats"], f"rank {r['rank']}: deterministic ring results differ between two runs"
