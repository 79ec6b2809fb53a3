"""CPU tests of the benchmark harness's pure pieces (grid, FLOPs, rounding, tables, JSON)."""

from __future__ import annotations

import datetime as dt
import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fa2cupy_bench import harness as B


# ----------------------------------------------------------------------------- grid


def test_paper_grid_defaults_match_fa2_paper():
    cases = B.paper_grid()
    assert len(cases) == 2 * 2 * 6
    for c in cases:
        assert c.batch * c.seqlen_q == 16384          # 16k tokens per batch
        assert c.nheads * c.headdim == 2048           # hidden 2048
        assert c.seqlen_q == c.seqlen_k and c.nheads == c.nheads_kv
        assert c.dtype == "bf16"
    assert {c.headdim for c in cases} == {64, 128}
    assert {c.causal for c in cases} == {False, True}
    assert sorted({c.seqlen_q for c in cases}) == [512, 1024, 2048, 4096, 8192, 16384]
    first = cases[0]
    assert (first.batch, first.seqlen_q, first.nheads, first.headdim, first.causal) == (32, 512, 32, 64, False)


def test_paper_grid_order_groups_panels():
    cases = B.paper_grid((64, 128), (False, True), (512, 1024))
    keys = [(c.headdim, c.causal) for c in cases]
    assert keys == [(64, False)] * 2 + [(64, True)] * 2 + [(128, False)] * 2 + [(128, True)] * 2


def test_paper_grid_long_sequences_keep_batch_one():
    (c,) = B.paper_grid((128,), (False,), (32768,))
    assert c.batch == 1


def test_paper_grid_rejects_headdim_not_dividing_hidden():
    with pytest.raises(ValueError):
        B.paper_grid((96,), (False,), (512,), hidden=2000)


@pytest.mark.parametrize("text,expected", [
    ("512,1024", [512, 1024]), (" 64 , 128 ", [64, 128]), ("2k,16K", [2048, 16384]), ("7", [7]),
])
def test_parse_int_list(text, expected):
    assert B.parse_int_list(text) == expected


@pytest.mark.parametrize("text", ["", "a,b", "0", "-4", ","])
def test_parse_int_list_rejects(text):
    with pytest.raises(ValueError):
        B.parse_int_list(text)


def test_causal_options():
    assert B.causal_options("both") == [False, True]
    assert B.causal_options("on") == [True]
    assert B.causal_options("off") == [False]
    with pytest.raises(ValueError):
        B.causal_options("maybe")


def test_case_validation_and_label():
    c = B.Case(2, 100, 300, 8, 2, 64, True, "bfloat16")
    assert c.dtype == "bf16"
    assert c.label == "b2 sq100/sk300 h8/2 d64 causal bf16"
    assert B.Case(1, 8, 8, 1, 1, 32, False, "fp16").label == "b1 s8 h1 d32 fp16"
    assert c.q_shape == (2, 100, 8, 64) and c.kv_shape == (2, 300, 2, 64)
    with pytest.raises(ValueError):
        B.Case(1, 8, 8, 6, 4, 64, False)          # 6 heads not a multiple of 4
    with pytest.raises(ValueError):
        B.Case(1, 0, 8, 1, 1, 64, False)
    with pytest.raises(ValueError):
        B.Case(1, 8, 8, 1, 1, 64, False, "fp32")


# ----------------------------------------------------------------------------- FLOPs


def test_flops_formula():
    c = B.Case(4, 1024, 2048, 16, 16, 128, False)
    assert B.attention_flops(c) == 4 * 4 * 16 * 1024 * 2048 * 128


def test_flops_causal_is_half():
    a = B.Case(2, 4096, 4096, 16, 16, 128, False)
    b = B.Case(2, 4096, 4096, 16, 16, 128, True)
    assert B.attention_flops(b) == B.attention_flops(a) / 2


def test_flops_gqa_counts_query_heads():
    assert B.attention_flops(B.Case(1, 64, 64, 8, 1, 64, False)) == B.attention_flops(B.Case(1, 64, 64, 8, 8, 64, False))


