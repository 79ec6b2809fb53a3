"""Ring attention over a torch.distributed process group: each rank holds a slice of the sequence (a layout of
:mod:`fa2cupy.distributed.layout`) and attends its queries to every slice in turn as the K/V slices travel round
the ring, merging the partial results through their log-sum-exp.

Forward, on each rank r of W: W steps; at step s the rank holds the K/V slice of rank (r - s) mod W, sends it on to
rank r + 1 while it computes, and receives the next from rank r - 1 into a second buffer (double-buffered, the
traffic on NCCL's stream overlapped with the kernels on the current one). Each step runs the kernel calls
:func:`~fa2cupy.distributed.layout.step_calls` plans (the rectangles of rows and keys that see each other, with the
window relative to each), and merges each call's ``(out, lse)`` into float32 accumulators of the rank's rows:
``lse = logaddexp(lse_acc, lse_part)``, ``out = exp(lse_acc - lse) out_acc + exp(lse_part - lse) out_part``.

Backward, with the forward's merged ``out`` and ``lse`` (what every block's gradient needs: P = exp(S - lse),
D = rowsum(dO * O)): the K/V slices go round again, and with each travels a float32 accumulator of its dK, dV; a
rank adds its blocks' contributions to the accumulator in hand and sends it on, so that after W steps and one more
hop each accumulator is back at its slice's rank, complete (that hop, after the last kernels, carries the sums
already rounded to the inputs' dtype: half the bytes of float32). dQ stays local. The order of every sum is fixed, so
``deterministic=True`` (deterministic kernels) is bit-for-bit repeatable.

Only the K/V heads travel (GQA: nheads_kv of them), and nothing is copied beyond the buffers in flight. Packed
documents (``ring_flash_attn_varlen_func``) run the same ring over varlen kernel calls
(:func:`~fa2cupy.distributed.layout.varlen_step_calls`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fa2cupy import checks
from fa2cupy import torch as fa_torch
from fa2cupy.distributed import layout as layouts

__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func", "shard", "unshard"]

_MASK64 = (1 << 64) - 1


class Ring:
    """The ring's point-to-point traffic on a process group: this rank sends to the next and receives from the
    previous (group ranks, mapped to global ones for torch.distributed)."""

    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.next, self.prev = (dist.get_global_rank(self.group, (self.rank + step) % self.world) for step in (1, -1))

    def shift(self, sends, recvs):
        """Sends ``sends`` to the next rank and receives ``recvs`` from the previous one, asynchronously: the
        returned handles' ``wait()`` orders the current stream after the transfers."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recvs]
        return dist.batch_isend_irecv(ops)


@dataclass(frozen=True)
class Settings:
    """A ring call's options (validated): the sequence's window (left, right; -1 unlimited, causal is right 0),
    the layout, the kernels' scalars and the dropout seed the per-call seeds derive from."""

    layout: str
    left: int
    right: int
    softmax_scale: float
    softcap: float
    dropout_p: float
    dropout_seed: int
    deterministic: bool
    kernel_options: int


def _mix_seed(base: int, *parts: int) -> int:
    """A 64-bit seed mixed from ``base`` and ``parts`` (splitmix64 steps), as a signed int64 (the ops' type): the
    ring's kernel calls (rank, step, call) and successive ring calls (the generator's offset) never share a dropout
    mask stream."""
    x = base & _MASK64
    for part in parts:
        x = (x + 0x9E3779B97F4A7C15 + (part & _MASK64)) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x


class _Dense:
    """The kernel calls of a ring over (batch, seqlen / world, heads, dim) slices: lse (batch, heads, rows)."""

    row_axis, lse_axis = 1, 2

    def __init__(self, settings: Settings, ring: Ring, n: int):
        mine = layouts.segments(settings.layout, n * ring.world, ring.world, ring.rank)
        # step s pairs this rank's segments with those of rank (rank - s) mod world
        self.plan = [layouts.step_calls(mine, layouts.segments(settings.layout, n * ring.world, ring.world,
                                                               (ring.rank - s) % ring.world),
                                        settings.left, settings.right) for s in range(ring.world)]

    def forward(self, q, k, v, call, settings: Settings, seed: int):
        return fa_torch._flash_attn_forward(q, k, v, settings.softmax_scale, False, call.window[0], call.window[1],
                                            settings.deterministic, settings.softcap, None, settings.dropout_p, seed,
                                            0, settings.kernel_options)

    def backward(self, dout, q, k, v, out, lse, call, settings: Settings, seed: int):
        return fa_torch._flash_attn_backward(dout, q, k, v, out, lse, settings.softmax_scale, False, call.window[0],
                                             call.window[1], settings.deterministic, settings.softcap,
                                             settings.dropout_p, seed, 0, None, settings.kernel_options)


