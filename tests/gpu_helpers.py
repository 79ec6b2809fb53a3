"""Helpers shared by the GPU test modules (test_forward_gpu, test_backward_gpu, test_kvcache).

Imports of CuPy, torch and ml_dtypes are deferred to first use, so collecting these modules on a machine without
a GPU (CI) imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import importlib

import numpy as np
import pytest

#: Unit roundoff of the 16-bit types, the u of the error bounds.
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def cupy_module():
    import cupy

    return cupy


def np_dtype(dtype: str):
    """The NumPy dtype of "float16" / "bfloat16" (ml_dtypes for bfloat16)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.float16


def torch_cuda():
    """torch, or skip the test when it is missing or has no CUDA."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA")
    return torch


@contextlib.contextmanager
def debug_poison(module: str, value: bool = True):
    """Sets ``fa2cupy.<module>._debug_poison`` (the hook that fills outputs with NaN before each launch, so an
    element a kernel fails to write shows up) for the duration; a missing hook fails (raising=True: it is part
    of the contract)."""
    patch = pytest.MonkeyPatch()
    patch.setattr(importlib.import_module(f"fa2cupy.{module}"), "_debug_poison", value, raising=True)
    try:
        yield
    finally:
        patch.undo()


def skip_unless_hopper(kernel: str) -> None:
    """Skips the test unless the GPU is compute capability 9.0, the only one the sm_90a kernels run on."""
    if int(cupy_module().cuda.Device().compute_capability) != 90:
        pytest.skip(f"the Hopper {kernel} runs on compute capability 9.0 only")


@contextlib.contextmanager
def planning_with(*patches):
    """Sets each (object, attribute, value) for the duration, so that plans choose kernels differently (A/B of two
    kernels for one call); the cached plans are dropped on both sides of the switch."""
    from fa2cupy import pipeline

    patch = pytest.MonkeyPatch()
    for obj, name, value in patches:
        patch.setattr(obj, name, value)
    pipeline._cached_calls.clear()
    try:
        yield
    finally:
        patch.undo()
        pipeline._cached_calls.clear()


def fa2cupy_module():
    """fa2cupy, imported on first use (it imports CuPy)."""
    import fa2cupy

    return fa2cupy


def cu_seqlens(lengths) -> np.ndarray:
    """int32 cumulative sequence lengths (batch + 1,) of the varlen functions."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.fixture(autouse=True, scope="module")
def poison_forward_and_backward():
    """Import it into a test module to poison every forward and backward output with NaN for the whole module
    (module scope: Hypothesis rejects function-scoped fixtures around @given)."""
    with debug_poison("forward"), debug_poison("backward"):
        yield