def test_flops_modes():
    c = B.Case(1, 512, 512, 4, 4, 64, False)
    assert B.attention_flops(c, "bwd") == 2.5 * B.attention_flops(c)
    assert B.attention_flops(c, "fwdbwd") == 3.5 * B.attention_flops(c)
    assert B.attention_flops(c, "fwd_bwd") == 3.5 * B.attention_flops(c)      # alias
    cc = B.Case(1, 512, 512, 4, 4, 64, True)
    assert B.attention_flops(cc, "bwd") == 2.5 * B.attention_flops(c) / 2
    with pytest.raises(ValueError):
        B.attention_flops(c, "sideways")


@pytest.mark.parametrize("text,expected", [
    ("fwd", "fwd"), ("bwd", "bwd"), ("fwdbwd", "fwdbwd"), ("fwd_bwd", "fwdbwd"), ("FWD+BWD", "fwdbwd"),
    (" backward ", "bwd"), ("forward", "fwd"),
])
def test_canonical_mode(text, expected):
    assert B.canonical_mode(text) == expected


@pytest.mark.parametrize("text", ["", "decode", "bwdfwd", "fwd bwd"])
def test_canonical_mode_rejects(text):
    with pytest.raises(ValueError, match="unknown mode"):
        B.canonical_mode(text)


def test_flops_description():
    assert B.flops_description("fwd") == "4*b*h*sq*sk*d, halved when causal"
    assert B.flops_description("bwd").startswith("2.5 x (")
    assert B.flops_description("fwd_bwd").startswith("3.5 x (")


def test_paper_grid_flops_constant_per_panel():
    # 16k tokens: batch * seqlen^2 grows linearly with seqlen.
    cases = B.paper_grid((128,), (False,), (1024, 2048))
    f = [B.attention_flops(c) for c in cases]
    assert f[1] == 2 * f[0]


def test_tflops_per_s():
    assert B.tflops_per_s(1e12, 1000.0) == pytest.approx(1.0)
    assert B.tflops_per_s(333e12, 1.0) == pytest.approx(333e3)
    assert B.tflops_per_s(1e12, None) is None
    assert B.tflops_per_s(1e12, 0.0) is None


@given(b=st.integers(1, 8), sq=st.integers(1, 4096), sk=st.integers(1, 4096),
       h=st.integers(1, 32), d=st.integers(1, 256))
def test_flops_property(b, sq, sk, h, d):
    full = B.attention_flops(B.Case(b, sq, sk, h, h, d, False))
    assert full == 4 * b * h * sq * sk * d
    assert B.attention_flops(B.Case(b, sq, sk, h, h, d, True)) * 2 == full


# ----------------------------------------------------------------------------- host rounding


