"""The package's import surface: ``import fa2cupy`` needs no CuPy, its public names load on first use."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import fa2cupy
from source_tree import ROOT, python_without_cupy


def test_import_without_cupy_then_one_clear_error():
    code = """
import fa2cupy
print(fa2cupy.__version__)
for name in ("flash_attn_func", "check_device_errors"):
    try:
        getattr(fa2cupy, name)
    except ImportError as error:
        assert error.__cause__ is None and error.__suppress_context__, "one error, no chained traceback"
        print(error)
try:
    from fa2cupy import flash_attn_varlen_func
except ImportError as error:
    print(error)
"""
    res = python_without_cupy(code)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == fa2cupy.__version__
    assert len(lines) == 4, res.stdout
    for line, name in zip(lines[1:], ("flash_attn_func", "check_device_errors", "flash_attn_varlen_func")):
        assert line.startswith(f"fa2cupy.{name} needs CuPy, which is not installed")
        assert "pip install 'fa2cupy[cuda12]'" in line and "pip install 'fa2cupy[cuda13]'" in line


def test_import_does_not_import_cupy():
    code = "import sys, fa2cupy; print('cupy' in sys.modules, 'fa2cupy.attention' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["False", "False"]


def test_public_names_resolve_to_their_modules():
    pytest.importorskip("cupy")
    assert set(fa2cupy.__all__) == {*fa2cupy._PUBLIC, "__version__"}
    for name, module in fa2cupy._PUBLIC.items():
        assert getattr(fa2cupy, name) is getattr(importlib.import_module(f"fa2cupy.{module}"), name)
        assert name in dir(fa2cupy)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'flash_attn_nothing'"):
        fa2cupy.flash_attn_nothing  # noqa: B018
    assert not hasattr(fa2cupy, "flash_attn_nothing")


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_each_cuda_extra_brings_one_cupy_and_its_nvrtc():
    # Set-up is one CUDA extra; the test command adds [test]. Only the CUDA extras may name CuPy, so installing
    # another extra after either never brings a second CuPy (CuPy warns on every import when two are installed).
    extras = _pyproject()["project"]["optional-dependencies"]
    assert extras["cuda12"] == ["cupy-cuda12x>=14", "nvidia-cuda-nvrtc-cu12"]
    assert extras["cuda13"] == ["cupy-cuda13x>=14", "nvidia-cuda-nvrtc==13.*"]
    for name, requirements in extras.items():
        if name not in ("cuda12", "cuda13"):
            assert not any(r.lower().startswith(("cupy", "nvidia")) for r in requirements), (name, requirements)
    assert "cupy" not in " ".join(_pyproject()["project"]["dependencies"]).lower()


def test_ci_installs_the_extras_and_runs_the_test_command():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "python -m pip install -q -e '.[cuda12,test]'" in lines
    assert lines[-1] == "python -m pytest -q"


def test_the_harness_is_installed_and_bench_dev_is_not():
    setuptools = _pyproject()["tool"]["setuptools"]
    assert setuptools["package-dir"]["fa2cupy_bench"] == "bench"
    assert "fa2cupy_bench" in setuptools["packages"]
    assert not any(p.startswith("fa2cupy_bench.") for p in setuptools["packages"])   # bench/dev/ stays out
    assert not (ROOT / "bench" / "dev" / "__init__.py").exists()
