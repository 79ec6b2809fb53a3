"""Shared pytest setup: the ``gpu`` marker, the Hypothesis profiles, and the installed package names when the tests
run from a source checkout (``PYTHONPATH=. pytest``: see source_tree.py).

Tests marked ``gpu`` are skipped, with the reason printed, on machines without a
usable CUDA device (CI has none); everything else must pass on a bare CPU box.

Hypothesis profiles, picked by ``FA2CUPY_HYPOTHESIS_PROFILE``:
  ci      (default) few examples, no deadline: keeps the CPU suite quick.
  device  200 examples for the property tests on a GPU machine.
"""

from __future__ import annotations

import functools
import os

import pytest
from hypothesis import HealthCheck, settings

from source_tree import map_installed_packages

map_installed_packages()  # fa2cupy_bench from bench/ when the project is run from a source checkout

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,  # first calls compile kernels; timing is not what we test
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "device",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("FA2CUPY_HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    """None when a CUDA device is usable through CuPy, else why not, in plain words."""
    from fa2cupy.testing import gpu_unavailable_reason as reason

    why = reason()
    return None if why is None else f"needs a CUDA GPU: {why}"


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)
