"""CPU tests of the ``fa2cupy`` command (cli.py): no-GPU exits, option parsing, check bookkeeping."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # cli.py lives in the repo root

import cli  # noqa: E402
from fa2cupy_bench import harness as B  # noqa: E402
from fa2cupy import testing  # noqa: E402
from source_tree import python_without_cupy  # noqa: E402

HAS_GPU = cli.probe_gpu()[0]
no_gpu_only = pytest.mark.skipif(HAS_GPU, reason="a GPU is present: the no-GPU path is not taken")


def _lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


@no_gpu_only
@pytest.mark.parametrize("command", [["check"], ["check", "--quick"], ["bench"], ["bench", "--mode", "decode"]])
def test_no_gpu_one_line_exit(command):
    result = CliRunner().invoke(cli.main, command)
    assert result.exit_code == cli.EXIT_NO_GPU != 0
    assert _lines(result) == [f"fa2cupy: {testing.gpu_unavailable_reason()}"]


def _no_driver() -> bool:
    """CuPy imports, and CUDA says no driver is loaded (driverGetVersion 0): this machine has no GPU driver."""
    try:
        import cupy
    except ImportError:
        return False
    return cupy.cuda.runtime.driverGetVersion() == 0


@pytest.mark.skipif(not _no_driver(), reason="a CUDA driver is installed: the no-driver message is not shown")
def test_no_driver_said_plainly():
    import conftest

    for said in (cli.probe_gpu()[1], conftest.gpu_unavailable_reason(), testing.gpu_unavailable_reason()):
        assert "no GPU or no CUDA driver found" in said
        assert "nsufficient" not in said and "cudaError" not in said   # not CUDA's "driver is insufficient"
    result = CliRunner().invoke(cli.main, ["check"])
    assert _lines(result) == ["fa2cupy: no GPU or no CUDA driver found (the NVIDIA driver's library, libcuda, is not "
                              "installed)"]


@no_gpu_only
def test_info_without_gpu_prints_what_it_knows():
    cupy = pytest.importorskip("cupy")
    import fa2cupy
    from fa2cupy import build

    result = CliRunner().invoke(cli.main, ["info"])
    assert result.exit_code == cli.EXIT_NO_GPU, result.output
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in _lines(result))   # name, padded; value
    assert rows["fa2cupy"] == fa2cupy.__version__
    assert rows["CuPy"].startswith(cupy.__version__)
    assert rows["NVRTC"] == ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    runtime = cupy.cuda.runtime.runtimeGetVersion()
    assert rows["CUDA runtime"].startswith(f"{runtime // 1000}.{runtime % 1000 // 10} (the CUDA CuPy was built for")
    assert rows["kernel cache"] == build.cache_dir()
    assert rows["GPU"] == testing.gpu_unavailable_reason()
    assert "cudaErrorInsufficientDriver" not in result.output


@pytest.mark.parametrize("command", ["check", "bench", "info"])
def test_no_cupy_names_extras(command, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)       # makes `import cupy` raise ImportError
    result = CliRunner().invoke(cli.main, [command])
    assert result.exit_code == cli.EXIT_NO_GPU
    lines = _lines(result)
    assert len(lines) == 1, result.output
    assert "fa2cupy[cuda12]" in lines[0] and "fa2cupy[cuda13]" in lines[0]


@pytest.mark.parametrize("args", [["--help"], ["check"], ["check", "--quick"], ["bench"], ["bench", "--mode", "bwd"],
                                  ["info"]])
def test_without_cupy_in_a_fresh_process(args):
    # As installed without a CUDA extra: help works, every command says in one line which extra to install.
    res = python_without_cupy("import cli; cli.main(prog_name='fa2cupy')", *args)
    if args == ["--help"]:
        assert res.returncode == 0 and res.stderr == "", res.stderr
        assert all(cmd in res.stdout for cmd in ("check", "bench", "info"))
        return
    lines = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert res.returncode == cli.EXIT_NO_GPU, res.stdout + res.stderr
    assert len(lines) == 1, res.stdout + res.stderr
    assert "CuPy is not installed" in lines[0]
    assert "pip install 'fa2cupy[cuda12]'" in lines[0] and "pip install 'fa2cupy[cuda13]'" in lines[0]


def test_probe_gpu_reports_cuda_error(monkeypatch):
    cupy = pytest.importorskip("cupy")

    def boom():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected\nsecond line")

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", boom)
    ok, msg = cli.probe_gpu()
    assert not ok
    assert "cudaErrorNoDevice" in msg and "\n" not in msg


def test_help_lists_commands():
    result = CliRunner().invoke(cli.main, ["--help"])
    assert result.exit_code == 0
    for cmd in ("check", "bench", "info"):
        assert cmd in result.output


def test_bench_mode_choices_and_bad_lists():
    runner = CliRunner()
    r = runner.invoke(cli.main, ["bench", "--mode", "sideways"])
    assert r.exit_code == 2 and "sideways" in r.output
    for mode in ("fwd", "bwd", "fwdbwd", "decode"):
        assert mode in runner.invoke(cli.main, ["bench", "--help"]).output
    r = runner.invoke(cli.main, ["bench", "--seqlens", "512,abc"])
    assert r.exit_code == 2 and "seqlens" in r.output


def test_check_cases_cover_what_they_claim():
    cases = cli.check_cases(seed=0)
    dims = {c.headdim for c in cases}
    assert {32, 64, 128, 256} <= dims
    assert any(d % 8 for d in dims)                                  # odd head dims
    assert {"bf16", "fp16"} <= {c.dtype for c in cases}
    assert any(c.nheads_kv == 1 and c.nheads > 1 for c in cases)     # MQA
    assert any(1 < c.nheads_kv < c.nheads for c in cases)            # GQA
    assert any(c.causal and c.seqlen_q > c.seqlen_k for c in cases)
    assert any(c.causal and c.seqlen_q < c.seqlen_k for c in cases)
    lens = {c.seqlen_q for c in cases} | {c.seqlen_k for c in cases}
    assert {63, 65, 127, 129, 255, 257} <= lens                      # tile boundaries +-1
    assert {17, 113, 251, 509} <= lens                               # primes
    quick = cli.check_cases(seed=0, quick=True)
    assert len(quick) < len(cases)


def test_random_cases_depend_on_seed():
    assert cli.random_cases(1, 5) == cli.random_cases(1, 5)
    assert cli.random_cases(1, 5) != cli.random_cases(2, 5)
    for c in cli.random_cases(7, 50):
        assert 1 <= c.headdim <= 256 and c.nheads % c.nheads_kv == 0


def test_bounds_live_in_one_place():
    # fa2cupy check's bounds are fa2cupy.testing's (tests/test_testing.py checks their values), not a copy.
    for name in ("_bound", "OUT_REL", "LSE_REL", "GRAD_C", "out_bound", "gradient_bound", "compare_gradients"):
        assert not hasattr(cli, name)
    for name in ("out_bound", "lse_bound", "gradient_bound", "reference_gradients", "to_numpy64"):
        assert not hasattr(B, name)


@no_gpu_only
@pytest.mark.parametrize("mode", ["bwd", "fwdbwd"])
def test_bench_backward_modes_parse_then_need_gpu(mode):
    r = CliRunner().invoke(cli.main, ["bench", "--mode", mode, "--deterministic", "--seqlens", "2k"])
    assert r.exit_code == cli.EXIT_NO_GPU


def test_check_backward_subset():
    full, quick = cli.check_cases(seed=0), cli.check_cases(seed=0, quick=True)
    bwd = [c for c in full if cli.checks_backward(c)]
    assert 10 <= len(bwd) < len(full)                       # big cases skip the float64 backward
    assert 0 < sum(cli.checks_backward(c) for c in quick) < len(bwd)
    assert not cli.checks_backward(B.Case(1, 2048, 2048, 2, 2, 128, True, "bf16"))
    assert {"bf16", "fp16"} <= {c.dtype for c in bwd}
    assert any(c.causal and c.seqlen_q > c.seqlen_k for c in bwd)
    assert any(1 <= c.nheads_kv < c.nheads for c in bwd)
    assert {32, 256} <= {c.headdim for c in bwd} and any(c.headdim % 8 for c in bwd)


def _grad_case():
    from fa2cupy.reference import attention_ref, attention_ref_backward

    case = B.Case(1, 9, 5, 4, 2, 16, True, "fp16")
    host = B.host_inputs(case, 0)
    q, k, v = (host[n][1] for n in "qkv")
    dout = B.host_dout(case, 0)[1]
    out, _ = attention_ref(q, k, v, causal=True)
    ref = attention_ref_backward(dout, q, k, v, causal=True)
    return case, ref, (dout, q, k, v, out)


def test_gradient_ratios_of_the_shared_rule():
    case, ref, inputs = _grad_case()

    def ratios(grads):
        return cli.gradient_ratios(testing.gradient_errors(grads, *inputs, case.dtype, causal=True, ref_grads=ref))

    assert ratios(ref) == {"dq": 0.0, "dk": 0.0, "dv": 0.0}
    off = [g.copy() for g in ref]
    off[1][0, 0, 0, 0] += 0.1                         # far above 16 * 2^-11 * max|dk|
    r = ratios(off)
    assert r["dk"] > 1 and r["dq"] == 0.0
    nan = [g.copy() for g in ref]
    nan[2][0, -1, 0, 0] = np.nan
    assert ratios(nan)["dv"] == math.inf
    with pytest.raises(ValueError, match="dk has shape"):
        ratios([ref[0], ref[1][:, :1], ref[2]])
    assert cli.gradient_ratios([("dq", 0.0, 0.0), ("dk", 1e-9, 0.0)]) == {"dq": 0.0, "dk": math.inf}


def test_check_row_with_gradients():
    case = B.Case(1, 9, 5, 2, 1, 16, True, "fp16")
    ok = cli.CheckResult(case, 1e-4, 1e-3, 1e-6, 0.01, 8, 0.5, grad_ratios={"dq": 0.1, "dk": 0.2, "dv": 0.3},
                         deterministic=True)
    row = cli.check_row(0, ok)
    assert ok.passed and "0.30" in row and "deterministic" in row and "PASS" in row
    bad = dataclasses.replace(ok, grad_ratios={"dq": 0.1, "dk": 1.5, "dv": math.inf})
    assert not bad.passed and "FAIL" in cli.check_row(0, bad) and "inf" in cli.check_row(0, bad)
    fwd_only = cli.CheckResult(case, 1e-4, 1e-3, 1e-6, 0.01, 8, 0.5)
    assert fwd_only.passed and cli.check_row(0, fwd_only).count(" - ") >= 3
    for h in ("dq/bnd", "dk/bnd", "dv/bnd"):
        assert h in cli.check_header()


def _ref(case, seed=0):
    from fa2cupy.reference import attention_ref

    host = B.host_inputs(case, seed)
    out, lse = attention_ref(host["q"][1], host["k"][1], host["v"][1], causal=case.causal)
    return out, lse


def test_compare_passes_exact_and_fails_perturbed():
    case = B.Case(1, 9, 5, 2, 1, 16, True, "fp16")         # sq > sk causal: 4 dead rows per head
    out, lse = _ref(case)
    kernel_lse = np.where(np.isfinite(lse), lse, np.inf)
    r = cli.compare(case, np.nan_to_num(out), kernel_lse, out, lse)
    assert r.passed and r.masked_rows == 2 * 4
    bad = np.nan_to_num(out).copy()
    bad[0, -1, 0, 0] += 0.01
    assert not cli.compare(case, bad, kernel_lse, out, lse).passed
    bad_lse = kernel_lse.copy()
    bad_lse[0, 0, -1] += 0.1
    assert not cli.compare(case, np.nan_to_num(out), bad_lse, out, lse).passed
    nan_out = np.nan_to_num(out).copy()
    nan_out[0, 0, 0, 0] = np.nan                             # a dead row must be zeros, not NaN
    assert not cli.compare(case, nan_out, kernel_lse, out, lse).passed


def test_check_row_formats():
    case = B.Case(1, 9, 5, 2, 1, 16, True, "fp16")
    ok = cli.CheckResult(case, 1e-4, 1e-3, 1e-6, 0.01, 8, 0.5)
    assert ok.passed and "PASS" in cli.check_row(0, ok) and "masked" in cli.check_row(0, ok)
    err = cli.CheckResult(case, error="RuntimeError: boom")
    assert not err.passed and "FAIL" in cli.check_row(1, err) and "boom" in cli.check_row(1, err)
    assert "result" in cli.check_header()


@pytest.mark.gpu
def test_info_on_gpu():
    result = CliRunner().invoke(cli.main, ["info"])
    assert result.exit_code == 0, result.output
    assert "compute capability" in result.output and "kernel cache" in result.output


@pytest.mark.gpu
def test_check_quick_on_gpu():
    result = CliRunner().invoke(cli.main, ["check", "--quick"])
    assert result.exit_code == 0, result.output


def test_bench_sustain_is_checked():
    runner = CliRunner()
    assert "--sustain" in runner.invoke(cli.main, ["bench", "--help"]).output
    r = runner.invoke(cli.main, ["bench", "--sustain", "-1"])
    assert r.exit_code == 2 and "--sustain" in r.output
    r = runner.invoke(cli.main, ["bench", "--mode", "decode", "--sustain", "1"])
    assert r.exit_code == 2 and "--sustain" in r.output and "decode" in r.output


@no_gpu_only
def test_bench_sustain_parses_then_needs_gpu():
    r = CliRunner().invoke(cli.main, ["bench", "--sustain", "2", "--seqlens", "2k"])
    assert r.exit_code == cli.EXIT_NO_GPU
