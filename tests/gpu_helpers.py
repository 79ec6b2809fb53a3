"""Helpers shared by the GPU test modules (test_forward_gpu, test_backward_gpu, test_kvcache, ...): the calls they
make go through :func:`fa2cupy_module`, which passes the KernelOptions set by :func:`kernel_options` (debug
poisoning, the kernel under test).

Imports of CuPy, torch and ml_dtypes are deferred to first use, so collecting these modules on a machine without
a GPU (CI) imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect

import numpy as np
import pytest

from fa2cupy.testing import UNIT_ROUNDOFF  # noqa: F401 -- the u of the error bounds, for the GPU tests


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


#: The KernelOptions that calls made through fa2cupy_module() pass, innermost kernel_options() block last (None:
#: fa2cupy's defaults). Test modules that poison their outputs push debug_poison for the whole module.
_options_stack: list = [None]


def current_options():
    """The KernelOptions the helpers' calls pass now (fa2cupy's defaults outside every kernel_options block)."""
    from fa2cupy.options import KernelOptions

    return _options_stack[-1] or KernelOptions()


@contextlib.contextmanager
def kernel_options(**changes):
    """For the duration, calls made through :func:`fa2cupy_module` pass the current KernelOptions with these
    fields changed (say ``hopper_forward=False`` to run the mma.sync forward where the Hopper one would run): the
    options are part of the plan cache's key, so no plan made with other options is reused. Yields the options."""
    import dataclasses

    _options_stack.append(dataclasses.replace(current_options(), **changes))
    try:
        yield _options_stack[-1]
    finally:
        _options_stack.pop()


def options_for_test(monkeypatch, **changes):
    """:func:`kernel_options` for the rest of a test (or fixture): undone by ``monkeypatch`` at its end."""
    import dataclasses
    import sys

    monkeypatch.setattr(sys.modules[__name__], "_options_stack",
                        _options_stack + [dataclasses.replace(current_options(), **changes)])


def debug_poison(value: bool = True):
    """``kernel_options(debug_poison=value)``: every output and gradient filled with NaN before each launch, so an
    element a kernel fails to write shows up (such calls take the checked path; False for the fast path)."""
    return kernel_options(debug_poison=value)


class _WithOptions:
    """A module whose public functions that take ``kernel_options`` pass the helpers' current options when the
    call gives none; other attributes as they are."""

    def __init__(self, module):
        self._module = module
        # name -> (the module's function, its wrapper): later look-ups skip the signature inspection (timing tests
        # call through here, and their cached calls must cost what a caller's do); a function patched since is
        # wrapped anew.
        self._calls = {}

    def __getattr__(self, name):
        value = getattr(self._module, name)
        known = self._calls.get(name)
        if known is not None and known[0] is value:
            return known[1]
        if name.startswith("_") or not callable(value) or isinstance(value, type):
            return value
        try:
            takes_options = "kernel_options" in inspect.signature(value).parameters
        except (TypeError, ValueError):
            takes_options = False
        if not takes_options:
            return value

        @functools.wraps(value)
        def call(*args, **kwargs):
            kwargs.setdefault("kernel_options", _options_stack[-1])
            return value(*args, **kwargs)

        self._calls[name] = (value, call)
        return call


@contextlib.contextmanager
def _recorded_plans(module, name: str):
    plans, real = [], getattr(module, name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, name, lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
        yield plans


def recorded_forward_plans():
    """The forward plans made inside, in a list (poisoned calls are planned every time)."""
    from fa2cupy import forward

    return _recorded_plans(forward, "plan_forward")


def recorded_backward_plans():
    """The backward plans made inside, in a list (poisoned calls are planned every time)."""
    from fa2cupy import backward

    return _recorded_plans(backward, "plan_backward")


def skip_unless_hopper(kernel: str) -> None:
    """Skips the test unless the GPU is compute capability 9.0, the only one the sm_90a kernels run on."""
    if int(cupy_module().cuda.Device().compute_capability) != 90:
        pytest.skip(f"the Hopper {kernel} runs on compute capability 9.0 only")


@contextlib.contextmanager
def checked_calls():
    """Yields a list that collects, for the duration, the kind name ("fwd", "bwd", "kvcache", ...) of every call
    that takes the pipeline's checked path (validation and a plan look-up that missed); a repeated call that takes
    the cached fast path adds nothing."""
    from fa2cupy import pipeline

    names, checked = [], pipeline._checked

    def counting(kind, *args):
        names.append(kind.name)
        return checked(kind, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "_checked", counting)
        yield names


def fa2cupy_module(wrapper: str | None = None):
    """fa2cupy (or with ``wrapper`` "torch" / "jax", fa2cupy.torch / fa2cupy.jax), imported on first use (it imports
    CuPy), whose public functions pass the current :func:`kernel_options` unless a call gives its own."""
    found = _wrapped.get(wrapper)
    if found is None:
        module = importlib.import_module("fa2cupy" if wrapper is None else f"fa2cupy.{wrapper}")
        found = _wrapped[wrapper] = _WithOptions(module)
    return found


_wrapped: dict = {}  # fa2cupy_module's wrappers by module, each keeping the functions it has wrapped


def cu_seqlens(lengths) -> np.ndarray:
    """int32 cumulative sequence lengths (batch + 1,) of the varlen functions."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.fixture(autouse=True, scope="module")
def poison_forward_and_backward():
    """Import it into a test module to poison every output and gradient of the calls made through fa2cupy_module()
    with NaN for the whole module (module scope: Hypothesis rejects function-scoped fixtures around @given)."""
    with debug_poison():
        yield
