"""A few small forward and backward cases for compute-sanitizer (memcheck / racecheck).

    compute-sanitizer --tool memcheck  python3 bench/sanitize_case.py
    compute-sanitizer --tool racecheck python3 bench/sanitize_case.py

Small on purpose (the sanitizers slow kernels down by orders of magnitude) but
covering the edges: partial tiles, causal with sq != sk (fully masked rows),
head dims 40 and 256, GQA/MQA, a single query.  Uses CuPy arrays only (no torch,
less noise under the sanitizer).  Each output is also checked against the float64
reference with the ``fa2cupy check`` bounds; exit status 1 on a mismatch.

The forward cases run the forward only; BWD_CASES run forward + backward
(``flash_attn_backward``, dq/dk/dv against the reference with
``fa2cupy.benchmark.gradient_bound``), in both deterministic modes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import cli  # noqa: E402
from fa2cupy import benchmark as B  # noqa: E402

CASES = (
    B.Case(1, 64, 64, 2, 2, 64, False, "fp16"),      # exactly one tile
    B.Case(1, 65, 65, 2, 2, 64, True, "bf16"),       # one past a tile, causal
    B.Case(2, 37, 91, 4, 2, 40, True, "bf16"),       # headdim 40 (padded), GQA, causal sq < sk
    B.Case(1, 33, 129, 2, 2, 256, False, "fp16"),    # headdim 256
    B.Case(1, 129, 33, 4, 1, 128, True, "bf16"),     # MQA, causal sq > sk: fully masked rows
    B.Case(2, 1, 77, 2, 2, 128, True, "fp16"),       # one query
    B.Case(1, 100, 100, 3, 3, 33, False, "bf16"),    # odd headdim
)

# (case, deterministic): forward + backward.
BWD_CASES = (
    (B.Case(1, 64, 64, 2, 2, 64, False, "fp16"), False),     # exactly one tile
    (B.Case(1, 65, 65, 2, 2, 64, True, "bf16"), True),       # one past a tile, causal
    (B.Case(1, 37, 91, 4, 2, 40, True, "bf16"), False),      # headdim 40, GQA, causal sq < sk
    (B.Case(1, 37, 91, 4, 2, 40, True, "bf16"), True),
    (B.Case(1, 33, 70, 2, 2, 256, False, "fp16"), True),     # headdim 256
    (B.Case(1, 33, 70, 2, 2, 256, True, "fp16"), False),
    (B.Case(1, 97, 33, 4, 1, 128, True, "bf16"), False),     # MQA, causal sq > sk: dead rows
    (B.Case(1, 97, 33, 4, 1, 128, True, "bf16"), True),
    (B.Case(1, 1, 77, 2, 2, 128, True, "fp16"), False),      # one query
)


def main() -> int:
    ok, msg = cli.probe_gpu()
    if not ok:
        print(msg)
        return 2
    print(cli.check_header(), flush=True)
    bad = 0
    for i, case in enumerate(CASES):
        r = cli.run_check_case(case, seed=i, backward=False)
        print(cli.check_row(i, r), flush=True)
        bad += not r.passed
    for j, (case, det) in enumerate(BWD_CASES, start=len(CASES)):
        r = cli.run_check_case(case, seed=j, backward=True, deterministic=det)
        print(cli.check_row(j, r), flush=True)
        bad += not r.passed
    total = len(CASES) + len(BWD_CASES)
    print(f"{total - bad}/{total} passed")
    return 1 if bad else 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
