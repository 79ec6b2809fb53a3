"""Running the project from a source checkout in tests: Python subprocesses without CuPy.

``python_without_cupy`` runs code in a fresh interpreter in which ``cupy``, ``cupyx`` and ``cupy_backends`` cannot be
imported (as on a machine where fa2cupy was installed without a CUDA extra), with the repository on ``sys.path``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Prepended to the code: a meta-path finder that answers every import of CuPy's packages as "not installed".
_NO_CUPY = f"""
import sys
class _NoCupy:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("cupy", "cupyx", "cupy_backends"):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _NoCupy())
sys.path.insert(0, {str(ROOT)!r})
"""


def python_without_cupy(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c code *args`` without CuPy, from the repository root; stdout and stderr captured as text."""
    return subprocess.run([sys.executable, "-c", _NO_CUPY + code, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
