"""Context parallelism: attention over a sequence split across GPUs (ring attention on torch.distributed/NCCL).

    import fa2cupy.distributed as fd
    q, k, v = (fd.shard(x, layout="zigzag") for x in (q_full, k_full, v_full))  # this rank's slices
    out = fd.ring_flash_attn_func(q, k, v, causal=True)                         # this rank's rows
    out_full = fd.unshard(out)

:mod:`fa2cupy.distributed.layout` holds the position arithmetic (which tokens a rank holds, which kernel calls a
ring step needs) and imports nothing else; this package's functions need torch.
"""

from __future__ import annotations

from fa2cupy.distributed.layout import LAYOUTS, segments

__all__ = ["LAYOUTS", "ring_flash_attn_func", "ring_flash_attn_varlen_func", "segments", "shard", "unshard"]


def __getattr__(name):  # torch only when a function that needs it is asked for
    if name in ("ring_flash_attn_func", "ring_flash_attn_varlen_func", "shard", "unshard"):
        try:
            from fa2cupy.distributed import ring
        except ImportError as exc:
            raise ImportError(f"fa2cupy.distributed.{name} needs torch (pip install torch): {exc}") from None
        return getattr(ring, name)
    raise AttributeError(f"module 'fa2cupy.distributed' has no attribute {name!r}")