class _Varlen:
    """The kernel calls of a ring over packed documents: (tokens / world, heads, dim) slices of the packed sequence
    whose documents ``cu_seqlens`` bounds; lse (heads, rows). Each call's cu_seqlens go to the device once, together,
    when the ring starts."""

    row_axis, lse_axis = 0, 1

    def __init__(self, settings: Settings, ring: Ring, n: int, cu_seqlens: list, device):
        mine = layouts.segments(settings.layout, n * ring.world, ring.world, ring.rank)
        self.plan = [layouts.varlen_step_calls(mine, layouts.segments(settings.layout, n * ring.world, ring.world,
                                                                      (ring.rank - s) % ring.world),
                                               cu_seqlens, settings.left, settings.right)
                     for s in range(ring.world)]
        bounds, self.where = [], {}
        for call in (c for step in self.plan for c in step):
            self.where[id(call)] = len(bounds)
            for lengths in (call.lengths_q, call.lengths_k):
                bounds.append(0)
                for length in lengths:
                    bounds.append(bounds[-1] + length)
        self.bounds = torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True)

    def _cu(self, call):
        at, m = self.where[id(call)], len(call.lengths_q) + 1
        return (self.bounds[at:at + m], self.bounds[at + m:at + 2 * m], max(call.lengths_q),
                max(call.lengths_k))

    def forward(self, q, k, v, call, settings: Settings, seed: int):
        cu_q, cu_k, max_q, max_k = self._cu(call)
        out, lse = fa_torch._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, settings.softmax_scale, False, call.window[0], call.window[1],
            settings.deterministic, settings.softcap, None, settings.dropout_p, seed, 0, None,
            settings.kernel_options)
        # rows between documents' pieces saw no key (lse +inf): weight 0 in the merge
        return out, torch.where(lse == math.inf, -math.inf, lse)

    def backward(self, dout, q, k, v, out, lse, call, settings: Settings, seed: int):
        cu_q, cu_k, max_q, max_k = self._cu(call)
        return fa_torch._flash_attn_varlen_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, settings.softmax_scale, False, call.window[0],
            call.window[1], settings.deterministic, settings.softcap, settings.dropout_p, seed, 0, None, None,
            settings.kernel_options)


def _untouched(touched: list, start: int, stop: int) -> bool:
    """Whether no range in ``touched`` overlaps [start, stop); records it as touched."""
    fresh = all(not (start < t_stop and t_start < stop) for t_start, t_stop in touched)
    touched.append((start, stop))
    return fresh


def _merge(acc_out, acc_lse, kernels, start: int, stop: int, out, lse, first: bool):
    """acc (float32 out and lse, in the kernels' layouts) rows [start, stop) merged with a part's (out, lse) over
    the same rows; the first part of those rows is copied in."""
    rows = acc_out.narrow(kernels.row_axis, start, stop - start)
    old = acc_lse.narrow(kernels.lse_axis, start, stop - start)
    if first:
        rows.copy_(out)
        old.copy_(lse)
        return
    new = torch.logaddexp(old, lse)
    keep = torch.exp(old - new).movedim(-1, kernels.row_axis).unsqueeze(-1)
    take = torch.exp(lse - new).movedim(-1, kernels.row_axis).unsqueeze(-1)
    rows.mul_(keep).addcmul_(out, take)
    old.copy_(new)


