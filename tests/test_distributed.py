"""fa2cupy.distributed on CPU: the layouts' position arithmetic, the ring step's kernel calls against the whole
sequence's mask (brute force), and the ring attention's forward and backward run by 2 and 4 processes on a gloo
group with fa2cupy.torch's ops on the float64 reference (tests/torch_stand_ins.py), against the full-sequence call
on the same reference. The GPU counterparts (NCCL, fa2cupy's kernels) are in test_distributed_gpu.py.
"""

from __future__ import annotations

import json
import random
import socket

import numpy as np
import pytest

from fa2cupy.distributed import layout as L


def test_segments():
    assert L.segments("contiguous", 12, 3, 1) == [(4, 4)]
    assert L.segments("zigzag", 16, 4, 0) == [(0, 2), (14, 2)]
    assert L.segments("zigzag", 16, 4, 3) == [(6, 2), (8, 2)]
    every = sorted(p for r in range(4) for s, n in L.segments("zigzag", 24, 4, r) for p in range(s, s + n))
    assert every == list(range(24))
    with pytest.raises(ValueError, match="multiple of 8"):
        L.segments("zigzag", 12, 4, 0)
    with pytest.raises(ValueError, match="layout must be one of"):
        L.segments("striped", 12, 4, 0)
    with pytest.raises(ValueError, match="rank must be in"):
        L.segments("contiguous", 12, 4, 4)


def _fa_mask(rows, keys, window):
    """fa2cupy's (bottom-right aligned) window mask of one call."""
    left, right = window
    i, j = np.arange(rows)[:, None], np.arange(keys)[None, :]
    mask = np.ones((rows, keys), bool)
    if left >= 0:
        mask &= j >= i + keys - rows - left
    if right >= 0:
        mask &= j <= i + keys - rows + right
    return mask


def _random_split(rng):
    """(layout, world, seqlen): a layout over 1-4 ranks and a sequence it splits."""
    layout, world = rng.choice(L.LAYOUTS), rng.choice([1, 2, 3, 4])
    parts = world if layout == "contiguous" else 2 * world
    return layout, world, parts * rng.randint(1, 5)


def _window_pairs(seqlen, left, right):
    """bool (seqlen, seqlen): which positions see which under the whole sequence's window."""
    p = np.arange(seqlen)
    return ((left < 0) | (p[None, :] >= p[:, None] - left)) & ((right < 0) | (p[None, :] <= p[:, None] + right))


def _check_every_step(layout, world, seqlen, whole, mark):
    """For every rank and ring step, ``mark(mine, theirs, marked)`` marks the pairs the step's calls compute into
    ``marked`` (this rank's rows by the slice in hand's keys); they must be ``whole``'s pairs, each once."""
    for rank in range(world):
        mine = L.segments(layout, seqlen, world, rank)
        q_pos = np.concatenate([np.arange(s, s + n) for s, n in mine])
        for src in range(world):
            theirs = L.segments(layout, seqlen, world, src)
            k_pos = np.concatenate([np.arange(s, s + n) for s, n in theirs])
            marked = np.zeros((len(q_pos), len(k_pos)), int)
            mark(mine, theirs, marked)
            assert (marked == whole[np.ix_(q_pos, k_pos)]).all(), (layout, world, seqlen, rank, src)


def test_step_calls_cover_the_mask_exactly():
    """For every rank and ring step, the step's calls (rectangles with their windows) mark each query-key pair of
    the two slices that sees each other under the whole sequence's window exactly once, and no other; every row
    of a call sees a key (so no call leaves a row without one, whose lse would be +inf)."""
    rng = random.Random(0)
    for _ in range(400):
        layout, world, seqlen = _random_split(rng)
        left, right = rng.choice([-1, 0, 1, 2, 5, 11]), rng.choice([-1, 0, 1, 4])

        def mark(mine, theirs, marked):
            for c in L.step_calls(mine, theirs, left, right):
                m = _fa_mask(c.q_stop - c.q_start, c.k_stop - c.k_start, c.window)
                assert min(c.window) >= -1 and m.any(1).all(), c
                marked[c.q_start:c.q_stop, c.k_start:c.k_stop] += m

        _check_every_step(layout, world, seqlen, _window_pairs(seqlen, left, right), mark)


