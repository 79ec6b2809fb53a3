"""fa2cupy: FlashAttention-2 kernels compiled at run time by CuPy, callable on CuPy, PyTorch, JAX and NumPy arrays."""

__version__ = "0.1.0"

try:
    import cupy  # noqa: F401
except ImportError as error:  # one clear message instead of a traceback from deep inside
    raise ImportError(
        "fa2cupy needs CuPy. Install it with the extra for your CUDA version: "
        "pip install 'fa2cupy[cuda12]' (CUDA 12.x) or pip install 'fa2cupy[cuda13]' (CUDA 13.x)"
    ) from error

from .device_errors import check_device_errors
from .options import KernelOptions
from .interface import (
    dropout_mask,
    flash_attn_backward,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_backward,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    merge_attention_states,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_backward",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_backward",
    "flash_attn_with_kvcache",
    "merge_attention_states",
    "dropout_mask",
    "check_device_errors",
    "KernelOptions",
    "__version__",
]
