"""Array interchange: describe caller arrays, view them as CuPy, hand results back.

fa2cupy accepts arrays from CuPy, PyTorch, JAX and NumPy. Everything that crosses
the boundary goes through the DLPack protocol (``__dlpack__`` /
``__dlpack_device__``), so no framework is imported by this module: a framework
can only be in play if the caller already imported it, and we find it in
``sys.modules``.

Stream ordering (why the results are correct without host synchronisation)
---------------------------------------------------------------------------
CuPy 14's ``cupy.from_dlpack(x)`` switches to ``x``'s device and passes CuPy's
*current stream on that device* to ``x.__dlpack__(stream=...)``; its docstring
promises the result "can be safely accessed on CuPy's current stream". The DLPack
spec puts the burden on the producer:

* PyTorch records an event on its current stream and makes the given stream wait
  on it when the two differ. We launch on torch's current stream
  (:func:`caller_stream`), so there is nothing to order and :func:`to_cupy` skips
  DLPack for torch (a direct view of ``data_ptr()``: 3 us instead of 18 us).
* JAX makes the given stream wait until the XLA computation that defines the
  buffer is finished (or blocks the host until it is ready).

In the other direction ``torch.from_dlpack(arr)`` / ``jax.dlpack.from_dlpack(arr)``
call CuPy's ``ndarray.__dlpack__(stream=<consumer stream>)``, and CuPy makes the
consumer's stream wait on CuPy's *current* stream. So the one rule the caller of
this module must follow is: make the launch stream CuPy's current stream
(``with cupy.cuda.Device(dev), stream:``) around :func:`to_cupy`, the kernel
launches and :func:`from_cupy`. Then every hand-over is ordered on the GPU and the
host never waits.

Hot path: :func:`describe`, :func:`to_cupy`, :func:`caller_stream`,
:func:`new_empty` and :func:`from_cupy` run on every call, so they do no imports
beyond ``sys.modules`` look-ups and cache what they can.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass

from .build import memset_async

# DLPack device types (dlpack.h, DLDeviceType).
_KDL_CPU = 1
_KDL_CUDA = 2
_KDL_CUDA_MANAGED = 13
_KDL_NAMES = {
    1: "CPU",
    2: "CUDA",
    3: "CUDA pinned host",
    4: "OpenCL",
    7: "Vulkan",
    8: "Metal",
    9: "VPI",
    10: "ROCm",
    11: "ROCm pinned host",
    12: "ext_dev",
    13: "CUDA managed",
    14: "oneAPI",
    15: "WebGPU",
    16: "Hexagon",
    17: "MAIA",
}

FRAMEWORKS = ("cupy", "torch", "jax", "numpy")

# Human names used in error messages.
_KIND = {
    "cupy": "CuPy array",
    "torch": "PyTorch tensor",
    "jax": "JAX array",
    "numpy": "NumPy array",
}

_ACCEPTED = "CuPy, PyTorch, JAX or NumPy"


@dataclass(frozen=True)
class ArrayInfo:
    """Metadata of one caller array; building it never touches a GPU.

    Attributes:
        name: the argument name ("q", "k", ...), used in every error message.
        framework: "cupy", "torch", "jax" or "numpy".
        shape: tuple of axis lengths.
        dtype: canonical dtype name: "float16", "bfloat16", "float32", "int32", ...
        strides: per-axis strides in ELEMENTS (not bytes). JAX arrays are always
            C-contiguous, so theirs are computed from the shape.
        device: ("cuda", ordinal) or ("cpu", 0).
    """

    name: str
    framework: str
    shape: tuple
    dtype: str
    strides: tuple
    device: tuple

    @property
    def device_str(self) -> str:
        """"cuda:N" or "cpu", as used in messages."""
        kind, index = self.device
        return f"cuda:{index}" if kind == "cuda" else "cpu"


_framework_by_type: dict = {}


def _framework_of(x) -> str | None:
    # Cached per type: describe() runs three times per call.
    t = type(x)
    try:
        return _framework_by_type[t]
    except KeyError:
        pass
    fw = _framework_of_type(t)
    _framework_by_type[t] = fw
    return fw


def _framework_of_type(t) -> str | None:
    # The type's module is enough for the real classes (torch.Tensor lives in
    # "torch", jax's ArrayImpl in "jaxlib..." or "jax...", cupy.ndarray in
    # "cupy._core.core"); walking the MRO also covers user subclasses of them.
    for cls in t.__mro__:
        root = (cls.__module__ or "").partition(".")[0]
        if root == "torch":
            return "torch"
        if root in ("jax", "jaxlib"):
            return "jax"
        if root == "cupy":
            return "cupy"
        if root == "numpy":
            return "numpy"
    return None


def _c_strides(shape) -> tuple:
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def _device_of(x, name: str, type_name: str) -> tuple:
    try:
        dev_type, dev_id = x.__dlpack_device__()
    except Exception as exc:  # e.g. a JAX array sharded over several devices
        raise TypeError(
            f"{name} ({type_name}) could not report its device through "
            f"__dlpack_device__: {exc}; pass an array that lives on one CUDA device"
        ) from exc
    dev_type = int(dev_type)
    if dev_type in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        return ("cuda", int(dev_id))
    if dev_type == _KDL_CPU:
        return ("cpu", 0)
    where = _KDL_NAMES.get(dev_type, f"DLPack device type {dev_type}")
    raise TypeError(
        f"{name} is on a {where} device; fa2cupy works on CUDA device arrays "
        f"(CuPy, PyTorch, JAX) or host NumPy arrays (copied to the current CUDA device)"
    )


_torch_dtype_names: dict = {}


def _torch_dtype_name(dtype) -> str:
    name = _torch_dtype_names.get(dtype)
    if name is None:
        # str(torch.bfloat16) == "torch.bfloat16"; torch.half prints as float16.
        name = _torch_dtype_names[dtype] = str(dtype).rpartition(".")[2]
    return name


def describe(x, name: str) -> ArrayInfo:
    """Describe a caller array without copying it or touching a GPU.

    Args:
        x: a CuPy array, PyTorch tensor, JAX array or NumPy array.
        name: the argument name used in error messages ("q", "k", "v", ...).

    Returns:
        ArrayInfo with shape, canonical dtype name, element strides and device.

    Raises:
        TypeError: ``x`` is not an array with ``__dlpack__`` (list, None, scalar,
            a JAX tracer), comes from another array library, or lives on a
            device that is neither CUDA nor the host.
        ValueError: a NumPy/CuPy stride is not a whole number of elements.
    """
    tname = type(x).__name__
    framework = _framework_of(x)
    if not hasattr(x, "__dlpack__"):
        hint = ""
        if framework == "jax":
            # Tracers have no buffer: the call happened under jit/grad/vmap.
            hint = " (fa2cupy cannot be called on traced values inside jax.jit, grad or vmap)"
        raise TypeError(
            f"{name} must be an array with __dlpack__ ({_ACCEPTED}), got {tname}{hint}"
        )
    if framework is None:
        mod = type(x).__module__
        raise TypeError(
            f"{name} is a {mod}.{tname}; fa2cupy accepts {_ACCEPTED} arrays "
            f"(convert it with e.g. cupy.from_dlpack({name}))"
        )

    if framework == "torch":
        # Fast path for real CUDA tensors (dispatch budget: a few microseconds
        # here): is_cuda/get_device are ~0.1 us, __dlpack_device__ ~1.2 us.
        # torch.Size and stride() are already tuples of ints.
        if getattr(x, "is_cuda", False):
            device = ("cuda", x.get_device())
        else:
            device = _device_of(x, name, tname)
        dtype = _torch_dtype_name(x.dtype)
        return ArrayInfo(name, framework, tuple(x.shape), dtype, tuple(x.stride()), device)

    device = _device_of(x, name, tname)
    shape = tuple(int(n) for n in x.shape)
    if framework == "jax":
        dtype = x.dtype.name  # numpy dtype; bfloat16 comes from ml_dtypes
        strides = _c_strides(shape)
    else:  # numpy, cupy: byte strides
        dtype = x.dtype.name
        itemsize = x.dtype.itemsize
        byte_strides = tuple(int(s) for s in x.strides)
        if any(s % itemsize for s in byte_strides):
            raise ValueError(
                f"{name} has byte strides {byte_strides} that are not multiples of its "
                f"{itemsize}-byte {dtype} elements; pass a copy (e.g. {name}.copy())"
            )
        strides = tuple(s // itemsize for s in byte_strides)

    return ArrayInfo(name, framework, shape, dtype, strides, device)


def _move_hint(info: ArrayInfo) -> str:
    return {
        "torch": f"{info.name}.cuda()",
        "jax": f"jax.device_put({info.name}, jax.devices('gpu')[0])",
        "numpy": f"cupy.asarray({info.name})",
        "cupy": f"{info.name}",
    }[info.framework]


def same_framework(infos) -> str:
    """Check that all arrays come from one framework and live on one device.

    Args:
        infos: list of ArrayInfo (at least one), the first is the reference.

    Returns:
        the shared framework name.

    Raises:
        ValueError: frameworks differ (host NumPy mixed with device arrays gets
            its own message), devices differ, or a PyTorch/JAX array is on the
            CPU (only NumPy host arrays are copied to the GPU for the caller).
    """
    first = infos[0]
    for info in infos:
        if info.device[0] == "cpu" and info.framework != "numpy":
            raise ValueError(
                f"{info.name} is a {_KIND[info.framework]} on the CPU; fa2cupy runs on a "
                f"CUDA GPU: move it there first ({_move_hint(info)})"
            )
    for info in infos[1:]:
        if info.framework != first.framework:
            host = [i for i in (info, first) if i.framework == "numpy"]
            if host:
                h = host[0]
                d = first if h is info else info
                raise ValueError(
                    f"{h.name} is a host NumPy array but {d.name} is a "
                    f"{_KIND[d.framework]} on {d.device_str}; pass all arrays on the "
                    f"same device (NumPy inputs are only accepted when all are NumPy)"
                )
            raise ValueError(
                f"{info.name} is a {_KIND[info.framework]} but {first.name} is a "
                f"{_KIND[first.framework]}; all arrays must come from one framework"
            )
        if info.device != first.device:
            raise ValueError(
                f"{info.name} is on {info.device_str} but {first.name} is on "
                f"{first.device_str}; all arrays must be on one device"
            )
    return first.framework


# --------------------------------------------------------------------------- cupy side

_cupy_mod = None


def _cupy():
    # One real import, on first use; after that a global read.
    global _cupy_mod
    if _cupy_mod is None:
        import cupy

        _cupy_mod = cupy
    return _cupy_mod


_bf16 = None


def _bf16_numpy_dtype():
    # CuPy 14 represents bfloat16 with ml_dtypes' NumPy dtype and refuses bfloat16
    # DLPack imports without it ("Please install ml_dtypes"); say so up front.
    global _bf16
    if _bf16 is None:
        try:
            import ml_dtypes
        except ImportError as exc:
            raise ImportError(
                "bfloat16 arrays need the ml_dtypes package (pip install ml_dtypes); "
                "CuPy uses it to represent bfloat16"
            ) from exc
        _bf16 = ml_dtypes.bfloat16
    return _bf16


def bf16_bits(xp, x):
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even, NaN kept (as 0x7FC0); ``xp`` is numpy or
    cupy (the bits are exact where the array libraries have no bfloat16 arithmetic)."""
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    u = x.view(xp.uint32).astype(xp.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(xp.uint16)
    return xp.where(xp.isnan(x), xp.uint16(0x7FC0), rounded)


def bf16_bits_to_float(xp, bits):
    """bfloat16 bit patterns (uint16) -> float32 values, exactly; ``xp`` is numpy or cupy."""
    return (xp.asarray(bits, dtype=xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


def to_cupy(x, info: ArrayInfo):
    """View a caller array as a ``cupy.ndarray``.

    * CuPy: returned as is.
    * PyTorch (CUDA): a zero-copy view built straight from ``data_ptr()`` and the
      strides (about 3 us; ``cupy.from_dlpack`` costs about 18 us). This skips the
      DLPack stream hand-shake, which is sound because fa2cupy launches on torch's
      own current stream (:func:`caller_stream`), the stream torch orders the
      tensor's producers on; the view keeps the tensor alive.
    * JAX: ``cupy.from_dlpack``; call it with the launch stream current in CuPy
      (see the module docstring) so JAX orders its pending writes before it.
    * NumPy: copied to the current CUDA device as a C-contiguous array, so read
      strides from the returned array, not from ``info``.

    Args:
        x: the array that ``info`` describes.
        info: from :func:`describe`.

    Returns:
        cupy.ndarray sharing memory with ``x`` (device arrays) or a device copy
        (NumPy).

    Raises:
        TypeError: a PyTorch tensor requires grad while autograd is recording
            (the plain functions do not record autograd; fa2cupy.torch does).
        ImportError: bfloat16 data without ml_dtypes installed.
    """
    fw = info.framework
    if fw == "cupy":
        return x
    if fw == "torch":
        if x.requires_grad and sys.modules["torch"].is_grad_enabled():
            raise TypeError(
                f"{info.name} requires grad, but fa2cupy.flash_attn_func / flash_attn_backward do not record "
                f"autograd: use fa2cupy.torch.flash_attn_func for gradients, or call under torch.no_grad() / "
                f"pass {info.name}.detach()"
            )
        return _view_device_memory(
            x.data_ptr(), x, info.shape, info.strides, info.dtype, info.device[1]
        )
    cp = _cupy()
    if info.dtype == "bfloat16":
        _bf16_numpy_dtype()  # a clear error instead of CuPy's if ml_dtypes is missing
    if fw == "numpy":
        return cp.asarray(sys.modules["numpy"].ascontiguousarray(x))
    return cp.from_dlpack(x)


def _view_device_memory(ptr: int, owner, shape: tuple, strides: tuple, dtype: str, device: int):
    """A cupy.ndarray of ``shape`` with element ``strides`` at device pointer ``ptr``.

    ``owner`` is kept alive by the view. Strides are non-negative here (torch has
    no negative strides).
    """
    cp = _cupy()
    dtype = _cupy_dtype(dtype)
    item = dtype.itemsize
    if 0 in shape:
        span = 0
    else:
        span = 1
        for n, st in zip(shape, strides):
            span += (n - 1) * st
    # device_id given, so CuPy does not query the pointer's attributes.
    mem = cp.cuda.UnownedMemory(ptr, span * item, owner, device)
    return cp.ndarray(
        shape, dtype, cp.cuda.MemoryPointer(mem, 0), tuple(st * item for st in strides)
    )


def from_cupy(arr, framework: str):
    """Hand a CuPy result back in the caller's framework.

    Call it with the launch stream still current in CuPy, so the consumer's
    stream is made to wait on our kernels (CuPy's ``__dlpack__`` does that).

    Args:
        arr: cupy.ndarray produced by fa2cupy.
        framework: "cupy", "torch", "jax" or "numpy" (from :func:`same_framework`).

    Returns:
        ``arr`` itself (cupy), a zero-copy torch.Tensor / jax.Array, or a NumPy
        copy (bfloat16 comes back with ml_dtypes' bfloat16 dtype). The NumPy copy
        waits for the current stream.

    Raises:
        ValueError: unknown framework.
    """
    if framework == "cupy":
        return arr
    if framework == "torch":
        return sys.modules["torch"].from_dlpack(arr)
    if framework == "jax":
        jax_dlpack = sys.modules.get("jax.dlpack")
        if jax_dlpack is None:
            import jax.dlpack as jax_dlpack  # the caller has jax; the submodule may be unloaded
        try:
            return jax_dlpack.from_dlpack(arr)
        except TypeError:
            # Older JAX wants a capsule rather than an object with __dlpack__.
            return jax_dlpack.from_dlpack(arr.toDlpack())
    if framework == "numpy":
        return _cupy().asnumpy(arr)
    raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")


def make_result(native, cupy_arr, framework: str):
    """Return an output allocated by :func:`new_empty` in the caller's framework.

    ``native`` is the torch tensor that owns the memory (returned as is, so the
    caller gets the very tensor its allocator made) or None, in which case the
    CuPy array is converted with :func:`from_cupy`.
    """
    if native is not None:
        return native
    return from_cupy(cupy_arr, framework)


_cupy_dtypes: dict = {}


def _cupy_dtype(dtype: str):
    """numpy.dtype for a canonical name (bfloat16 through ml_dtypes), cached."""
    d = _cupy_dtypes.get(dtype)
    if d is None:
        np = sys.modules.get("numpy") or __import__("numpy")
        d = np.dtype(_bf16_numpy_dtype()) if dtype == "bfloat16" else np.dtype(dtype)
        _cupy_dtypes[dtype] = d
    return d


_torch_alloc_args: dict = {}


def _torch_args(dtype: str, device: int):
    # (torch.dtype, torch.device) cached: torch.empty with a device object is about
    # 3 us, with a "cuda:N" string about 6 us.
    key = (dtype, device)
    args = _torch_alloc_args.get(key)
    if args is None:
        torch = sys.modules["torch"]
        args = _torch_alloc_args[key] = (getattr(torch, dtype), torch.device("cuda", device))
    return args


def new_empty(shape, dtype: str, framework: str, device: int):
    """Allocate an output or workspace array in the caller's allocator.

    PyTorch callers get memory from torch's caching allocator on torch's current
    stream (it shows in torch's memory accounting and works under
    ``torch.cuda.graph`` capture); everyone else gets CuPy's memory pool on
    ``device``.

    Args:
        shape: tuple of ints.
        dtype: canonical dtype name ("float16", "bfloat16", "float32", ...).
        framework: the caller's framework.
        device: CUDA ordinal.

    Returns:
        (native, cupy_array): native is the torch.Tensor (or None), cupy_array a
        zero-copy CuPy view of the same memory, C-contiguous. Pass both to
        :func:`make_result`.
    """
    if framework == "torch":
        tdtype, tdevice = _torch_args(dtype, device)
        t = sys.modules["torch"].empty(shape, dtype=tdtype, device=tdevice)
        shape = tuple(shape)
        return t, _view_device_memory(t.data_ptr(), t, shape, _c_strides(shape), dtype, device)
    cp = _cupy()
    with cp.cuda.Device(device):
        return None, cp.empty(shape, dtype=_cupy_dtype(dtype))


# ExternalStream wrappers by (pointer, device): building one costs a few
# microseconds and the per-call budget is tens of microseconds. A stream handle
# is only a number to CuPy (ExternalStream never destroys it), so a stale entry
# whose pointer got reused by a new torch stream is still a correct wrapper.
_external_streams: dict = {}


def _external_stream(ptr: int, device: int):
    key = (ptr, device)
    s = _external_streams.get(key)
    if s is None:
        cp = _cupy()
        if len(_external_streams) > 256:
            _external_streams.clear()
        with warnings.catch_warnings():
            # CuPy 14 deprecates ExternalStream in favour of Stream.from_external,
            # which needs a __cuda_stream__ object and cannot take the device id.
            warnings.simplefilter("ignore", DeprecationWarning)
            s = cp.cuda.ExternalStream(ptr, device)
        _external_streams[key] = s
    return s


def caller_stream(framework: str, device: int):
    """The stream fa2cupy's kernels must launch on for this caller.

    * torch: torch's current stream on ``device`` (so ``with torch.cuda.stream(s)``
      and CUDA-graph capture work), wrapped as a cached ``cupy.cuda.ExternalStream``.
    * cupy: CuPy's current stream on ``device``.
    * jax, numpy: CuPy's current stream on ``device`` too. JAX inputs are ordered
      before it by JAX's ``__dlpack__(stream=...)`` and the jax.Array we return is
      ordered after it by CuPy's ``__dlpack__`` (see the module docstring); NumPy
      inputs are copied and the result copied back on this stream.

    Make the returned stream current (``with stream:``) around to_cupy, the
    launches and from_cupy.
    """
    if framework == "torch":
        torch = sys.modules["torch"]
        return _external_stream(torch.cuda.current_stream(device).cuda_stream, device)
    return _cupy().cuda.get_current_stream(device)


def caller_stream_ptr(framework: str, device: int) -> int:
    """The raw handle of :func:`caller_stream`'s stream, without building stream objects (fast path)."""
    if framework == "torch":
        return (_torch_raw_stream or _torch_stream_getter())(device)
    return _cupy().cuda.get_current_stream(device).ptr


_torch_raw_stream = None  # torch's current raw stream handle by device index


def _torch_stream_getter():
    global _torch_raw_stream
    if _torch_raw_stream is None:
        torch = sys.modules["torch"]
        # what torch's own kernels launch on
        _torch_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda index: torch.cuda.current_stream(index).cuda_stream)
    return _torch_raw_stream


def stream_ptr_getter(framework: str):
    """``get(device) -> int``: :func:`caller_stream_ptr` for one framework, resolved once (the fast path keeps it
    with a cached call)."""
    if framework == "torch":
        return _torch_raw_stream or _torch_stream_getter()
    cuda = _cupy().cuda
    return lambda device: cuda.get_current_stream(device).ptr


# --------------------------------------------------------------------------- cached-dispatch fast path

_cupy_ndarray = None
_torch_tensor = None


def fast_meta(x):
    """``(key, device pointer)`` for a CuPy array or a CUDA PyTorch tensor that needs no autograd, else None.

    ``key`` holds everything the argument checks read (type, shape, strides, dtype, device), so a call whose
    keys match an earlier validated call may skip straight to the launch; the pointer is all the launch needs.
    Costs about 1 us where ``describe`` + ``to_cupy`` cost ~10 us.
    """
    global _cupy_ndarray, _torch_tensor
    if _cupy_ndarray is None:
        _cupy_ndarray = _cupy().ndarray
    kind = type(x)
    if kind is _cupy_ndarray:
        data = x.data
        return (kind, x.shape, x.strides, x.dtype, data.device_id), data.ptr
    if _torch_tensor is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        _torch_tensor = torch.Tensor
    if kind is _torch_tensor and x.is_cuda and not x.requires_grad:
        return (kind, x.shape, x.stride(), x.dtype, x.get_device()), x.data_ptr()
    return None


def new_empty_raw(shape, dtype: str, framework: str, device: int):
    """Like :func:`new_empty` for the fast path and for scratch memory: ``(array, device pointer)``, a torch tensor
    for "torch" callers and a CuPy array for every other framework (CuPy's current allocator: JAX's callbacks set
    theirs), with ``device`` already current."""
    if framework == "torch":
        tdtype, tdevice = _torch_args(dtype, device)
        # (sizes as separate arguments: torch parses them ~1 us faster than a tuple)
        t = sys.modules["torch"].empty(*shape, dtype=tdtype, device=tdevice)
        return t, t.data_ptr()
    arr = _cupy().empty(shape, dtype=_cupy_dtype(dtype))
    return arr, arr.data.ptr


def new_zeroed_raw(count: int, dtype: str, framework: str, device: int, stream_ptr: int, zero_bytes=None):
    """:func:`new_empty_raw` of ``count`` elements (scratch memory of a launch: a tile counter, turn flags, split-KV
    arrivals) with its first ``zero_bytes`` (all of it by default) zeroed on the stream with handle ``stream_ptr``,
    so that CUDA-graph capture records the zeroing with the launch."""
    array, pointer = new_empty_raw((count,), dtype, framework, device)
    memset_async(pointer, 0, array.nbytes if zero_bytes is None else zero_bytes, stream_ptr)
    return array, pointer


def allocator(shape, dtype: str, framework: str, device: int):
    """``allocate() -> (array, device pointer)``: :func:`new_empty_raw` of one allocation with its dtype and the
    framework's allocator resolved once (for the fast path, which keeps it with a cached call)."""
    shape = tuple(shape)
    if framework == "torch":
        tdtype, tdevice = _torch_args(dtype, device)
        empty = sys.modules["torch"].empty

        def allocate():
            t = empty(*shape, dtype=tdtype, device=tdevice)
            return t, t.data_ptr()

        return allocate
    empty, cdtype = _cupy().empty, _cupy_dtype(dtype)

    def allocate():
        a = empty(shape, dtype=cdtype)
        return a, a.data.ptr

    return allocate
