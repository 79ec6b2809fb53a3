"""fa2cupy: FlashAttention-2 kernels compiled at run time by CuPy, callable on CuPy, PyTorch, JAX and NumPy arrays.

The public functions are loaded on first use (PEP 562), so ``import fa2cupy`` needs no CuPy: the ``fa2cupy``
command, :mod:`fa2cupy.testing` and :mod:`fa2cupy.reference` work on a machine without it, and the first use of a
function that runs kernels raises one ImportError naming the install extras when CuPy is missing.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: Public name -> the submodule that defines it, imported when the name is first used.
_PUBLIC: dict[str, str] = {
    "flash_attn_func": "attention",
    "flash_attn_qkvpacked_func": "attention",
    "flash_attn_kvpacked_func": "attention",
    "flash_attn_backward": "attention",
    "flash_attn_varlen_func": "attention",
    "flash_attn_varlen_qkvpacked_func": "attention",
    "flash_attn_varlen_kvpacked_func": "attention",
    "flash_attn_varlen_backward": "attention",
    "flash_attn_with_kvcache": "kvcache",
    "merge_attention_states": "kvcache",
    "dropout_mask": "attention",
    "check_device_errors": "device_errors",
    "KernelOptions": "options",
}

#: Public names whose modules import no CuPy.
_NO_CUPY = {"KernelOptions"}

__all__ = [*_PUBLIC, "__version__"]

#: How to install CuPy, for the messages that say it is missing.
_INSTALL_HINT = ("pip install 'fa2cupy[cuda12]' (CUDA 12.x driver) or pip install 'fa2cupy[cuda13]' "
                "(CUDA 13.x driver)")


def _require_cupy(name: str) -> None:
    try:
        import cupy  # noqa: F401, PLC0415
    except ImportError as error:
        if error.name not in ("cupy", "cupy_backends"):
            raise ImportError(f"fa2cupy.{name} needs CuPy, which failed to import ({error}); reinstall it with "
                              f"{_INSTALL_HINT}") from error
        raise ImportError(f"fa2cupy.{name} needs CuPy, which is not installed; install it with {_INSTALL_HINT}") \
            from None


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _NO_CUPY:
        _require_cupy(name)
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
