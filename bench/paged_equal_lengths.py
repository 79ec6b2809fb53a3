"""Paged K/V against packed K/V in the varlen forward at equal sequence lengths (fp16, 16 heads of 128, 16k tokens),
where bench/varlen_speed.py --paged times mixed lengths: the same call with a shuffled block_table of pages of 16
and 256 rows, best of 3 medians each, outputs compared bitwise.

    python bench/paged_equal_lengths.py
"""

import sys

import cupy
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
import fa2cupy  # noqa: E402
from fa2cupy import benchmark as B  # noqa: E402
from varlen_speed import paged_pool  # noqa: E402


def main():
    events = B.CupyEvents()
    rng, gen = cupy.random.default_rng(0), np.random.default_rng(3)
    for b, s, causal in ((2, 8192, False), (4, 4096, False), (1, 16384, False), (2, 8192, True)):
        cu = cupy.arange(0, b * s + 1, s, dtype=cupy.int32)
        q, k, v = (rng.standard_normal((b * s, 16, 128), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
        for page_size in (16, 256):
            k_pages, v_pages, table = paged_pool(gen, [s] * b, page_size, k, v)

            def packed():
                return fa2cupy.flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=causal)

            def paged():
                return fa2cupy.flash_attn_varlen_func(q, k_pages, v_pages, cu, cu, s, s, causal=causal,
                                                      block_table=table)

            same = bool(cupy.array_equal(packed(), paged()))
            a, c = (min(B.time_gpu(f, events, warmup=3, repeats=15).median_ms for _ in range(3))
                    for f in (packed, paged))
            print(f"{b}x{s} causal={causal} pages {page_size}: packed {a:.3f} paged {c:.3f} ms: paged/packed speed "
                  f"{a / c:.3f}x equal={same}", flush=True)


if __name__ == "__main__":
    main()
