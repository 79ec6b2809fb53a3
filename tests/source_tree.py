"""Running the project from a source checkout in tests: the installed package names, Python without CuPy.

``map_installed_packages`` makes ``fa2cupy_bench`` importable from ``bench/`` when the project is not installed
(``PYTHONPATH=. pytest``), as pyproject.toml's package-dir maps it in an install; conftest.py calls it.
``python_without_cupy`` runs code in a fresh interpreter in which ``cupy``, ``cupyx`` and ``cupy_backends`` cannot be
imported (as on a machine where fa2cupy was installed without a CUDA extra), with the repository on ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def map_installed_packages() -> None:
    """Import ``bench/`` as ``fa2cupy_bench`` unless an installed (or editable) ``fa2cupy_bench`` is found."""
    if "fa2cupy_bench" in sys.modules or importlib.util.find_spec("fa2cupy_bench") is not None:
        return
    folder = ROOT / "bench"
    spec = importlib.util.spec_from_file_location("fa2cupy_bench", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["fa2cupy_bench"] = module
    spec.loader.exec_module(module)


#: Prepended to the code: a meta-path finder that answers every import of CuPy's packages as "not installed".
_NO_CUPY = f"""
import sys
class _NoCupy:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("cupy", "cupyx", "cupy_backends"):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _NoCupy())
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
import source_tree
source_tree.map_installed_packages()
sys.path.remove({str(ROOT / "tests")!r})
"""


def python_without_cupy(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c code *args`` without CuPy, from the repository root; stdout and stderr captured as text."""
    return subprocess.run([sys.executable, "-c", _NO_CUPY + code, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
