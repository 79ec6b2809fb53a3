"""CPU tests of the ``fa2cupy`` command (cli.py): no-GPU exits, option parsing, check bookkeeping."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # cli.py lives in the repo root

import cli  # noqa: E402
from fa2cupy import benchmark as B  # noqa: E402

HAS_GPU = cli.probe_gpu()[0]
no_gpu_only = pytest.mark.skipif(HAS_GPU, reason="a GPU is present: the no-GPU path is not taken")


def _lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


@no_gpu_only
@pytest.mark.parametrize("command", ["check", "bench", "info"])
def test_no_gpu_one_line_exit(command):
    result = CliRunner().invoke(cli.main, [command])
    assert result.exit_code == cli.EXIT_NO_GPU != 0
    lines = _lines(result)
    assert len(lines) == 1, result.output
    assert "fa2cupy[cuda12]" in lines[0] or "no CUDA GPU" in lines[0] or "no usable CUDA GPU" in lines[0]


@pytest.mark.parametrize("command", ["check", "bench", "info"])
def test_no_cupy_names_extras(command, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)       # makes `import cupy` raise ImportError
    result = CliRunner().invoke(cli.main, [command])
    assert result.exit_code == cli.EXIT_NO_GPU
    lines = _lines(result)
    assert len(lines) == 1, result.output
    assert "fa2cupy[cuda12]" in lines[0] and "fa2cupy[cuda13]" in lines[0]


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
    r = runner.invoke(cli.main, ["bench", "--mode", "bwd"])
    assert r.exit_code == 2 and "bwd" in r.output
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


def test_bounds():
    assert cli._bound("bf16", 0.5) == 2 ** -7
    assert cli._bound("fp16", 4.0) == 4 * 2 ** -10
    np.testing.assert_allclose(cli._lse_bound(np.array([0.5, -20.0])), [1e-3, 2e-2])


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