def test_bf16_rounding_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 100
    x[:4] = [0.0, -0.0, np.inf, -np.inf]
    bits = B.bf16_bits(x)
    expected = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(bits, expected)
    np.testing.assert_array_equal(B.bf16_bits_to_float(bits), x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_bf16_rounding_ties_to_even_and_nan():
    # 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: ties go to even (1.0).
    x = np.array([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, np.nan], dtype=np.float32)
    vals = B.bf16_bits_to_float(B.bf16_bits(x))
    assert vals[0] == 1.0
    assert vals[1] == 1.0 + 2.0 ** -6
    assert np.isnan(vals[2])


def test_host_inputs_rounded_and_deterministic():
    c = B.Case(2, 5, 7, 4, 2, 40, False, "bf16")
    a = B.host_inputs(c, 3)
    b = B.host_inputs(c, 3)
    assert a["q"][0].shape == c.q_shape and a["k"][0].shape == c.kv_shape
    assert a["q"][0].dtype == np.uint16 and a["q"][1].dtype == np.float64
    np.testing.assert_array_equal(a["v"][1], b["v"][1])
    assert np.abs(a["q"][1]).max() > 0                       # never zeros
    f = B.host_inputs(B.Case(1, 5, 5, 1, 1, 8, False, "fp16"), 0)
    assert f["q"][0].dtype == np.float16
    np.testing.assert_array_equal(f["q"][0].astype(np.float64), f["q"][1])


# ----------------------------------------------------------------------------- tables, JSON


def test_format_table_alignment():
    text = B.format_table(["name", "x"], [["a", 1], ["long name", None]])
    lines = text.splitlines()
    assert lines[0].startswith("name") and lines[1].startswith("---------")
    assert lines[2] == "a            1"
    assert lines[3].endswith("n/a")
    assert len({len(line) for line in lines}) == 1
    with pytest.raises(ValueError):
        B.format_table(["a", "b"], [[1]])


def _record(label="b1 s512 h16 d128 bf16", fa=100.0, flash=200.0, cudnn=None, diff=0.0):
    c = B.Case(32, 512, 512, 16, 16, 128, False)
    res = {}
    for k, v in (("fa2cupy", fa), ("sdpa_flash", flash), ("sdpa_cudnn", cudnn)):
        res[k] = {"tflops": v, "error": None if v is not None else "unavailable: no cuDNN"}
    return {"label": label, "case": c.to_dict(), "results": res, "max_abs_diff": diff}


def test_results_table_columns_and_ratios():
    text = B.results_table([_record()])
    header, _, row = text.splitlines()
    for col in ("case", "fa2cupy", "SDPA flash", "SDPA cuDNN", "vs flash", "vs cuDNN"):
        assert col in header
    assert "100.0" in row and "200.0" in row and "0.50x" in row and "n/a" in row


def test_results_table_flags_wrong_output():
    assert "100.0!" in B.results_table([_record(diff=0.5)])
    assert "100.0!" not in B.results_table([_record(diff=0.01)])


def test_errors_summary_dedupes():
    lines = B.errors_summary([_record(), _record()])
    assert lines == ["SDPA cuDNN: unavailable: no cuDNN (2 cases)"]


def test_result_basename_and_slug():
    when = dt.datetime(2026, 11, 17, 14, 32, 5)
    name = B.result_basename("fwd", "NVIDIA H100 80GB HBM3", when)
    assert name == "fwd_nvidia-h100-80gb-hbm3_20261117-143205"
    assert all(ch.isalnum() or ch in "._-" for ch in name)
    assert B.slug("") == "unknown"


def test_write_json_roundtrip(tmp_path):
    rec = _record()
    path = B.write_json(tmp_path / "sub" / "r.json",
                        {"records": [rec], "n": np.int64(3), "x": np.float32(1.5), "bad": math.nan,
                         "case": B.Case(1, 2, 2, 1, 1, 8, False)})
    data = json.loads(path.read_text())
    assert data["n"] == 3 and data["x"] == 1.5
    assert data["records"][0]["results"]["fa2cupy"]["tflops"] == 100.0
    assert data["case"]["headdim"] == 8


def test_plot_results(tmp_path):
    pytest.importorskip("matplotlib")
    recs = []
    for d in (64, 128):
        for causal in (False, True):
            for s in (512, 1024):
                c = B.Case(16384 // s, s, s, 2048 // d, 2048 // d, d, causal)
                r = _record(c.label, fa=float(s) / 10, cudnn=None)
                r["case"] = c.to_dict()
                recs.append(r)
    path = tmp_path / "p.png"
    assert B.plot_results(recs, path, title="t") is None
    assert path.stat().st_size > 1000


def test_cuda_version_str():
    assert B.cuda_version_str(12040) == "12.4"
    assert B.cuda_version_str(13000) == "13.0"
    assert B.cuda_version_str(0) is None


def test_decode_grid_and_bytes():
    grid = B.decode_grid(B.DECODE_BATCHES, B.DECODE_SEQLENS)
    assert (1, 65536) in grid and (8, 65536) in grid and (64, 16384) in grid
    assert (64, 65536) not in grid  # 4M tokens > 1M
    assert all(b * s <= B.DECODE_MAX_TOKENS for b, s in grid) and len(grid) == 11
    assert B.kv_cache_bytes(1, 16384, 8, 128) == 2 * 16384 * 8 * 128 * 2  # 64 MiB of K and V


def test_decode_table_formats_missing_cells():
    rec = {"batch": 1, "seqlen_k": 1024, "kv_bytes": 4 << 20, "fa2cupy_tbps": 1.5, "sdpa_flash_tbps": None,
           "sdpa_cudnn_tbps": 1.0, "ratio_vs_best_sdpa": 1.5, "fa2cupy_us": 2.8}
    table = B.decode_table([rec])
    assert "1.50" in table and "1.50x" in table and "4" in table


def test_modes_registered():
    assert B.MODES == ("fwd", "bwd", "fwdbwd") and B.CLI_MODES == B.MODES + ("decode",)
    for m in B.MODES:
        assert m in B.MODE_RUNNERS and m in B.FLOP_FACTORS and m in B.DIFF_LIMITS
    assert B.MODE_RUNNERS["fwd"] is B.bench_forward_case
    with pytest.raises(ValueError):
        B.bench_backward_case(B.Case(1, 8, 8, 1, 1, 8, False), mode="fwd")


def test_results_table_uses_record_diff_limit():
    rec = _record(diff=0.08)
    assert "100.0!" in B.results_table([rec])                 # forward limit 0.05
    rec["diff_limit"] = B.DIFF_LIMITS["bwd"]
    assert "100.0!" not in B.results_table([rec])


def test_memory_table():
    rec = _record()
    assert B.memory_table([rec]) is None                      # forward records: no memory
    rec["results"]["fa2cupy"]["peak_mib"] = 300.0
    rec["results"]["sdpa_flash"]["peak_mib"] = 600.0
    header, _, row = B.memory_table([rec]).splitlines()
    assert "fa2cupy MiB" in header and "SDPA flash MiB" in header and "vs flash" in header
    assert "300" in row and "600" in row and "0.50x" in row and "n/a" in row


# ----------------------------------------------------------------------------- GPU smoke


@pytest.mark.gpu
def test_bench_forward_case_tiny_gpu():
    rec = B.bench_forward_case(B.Case(2, 256, 256, 4, 4, 64, True), warmup=2, repeats=3)
    fa = rec["results"]["fa2cupy"]
    assert fa["error"] is None, fa["error"]
    assert fa["tflops"] > 0 and fa["n"] >= 3
    if rec["max_abs_diff"] is not None:
        assert rec["max_abs_diff"] < 0.05
    json.dumps(rec)


@pytest.mark.gpu
def test_decode_bench_case_times_every_implementation():
    # One point of `fa2cupy bench --mode decode`, small: fa2cupy contiguous and paged against SDPA, eager (also
    # queued behind a spinning kernel) and from a CUDA graph; fa2cupy's output close to SDPA flash's, the paged one
    # bitwise equal to the contiguous one.
    if not B.torch_available():
        pytest.skip("needs torch with CUDA")
    rec = B.bench_decode_case(2, 1024, warmup=2, repeats=5, rounds=1)
    assert rec["kv_bytes"] == B.kv_cache_bytes(2, 1024, 8, 128) and rec["paged_equals_contiguous"] is True
    assert rec["max_abs_diff"] < 1e-2
    for name in ("fa2cupy", "fa2cupy_paged"):
        for suffix in ("", "_queued", "_graph"):
            assert math.isfinite(rec[name + suffix + "_tbps"]) and rec[name + suffix + "_tbps"] > 0, (name, suffix)
    assert rec["fa2cupy_graph_us"] * 1e-6 * rec["fa2cupy_graph_tbps"] * 1e12 == pytest.approx(rec["kv_bytes"])


class _ClockEvents:
    """Events on a pretend GPU clock that each call of the timed function advances by 2 ms; ``hold`` records
    the spin it was asked for, and its event reports done (the spin over) if ``spin_ends_early``."""

    def __init__(self, spin_ends_early=False):
        self.now, self.held, self.spin_ends_early = 0.0, [], spin_ends_early  # bool, or how many spins end early

    def event(self):
        events = self

        class Event:
            def record(self):
                self.t = events.now

            def query(self):
                early = events.spin_ends_early
                return early if isinstance(early, bool) else len(events.held) <= early

        return Event()

    @staticmethod
    def elapsed_ms(a, b):
        return b.t - a.t

    def sync(self):
        pass

    def hold(self, ms):
        self.held.append(ms)
        return self.event()


def test_time_gpu_batches_and_queues():
    # batch: samples of 8 calls per event pair, reported per call; queued: one spin covering every timed call's
    # enqueueing; a spin that ran out before the host was done is tried again twice as long, and after four such
    # spins an error rather than a number.
    events = _ClockEvents()

    def call():
        events.now += 2.0

    timing = B.time_gpu(call, events, warmup=1, repeats=4, queued=True, batch=8)
    assert timing.median_ms == 2.0 and timing.n == 4 and len(events.held) == 1 and events.held[0] > 0
    once = _ClockEvents(spin_ends_early=1)  # a host that stalled once

    def call_once():
        once.now += 2.0

    timing = B.time_gpu(call_once, once, warmup=1, repeats=4, queued=True, batch=8)
    assert timing.median_ms == 2.0 and timing.n == 4
    assert len(once.held) == 2 and once.held[1] == pytest.approx(2 * once.held[0])
    early = _ClockEvents(spin_ends_early=True)
    with pytest.raises(RuntimeError, match="before the host had enqueued"):
        B.time_gpu(lambda: None, early, warmup=1, repeats=3, queued=True)
    assert len(early.held) == 4 and early.held[3] == pytest.approx(8 * early.held[0])


def test_records_name_the_kernel_that_runs(monkeypatch):
    # A record's "config" is the kernel the call runs on: the Hopper forward's row where it takes the call (on
    # compute capability 9.0, masked calls from a length on), else the mma.sync forward's tiles.
    from fa2cupy import configs, forward
    from fa2cupy.options import KernelOptions

    monkeypatch.setattr(B, "gpu_arch", lambda: 90)
    hopper = B._kernel_config(B.Case(32, 512, 512, 32, 32, 64, True))
    assert hopper["family"] == "fwd_hopper" and hopper["block_m"] == 64 * hopper["consumer_wgs"]
    short = B._kernel_config(B.Case(1, configs.HOPPER_MASKED_MIN_SEQLEN[64] - 1, 100, 32, 32, 64, True))
    assert short["family"] == "fwd"
    assert B._kernel_config(B.Case(1, 4096, 4096, 16, 16, 128, False))["family"] == "fwd_hopper"
    mma = KernelOptions(hopper_forward=False)  # (what the record names is forward.kernel_config's row)
    assert forward.kernel_config(90, 128, "bfloat16", "none", seqlen_q=4096, options=mma).family == "fwd"
    monkeypatch.setattr(B, "gpu_arch", lambda: 80)
    assert B._kernel_config(B.Case(1, 4096, 4096, 16, 16, 128, False))["family"] == "fwd"


class _CountingEvents:
    """Stand-in for CupyEvents on the CPU: events that read 1 ms apart, and a count of synchronisations."""

    def __init__(self):
        self.syncs = 0

    class _Event:
        def record(self):
            pass

    def event(self):
        return self._Event()

    def elapsed_ms(self, a, b):
        return 1.0

    def sync(self):
        self.syncs += 1


def test_time_gpu_sustains_load_before_timing():
    events, calls = _CountingEvents(), []
    plain = B.time_gpu(lambda: calls.append(1), events, warmup=2, repeats=5)
    assert plain.n == 5 and len(calls) == 2 + 1 + 5  # warm-up, the estimate, the timed calls
    calls.clear()
    events.syncs = 0
    start = B.time.perf_counter()
    B.time_gpu(lambda: calls.append(1), events, warmup=2, repeats=5, sustain_seconds=0.05)
    assert B.time.perf_counter() - start >= 0.05
    sustained = len(calls) - (2 + 1 + 5)
    # back-to-back calls in groups of 8, each group followed by a synchronisation
    assert sustained >= 8 and sustained % 8 == 0
    assert events.syncs >= sustained // 8
    calls.clear()
    assert B.sustain(lambda: calls.append(1), events.sync, 0.02) == len(calls) >= 8  # the calls it made
    assert B.sustain(lambda: calls.append(1), events.sync, 0.0) == 0


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwdbwd"])
def test_bench_cases_pass_sustain_to_every_timing(monkeypatch, mode):
    # Each implementation's timing gets the same steady-load lead-in; no GPU: inputs, runners and the timer stubbed.
    case = B.Case(1, 256, 256, 2, 2, 64, False)
    monkeypatch.setattr(B, "make_forward_inputs", lambda case, seed, framework: B.ForwardInputs(case, "cupy", *"qkv"))
    monkeypatch.setattr(B, "_random_like", lambda x, seed: "dout")
    monkeypatch.setattr(B, "_kernel_config", lambda case: None)
    runner = B.Runner(lambda: None, _CountingEvents(), B.contextlib.nullcontext)
    for name in B.FORWARD_RUNNERS:
        monkeypatch.setitem(B.FORWARD_RUNNERS, name, lambda inp: runner)
    for maker in ("fa2cupy_backward_runner", "_sdpa_backward_runner"):
        monkeypatch.setattr(B, maker, lambda *args: runner)
    seen = []

    def fake_time_gpu(fn, events, **kw):
        seen.append(kw["sustain_seconds"])
        return B.Timing(1.0, 1.0, 1.0, 5)

    monkeypatch.setattr(B, "time_gpu", fake_time_gpu)
    rec = B.MODE_RUNNERS[mode](case, sustain_seconds=1.5, **({} if mode == "fwd" else {"memory": False}))
    assert seen == [1.5] * 3
    assert all(r["error"] is None and r["median_ms"] == 1.0 for r in rec["results"].values())


@pytest.mark.parametrize("seqlen,left", [(1, 0), (1, 5), (10, 0), (10, 3), (10, 9), (10, 10), (10, 50), (4097, 4096)])
@pytest.mark.parametrize("right", [0, 1, 4, 9, 60])
def test_band_pairs_counts_every_visible_pair(seqlen, left, right):
    i, j = np.arange(seqlen)[:, None], np.arange(seqlen)[None, :]   # every (query, key) pair, by broadcasting
    assert B.band_pairs(seqlen, left, right) == int(((j <= i + right) & (j >= i - left)).sum())


def test_kernel_options_of_reads_option_sets():
    # options_ab.py's option sets and tree_ab.py's trees: ints, 1/0 or true/false for bools, none; nothing changed
    # for ""
    from fa2cupy import KernelOptions

    assert B.kernel_options_of("") == KernelOptions()
    options = B.kernel_options_of("hopper_alibi_only=0,hopper_masked_min_seqlen=none,sm_count=2")
    assert options == KernelOptions(hopper_alibi_only=False, hopper_masked_min_seqlen=None, sm_count=2)
    assert B.kernel_options_of("hopper_pad_headdim=1").hopper_pad_headdim is True
    with pytest.raises(KeyError):
        B.kernel_options_of("no_such_option=1")
    assert B.kernel_options_of("hopper_bwd_rotate=True,tile_counter=false") == KernelOptions(
        hopper_bwd_rotate=True, tile_counter=False)
    with pytest.raises(ValueError, match="hopper_bwd_rotate takes"):
        B.kernel_options_of("hopper_bwd_rotate=yes")
    assert B.named_kernel_options("rot=hopper_bwd_rotate=0") == ("rot", KernelOptions(hopper_bwd_rotate=False))
    assert B.named_kernel_options("default=") == ("default", KernelOptions())


def test_packed_varlen_views_the_batch_as_one_sequence_per_row():
    # The varlen timing helpers pack a (batch, seqlen, heads, d) batch as batch sequences of seqlen, zero-copy, with
    # fa2cupy's varlen calls bound to cu_seqlens 0, seqlen, 2 seqlen, ... (no GPU: CPU torch tensors, nothing called)
    torch = pytest.importorskip("torch")
    q = torch.arange(3 * 5 * 2 * 4, dtype=torch.float32).reshape(3, 5, 2, 4)
    k, v, dout = q + 1, q + 2, q + 3
    pq, pk, pv, pdout, fwd, bwd = B.packed_varlen(q, k, v, dout)
    for packed, original in ((pq, q), (pk, k), (pv, v), (pdout, dout)):
        assert packed.shape == (15, 2, 4) and packed.data_ptr() == original.data_ptr()
        assert torch.equal(packed[5:10], original[1])
    import fa2cupy

    assert fwd.func is fa2cupy.flash_attn_varlen_func and bwd.func is fa2cupy.flash_attn_varlen_backward
    for f in (fwd, bwd):
        assert f.keywords["cu_seqlens_q"].tolist() == [0, 5, 10, 15] and f.keywords["cu_seqlens_k"] is f.keywords[
            "cu_seqlens_q"]
        assert f.keywords["max_seqlen_q"] == f.keywords["max_seqlen_k"] == 5