def test_varlen_step_calls_cover_the_mask_exactly():
    """Packed documents: a step's varlen calls (document pieces as sequences, the rows and keys between them as
    sequences without keys or rows) mark exactly the pairs of one document that see each other under the window."""
    rng = random.Random(1)
    for _ in range(300):
        layout, world, seqlen = _random_split(rng)
        cu = [0] + sorted(rng.sample(range(1, seqlen), rng.randint(0, min(5, seqlen - 1)))) + [seqlen]
        document = np.searchsorted(np.array(cu), np.arange(seqlen), side="right") - 1
        left, right = rng.choice([-1, 0, 1, 2, 5]), rng.choice([-1, 0, 1, 3])

        def mark(mine, theirs, marked):
            for c in L.varlen_step_calls(mine, theirs, cu, left, right):
                assert sum(c.lengths_q) == c.q_stop - c.q_start and sum(c.lengths_k) == c.k_stop - c.k_start
                qa, ka = c.q_start, c.k_start
                for lq, lk in zip(c.lengths_q, c.lengths_k):
                    if lq and lk:
                        marked[qa:qa + lq, ka:ka + lk] += _fa_mask(lq, lk, c.window)
                    qa, ka = qa + lq, ka + lk

        whole = _window_pairs(seqlen, left, right) & (document[:, None] == document[None, :])
        _check_every_step(layout, world, seqlen, whole, mark)


def test_document_bounds_are_checked():
    torch = pytest.importorskip("torch")
    from fa2cupy.distributed import ring

    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    assert ring._document_bounds(cu, 11, 16) == [0, 5, 16]
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D int32"):
        ring._document_bounds(cu.long(), 11, 16)
    with pytest.raises(ValueError, match="rise from 0 to the packed sequence's 20 tokens"):
        ring._document_bounds(cu, 11, 20)
    with pytest.raises(ValueError, match="max_seqlen must be an int >= the longest document \\(11\\)"):
        ring._document_bounds(cu, 10, 16)


def test_zigzag_balances_causal_work():
    """Under a causal mask every zigzag rank computes the same number of query-key pairs at every ring step."""
    world, seqlen = 4, 64
    for step in range(world):
        work = set()
        for rank in range(world):
            calls = L.step_calls(L.segments("zigzag", seqlen, world, rank),
                                 L.segments("zigzag", seqlen, world, (rank - step) % world), -1, 0)
            work.add(sum(int(_fa_mask(c.q_stop - c.q_start, c.k_stop - c.k_start, c.window).sum()) for c in calls))
        assert len(work) == 1, (step, work)


# ------------------------------------------------------------------------------------- the ring on gloo (CPU)

def _spawn(worker, world, tmp_path, backend, cases):
    """Runs ``distributed_workers.<worker>`` as ``world`` processes of one group; returns each rank's results."""
    mp = pytest.importorskip("torch.multiprocessing")
    import distributed_workers

    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(getattr(distributed_workers, worker), args=(world, port, str(tmp_path), backend, cases), nprocs=world)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


CASES = [
    dict(layout="zigzag", causal=True, window=[-1, -1], nheads=4, nheads_kv=2),
    dict(layout="contiguous", causal=True, window=[-1, -1], nheads=2, nheads_kv=2),
    dict(layout="zigzag", causal=False, window=[-1, -1], nheads=2, nheads_kv=1),
    dict(layout="contiguous", causal=False, window=[5, 3], nheads=2, nheads_kv=2),
    dict(layout="zigzag", causal=True, window=[6, 0], nheads=4, nheads_kv=1, softcap=3.0),
    dict(layout="zigzag", causal=True, window=[-1, -1], nheads=2, nheads_kv=2, deterministic=True),
    # packed documents crossing the slices' boundaries (varlen), with a window inside them too
    dict(layout="zigzag", causal=True, window=[-1, -1], nheads=4, nheads_kv=2, documents="cross"),
    dict(layout="contiguous", causal=False, window=[3, 2], nheads=2, nheads_kv=1, documents="cross"),
    dict(layout="zigzag", causal=True, window=[5, 0], nheads=2, nheads_kv=2, documents="cross", softcap=2.0),
    # v with a head dim of its own (the output's)
    dict(layout="zigzag", causal=True, window=[-1, -1], nheads=4, nheads_kv=2, headdim_v=8),
    dict(layout="contiguous", causal=False, window=[-1, -1], nheads=2, nheads_kv=1, headdim_v=24, documents="cross"),
]


