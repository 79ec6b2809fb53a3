"""Plots and Markdown tables from the JSON files ``fa2cupy bench`` writes, without a GPU.

    python bench/dev/plot_results.py RESULT.json --png docs/forward_h200.png     # the harness's own plot
    python bench/dev/plot_results.py RESULT.json --markdown                       # table rows for docs/benchmarks.md

Forward and backward JSON (``mode`` "fwd", "bwd" or "fwdbwd"): the plot is one panel per (head dim, mask),
TFLOPs/s against sequence length, one line per implementation, drawn by the harness's ``plot_results``; the
table has one row per record from ``records[i].case`` (headdim, causal, seqlen_q) and
``records[i].results.<impl>.tflops`` for fa2cupy, sdpa_flash and sdpa_cudnn, with the two ratios.
Decode JSON (``mode`` "decode"): one row per record, the ``*_tbps`` fields of each way of timing (eager, queued,
graph) and ``ratio*_vs_best_sdpa``; no plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

IMPLS = ("fa2cupy", "sdpa_flash", "sdpa_cudnn")


def plot_function():
    """The harness's plot function (bench/harness.py)."""
    from bench.harness import plot_results

    return plot_results


def _seqlen(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def attention_rows(payload: dict) -> list[str]:
    """Markdown rows: headdim | causal | seqlen | fa2cupy | SDPA flash | SDPA cuDNN | vs flash | vs cuDNN."""
    rows = []
    for rec in sorted(payload["records"], key=lambda r: (r["case"]["headdim"], r["case"]["causal"],
                                                         r["case"]["seqlen_q"])):
        case, results = rec["case"], rec["results"]
        t = [(results.get(impl) or {}).get("tflops") for impl in IMPLS]
        cells = ["—" if x is None else f"{x:.0f}" for x in t]
        ratios = ["—" if t[0] is None or x is None else f"{t[0] / x:.2f}×" for x in t[1:]]
        rows.append(f"| {case['headdim']} | {'yes' if case['causal'] else 'no'} | {_seqlen(case['seqlen_q'])} | "
                    + " | ".join(cells + ratios) + " |")
    return rows


def decode_rows(payload: dict) -> list[str]:
    """Markdown rows: batch × cache | then fa2cupy / SDPA flash / SDPA cuDNN TB/s and the ratio to the better SDPA
    backend, for eager, queued and graph timings."""
    rows = []
    for rec in payload["records"]:
        cells = [f"{rec['batch']}×{_seqlen(rec['seqlen_k'])}"]
        for suffix, ratio in (("", "ratio_vs_best_sdpa"), ("_queued", "ratio_queued_vs_best_sdpa"),
                              ("_graph", "ratio_graph_vs_best_sdpa")):
            tbps = [rec.get(f"{impl}{suffix}_tbps") for impl in IMPLS]
            cells.append(" / ".join("—" if x is None else f"{x:.2f}" for x in tbps))
            cells.append("—" if rec.get(ratio) is None else f"{rec[ratio]:.2f}×")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="a JSON file written by fa2cupy bench")
    parser.add_argument("--png", help="write the harness's plot of the records here")
    parser.add_argument("--title", help="plot title (default: mode, dtype and GPU from the file)")
    parser.add_argument("--markdown", action="store_true", help="print the Markdown table rows")
    args = parser.parse_args(argv)
    payload = json.loads(Path(args.json).read_text())
    mode = payload.get("mode", "fwd")
    env = payload.get("environment", {})
    print(f"{args.json}: mode {mode}, {env.get('gpu', '?')}, {env.get('date_utc', '?')}, "
          f"{len(payload['records'])} records", file=sys.stderr)
    if args.markdown:
        print("\n".join(decode_rows(payload) if mode == "decode" else attention_rows(payload)))
    if args.png:
        if mode == "decode":
            parser.error("decode results have no plot")
        dtype = payload.get("settings", {}).get("dtype", "")
        title = args.title or f"fa2cupy {mode}, {dtype}, {env.get('gpu', '')}, {env.get('date_utc', '')[:10]}"
        why = plot_function()(payload["records"], args.png, title=title)
        if why:
            print(why, file=sys.stderr)
            return 1
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