def _forward(q, k, v, ring: Ring, settings: Settings, kernels):
    ax = kernels.row_axis
    acc_out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float32, device=q.device)  # (v's head dim)
    lse_shape = (*q.shape[:ax], q.shape[ax + 1], q.shape[ax])  # (batch, heads, rows) or (heads, rows)
    acc_lse = torch.full(lse_shape, -math.inf, dtype=torch.float32, device=q.device)
    touched = []  # the row ranges merged into so far (a part over untouched rows is copied in)
    k_cur, v_cur = k, v
    for step in range(ring.world):
        if step + 1 < ring.world:  # the next slice travels while this one is used
            k_next, v_next = torch.empty_like(k_cur), torch.empty_like(v_cur)
            pending = ring.shift([k_cur, v_cur], [k_next, v_next])
        for index, call in enumerate(kernels.plan[step]):
            seed = _mix_seed(settings.dropout_seed, ring.rank, step, index) if settings.dropout_p > 0 else 0
            keys = (call.k_start, call.k_stop - call.k_start)
            out, lse = kernels.forward(q.narrow(ax, call.q_start, call.q_stop - call.q_start),
                                       k_cur.narrow(ax, *keys), v_cur.narrow(ax, *keys), call, settings, seed)
            _merge(acc_out, acc_lse, kernels, call.q_start, call.q_stop, out, lse,
                   _untouched(touched, call.q_start, call.q_stop))
        if step + 1 < ring.world:
            for work in pending:
                work.wait()
            k_cur, v_cur = k_next, v_next
    # rows that saw no key: output 0 and lse +inf, flash-attn's convention
    lse = torch.where(acc_lse == -math.inf, math.inf, acc_lse)
    return acc_out.to(q.dtype), lse


def _accumulate(acc, axis: int, start: int, stop: int, part, fresh: bool) -> None:
    """acc's rows [start, stop) along ``axis`` += part, or part copied in where nothing was accumulated there yet."""
    rows = acc.narrow(axis, start, stop - start)
    if fresh:
        rows.copy_(part)
    else:
        rows += part


def _backward(dout, q, k, v, out, lse, ring: Ring, settings: Settings, kernels):
    ax, lax = kernels.row_axis, kernels.lse_axis
    n = q.shape[ax]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dq_touched = []
    k_cur, v_cur = k, v
    held = None  # (dk, dv, transfers): the accumulators of the slice in hand, arriving from the previous rank
    for step in range(ring.world):
        if step + 1 < ring.world:
            k_next, v_next = torch.empty_like(k_cur), torch.empty_like(v_cur)
            pending = ring.shift([k_cur, v_cur], [k_next, v_next])
        parts = []
        for index, call in enumerate(kernels.plan[step]):
            seed = _mix_seed(settings.dropout_seed, ring.rank, step, index) if settings.dropout_p > 0 else 0
            rows, keys = (call.q_start, call.q_stop - call.q_start), (call.k_start, call.k_stop - call.k_start)
            dq_part, dk_part, dv_part = kernels.backward(
                dout.narrow(ax, *rows), q.narrow(ax, *rows), k_cur.narrow(ax, *keys), v_cur.narrow(ax, *keys),
                out.narrow(ax, *rows), lse.narrow(lax, *rows).contiguous(), call, settings, seed)
            _accumulate(dq, ax, call.q_start, call.q_stop, dq_part, _untouched(dq_touched, call.q_start, call.q_stop))
            parts.append((call.k_start, call.k_stop, dk_part, dv_part))
        # this step's dK, dV into the slice's accumulators (waited for only now, after the step's kernels)
        if held is None:
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            touched = []
        else:
            for work in held[2]:
                work.wait()
            dk, dv, touched = held[0], held[1], [(0, n)]
        for start, stop, dk_part, dv_part in parts:
            fresh = _untouched(touched, start, stop)
            _accumulate(dk, ax, start, stop, dk_part, fresh)
            _accumulate(dv, ax, start, stop, dv_part, fresh)
        if ring.world > 1:
            if step + 1 == ring.world:
                # the last hop carries complete sums, rounded to the output's dtype on arrival anyway: sent so
                # rounded, it moves half the bytes for the same result
                dk, dv = dk.to(k.dtype), dv.to(v.dtype)
            arriving = (torch.empty_like(dk), torch.empty_like(dv))
            held = (*arriving, ring.shift([dk, dv], list(arriving)))
        else:
            held = (dk, dv, [])
        if step + 1 < ring.world:
            for work in pending:
                work.wait()
            k_cur, v_cur = k_next, v_next
    for work in held[2]:  # one more hop: each slice's accumulator back at its own rank, complete
        work.wait()
    return dq.to(q.dtype), held[0].to(k.dtype), held[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, settings, kernels):
        out, lse = _forward(q.detach(), k.detach(), v.detach(), ring, settings, kernels)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.settings, ctx.kernels = ring, settings, kernels
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.ring, ctx.settings, ctx.kernels)
        return dq, dk, dv, None, None, None