def _documents(seqlen: int, seed: int) -> list[int]:
    """Document lengths summing to seqlen, cut where no slice boundary of either layout falls (world <= 4)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample([c for c in range(1, seqlen) if c % 2], k=min(4, seqlen // 4)))
    bounds = [0] + cuts + [seqlen]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("world", [2, 4])
def test_ring_equals_the_full_sequence_on_cpu(tmp_path, world):
    """Every case in one group of ``world`` processes (dense slices, and packed documents through the varlen
    ring). The stand-ins compute in float64 but the kernels' lse, and
    so the ring's merge, is float32: the bound is a few float32 roundings (u = 6e-8) of the largest magnitude. A
    wrong mask, window or merge moves results by O(1)."""
    pytest.importorskip("torch")
    cases = [dict(dict(batch=2, seqlen=8 * world, headdim=16, dtype="float64", softcap=0.0, deterministic=False,
                       seed=world + i), **c) for i, c in enumerate(CASES)]
    for c in cases:
        if c.get("documents"):
            c["documents"] = _documents(c["seqlen"], c["seed"])
    for rank_results in _spawn("ring_against_full", world, tmp_path, "gloo", cases):
        for case, r in zip(cases, rank_results):
            assert "error" not in r, r.get("error")
            for name in ("out", "lse", "dq", "dk", "dv"):
                assert r[name] <= 1e-6 * max(1.0, r["scale"][name]), (case, r["rank"], name, r[name])
            assert r["roundtrip"]
            if case["deterministic"]:
                assert r["repeats"]


def test_ring_argument_errors(tmp_path):
    pytest.importorskip("torch")
    for r in _spawn("argument_errors", 2, tmp_path, "gloo", []):
        kind, message = r["group"]
        assert kind == "ValueError" and "NCCL" in message and "'gloo'" in message
        kind, message = r["unequal"]
        assert kind == "ValueError" and "same shape" in message


def test_ring_argument_checks_before_any_traffic():
    """What the ring refuses from its arguments alone (before any collective): ALiBi, shapes, a slice the layout
    cannot split, bad options."""
    torch = pytest.importorskip("torch")
    from fa2cupy.distributed import ring

    q = torch.zeros(1, 6, 4, 16)
    kv = torch.zeros(1, 6, 2, 16)

    def settings(q=q, k=kv, v=kv, world=2, layout="zigzag", varlen=False, **kw):
        args = dict(causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    dropout_p=0.0, deterministic=False)
        args.update(kw)
        return ring.settings_for(q, k, v, *args.values(), layout, None, world, varlen=varlen)

    assert settings().left == -1 and settings().right == 0
    assert (settings(causal=False, window_size=(3, 1)).left, settings(causal=False, window_size=(3, 1)).right) == (3, 1)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        settings(alibi_slopes=torch.zeros(4))
    five, five_kv = torch.zeros(1, 5, 4, 16), torch.zeros(1, 5, 2, 16)
    with pytest.raises(ValueError, match="multiple of 8"):  # zigzag over 4 ranks: 20 tokens in 8 chunks
        settings(q=five, k=five_kv, v=five_kv, world=4)
    assert settings(q=five, k=five_kv, v=five_kv, world=4, layout="contiguous").layout == "contiguous"
    with pytest.raises(ValueError, match="k and v must be"):
        settings(k=torch.zeros(1, 5, 2, 16))
    with pytest.raises(ValueError, match="q must be 4-D"):
        settings(q=torch.zeros(6, 4, 16))
    with pytest.raises(ValueError, match="q must be 3-D"):
        settings(varlen=True)
    with pytest.raises(ValueError, match="layout must be one of"):
        settings(layout="striped")
    with pytest.raises(TypeError, match="causal must be a bool"):
        settings(causal="yes")
    with pytest.raises(ValueError, match="dropout_p must be in"):
        settings(dropout_p=1.5)