def _check_group(group, tensors) -> Ring:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fa2cupy.distributed needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group(backend='nccl'))")
    backend = dist.get_backend(group)
    if backend != "nccl":
        raise ValueError(f"group must use the NCCL backend (the K/V slices travel between GPUs), got {backend!r}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            raise TypeError(f"{name} must be a CUDA torch.Tensor, got "
                            f"{t.device if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.device.index != torch.cuda.current_device():
            raise ValueError(f"{name} is on {t.device} but this rank's device is cuda:{torch.cuda.current_device()} "
                             f"(torch.cuda.set_device(local_rank) before the call)")
    return Ring(group)


def _check_same_slices(ring: Ring, q, k) -> None:
    """Every rank's slice has the same shape (a collective of a few integers; the host waits for it)."""
    mine = torch.tensor([*q.shape, *k.shape], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(ring.world)]
    dist.all_gather(every, mine, group=ring.group)
    shapes = [t.tolist() for t in every]
    if any(s != shapes[ring.rank] for s in shapes):
        raise ValueError("every rank's q, k, v slice must have the same shape (the layouts split the sequence "
                         f"evenly); (q shape, k shape) by rank: {[(tuple(s[:4]), tuple(s[4:])) for s in shapes]}")


def settings_for(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, deterministic,
                 layout, kernel_options, world: int, varlen: bool = False) -> Settings:
    """The validated Settings of a ring call (argument errors name the argument and what is allowed)."""
    p = fa_torch._reject_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ring attention takes no ALiBi (its bias depends on the distance "
                                  "across slices, which the per-slice kernel calls do not know); use "
                                  "fa2cupy.torch.flash_attn_func on one GPU")
    checks._check_bool(causal, "causal")
    checks._check_bool(deterministic, "deterministic")
    if layout not in layouts.LAYOUTS:
        raise ValueError(f"layout must be one of {layouts.LAYOUTS}, got {layout!r}")
    form = "(tokens / world, heads, headdim)" if varlen else "(batch, seqlen / world, heads, headdim)"
    ax = 0 if varlen else 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != ax + 3:
            raise ValueError(f"{name} must be {ax + 3}-D {form}, got shape {tuple(t.shape)}")
    if k.shape[:-1] != v.shape[:-1] or k.shape[:ax + 1] != q.shape[:ax + 1] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k and v must be {form.replace('heads', 'nheads_kv')} with q's slice length (and batch), "
                         f"k with q's headdim (v's may differ): q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    layouts.segments(layout, q.shape[ax] * world, world, 0)  # the slice splits as the layout needs
    _, left, right = checks.window_bounds(causal, window_size)
    left = -1 if left == checks.UNLIMITED_WINDOW else left
    right = -1 if right == checks.UNLIMITED_WINDOW else right
    scale = 1.0 / math.sqrt(int(q.shape[-1])) if softmax_scale is None else float(softmax_scale)
    seed = _mix_seed(*fa_torch._draw_dropout_rng(q.device)) if p > 0 else 0
    return Settings(layout, left, right, scale, float(softcap), p, seed, bool(deterministic),
                    fa_torch._options_handle(kernel_options))


def ring_flash_attn_func(q, k, v, group=None, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_attn_probs=False, *,
                         layout="zigzag", kernel_options=None):
    """Attention over a sequence split across the ranks of ``group`` (context parallelism), differentiable.

    Every rank calls it with its slice of the sequence: ``q (batch, seqlen / world, nheads, headdim)``, ``k, v
    (batch, seqlen / world, nheads_kv, headdim)`` (v's head dim may differ: the output takes it), float16 or
    bfloat16 CUDA tensors on the rank's device
    (``torch.cuda.current_device()``), laid out as ``layout`` says (:func:`shard` cuts a full sequence so):
    ``"zigzag"`` (the default: chunks r and 2 world - 1 - r of 2 world, the same causal work on every rank) or
    ``"contiguous"`` (rank r's n = seqlen / world consecutive tokens). The result is this rank's rows of
    ``fa2cupy.torch.flash_attn_func`` over the whole sequence (self-attention: seqlen_q = seqlen_k), up to
    rounding: the partial results merge in float32.

    Args:
        group: a torch.distributed process group with the NCCL backend (None: the default group).
        causal, softmax_scale, window_size, softcap, dropout_p, deterministic: as in
            :func:`fa2cupy.torch.flash_attn_func`, over the whole sequence's positions. Dropout masks are fa2cupy's
            own per kernel call, seeded from torch's CUDA generator (the same on every rank) mixed with the rank,
            ring step and call.
        alibi_slopes: not supported (NotImplementedError).
        return_attn_probs: also return this rank's ``softmax_lse`` (float32 ``(batch, nheads, seqlen / world)``).
        layout: ``"zigzag"`` or ``"contiguous"``.
        kernel_options: a :class:`fa2cupy.KernelOptions` for every kernel call.

    Returns:
        ``out`` like q (this rank's rows), or ``(out, softmax_lse, None)``.

    Each call checks that every rank's slices have the same shape (one small all-gather, which the host waits
    for). The K/V slices travel with P2P sends on NCCL's stream, overlapped with the kernels on torch's current
    stream; the backward passes dK/dV accumulators round the ring with them.
    """
    ring = _check_group(group, {"q": q, "k": k, "v": v})
    settings = settings_for(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                            deterministic, layout, kernel_options, ring.world)
    _check_same_slices(ring, q, k)
    out, lse = _RingAttention.apply(q, k, v, ring, settings, _Dense(settings, ring, q.shape[1]))
    if return_attn_probs:
        return out, lse, None
    return out


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, group=None, causal=False, softmax_scale=None,
                                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                                deterministic=False, return_attn_probs=False, *, layout="zigzag",
                                kernel_options=None):
    """:func:`ring_flash_attn_func` over packed documents (packed-document training): the ranks split one packed
    sequence of ``total`` tokens, and documents may cross the slices' boundaries.

    ``q (total / world, nheads, headdim)``, ``k, v (total / world, nheads_kv, headdim)``: this rank's slice of the
    packed token axis, laid out as ``layout`` says (:func:`shard` with ``dim=0``). ``cu_seqlens``: int32
    ``(documents + 1,)``, the whole packed sequence's document bounds (0 ... total), the same on every rank;
    ``max_seqlen``: the longest document. A token attends to the tokens of its own document only (causal and the
    window within it). The result is this rank's rows of ``fa2cupy.torch.flash_attn_varlen_func(q, k, v,
    cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, ...)`` over the whole packed sequence; ``softmax_lse`` is
    ``(nheads, total / world)``. The other arguments as for :func:`ring_flash_attn_func`.

    The host reads ``cu_seqlens`` (once per call) to plan each step's varlen kernel calls: one per pair of slices'
    segments and window, the documents' pieces its sequences.
    """
    ring = _check_group(group, {"q": q, "k": k, "v": v})
    settings = settings_for(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                            deterministic, layout, kernel_options, ring.world, varlen=True)
    bounds = _document_bounds(cu_seqlens, max_seqlen, q.shape[0] * ring.world)
    _check_same_slices(ring, q, k)
    kernels = _Varlen(settings, ring, q.shape[0], bounds, q.device)
    out, lse = _RingAttention.apply(q, k, v, ring, settings, kernels)
    if return_attn_probs:
        return out, lse, None
    return out


def _document_bounds(cu_seqlens, max_seqlen, total: int) -> list[int]:
    """cu_seqlens as host ints, checked: 1-D int32, from 0 to ``total`` (every rank's tokens), non-decreasing, no
    document longer than ``max_seqlen``."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise TypeError("cu_seqlens must be a 1-D int32 torch.Tensor (documents + 1,), got "
                        f"{cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__}"
                        f"{'' if not isinstance(cu_seqlens, torch.Tensor) else f' of shape {tuple(cu_seqlens.shape)}'}")
    bounds = cu_seqlens.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the packed sequence's {total} tokens (every rank's slice "
                         f"together), got {bounds[:4]}{' ...' if len(bounds) > 4 else ''} ending {bounds[-1]}")
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < longest:
        raise ValueError(f"max_seqlen must be an int >= the longest document ({longest}), got {max_seqlen!r}")
    return bounds


# ---------------------------------------------------------------------------------------------- layouts


def _local_index(layout: str, seqlen: int, world: int, rank: int, device) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + n, device=device)
                      for s, n in layouts.segments(layout, seqlen, world, rank)])


def shard(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's slice of the full sequence ``x`` (the sequence along ``dim``), as ``layout`` lays it out: a new
    contiguous tensor. Every rank passes the same ``x``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.index_select(dim, _local_index(layout, x.shape[dim], world, rank, x.device)).contiguous()


def unshard(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's slice ``x`` (laid out as ``layout``): an all-gather over ``group``, then
    the slices' rows put back in sequence order. Not differentiable."""
    world = dist.get_world_size(group)
    n = x.shape[dim]
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    gathered = torch.cat(parts, dim)
    index = torch.cat([_local_index(layout, n * world, world, r, x.device) for r in range(world)])
    out = torch.empty_like(gathered)
    out.index_copy_(dim, index, gathered)
    return out
