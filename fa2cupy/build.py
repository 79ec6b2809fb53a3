"""Kernel sources -> compiled CuPy kernels (NVRTC through ``cupy.RawModule`` with ``name_expressions``).

Each (kernel family, template instantiation, device) is compiled once per process on first use; CuPy also keeps
the compiled binary in its on-disk cache (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``), keyed by the
source text and options. The local ``#include "..."`` files (paths relative to cuda/, e.g. ``sm90/wgmma.cuh``) are
inlined here before compiling so that the key covers every header: editing ``cuda/attention/softmax.cuh`` can
never load a stale binary.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import threading
from pathlib import Path

#: NVRTC options shared by the runtime build and the CPU compile test (which adds the -arch option itself).
NVRTC_OPTIONS = ("-std=c++17", "-default-device")

#: Kernel families built for one architecture's own instruction set (wgmma needs sm_90a, which no other GPU runs).
ARCH_SPECIFIC = {"fwd_hopper": "90a", "bwd_hopper": "90a"}

#: Each kernel family's source file in cuda/; its headers (common/, sm80/, sm90/, attention/, hopper/) are inlined.
FAMILY_SOURCES = {"fwd": "fwd.cu", "bwd": "bwd.cu", "decode": "decode.cu", "fwd_hopper": "hopper/fwd.cu",
                  "bwd_hopper": "hopper/bwd.cu"}

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


_source_dir: Path | None = None  # see use_sources


def kernel_dir() -> Path:
    """Where the .cu/.cuh sources are: installed beside the package, or in the source tree (or as use_sources
    says)."""
    if _source_dir is not None:
        return _source_dir
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda", here.parent / "cuda"):
        if (candidate / "common" / "types.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"fa2cupy kernel sources not found in {here / 'cuda'} or {here.parent / 'cuda'}")


@functools.lru_cache(maxsize=None)
def source(family: str) -> str:
    """The self-contained source of one kernel family (``"fwd_hopper"`` -> cuda/hopper/fwd.cu with its headers
    inlined, each once). An include names a path relative to cuda/ or to the including file's folder. (A copy of
    cuda/ from before the hopper/ folder, for A/B timings, holds every family as ``<family>.cu``.)"""
    root = kernel_dir()
    seen: set[Path] = set()

    def expand(path: Path) -> str:
        if path in seen:  # every header is #pragma once
            return ""
        seen.add(path)

        def include(match) -> str:
            for candidate in (root / match.group(1), path.parent / match.group(1)):
                if candidate.is_file():
                    return expand(candidate.resolve())
            raise FileNotFoundError(f'{path.relative_to(root)}: #include "{match.group(1)}" not found in {root}')

        return _INCLUDE.sub(include, path.read_text())

    main = root / FAMILY_SOURCES[family]
    if not main.is_file() and (root / f"{family}.cu").is_file():
        main = root / f"{family}.cu"
    return expand(main.resolve())


def cache_dir() -> str:
    """CuPy's on-disk kernel cache, where compiled fa2cupy kernels persist between processes."""
    return os.environ.get("CUPY_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache"))


_kernels: dict[tuple[str, str, int], object] = {}


def get_kernel(family: str, name_expression: str, smem_bytes: int):
    """The compiled kernel (a ``cupy.cuda.Function``) for one instantiation on the current device.

    The low-level Function, not the RawKernel, is kept: its call takes an explicit stream and skips
    RawKernel's per-call look-ups."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    key = (family, name_expression, device)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = _compile(family, name_expression, smem_bytes)[1]
    return kernel


def install_traced(family: str, name_expression: str, smem_bytes: int, defines=()):
    """Diagnostics (bench/*_trace.py): compile one instantiation with extra NVRTC options (``-DFA2_FWD_TRACE``,
    ...) and make it the kernel that this process's plans get on the current device; returns its
    ``cupy.RawModule``, whose globals hold what the traced build records."""
    import cupy

    module, kernel = _compile(family, name_expression, smem_bytes, tuple(defines))
    _kernels[(family, name_expression, cupy.cuda.runtime.getDevice())] = kernel
    return module


def _compile(family: str, name_expression: str, smem_bytes: int, extra_options: tuple = ()):
    """(RawModule, cupy.cuda.Function) of one instantiation for the current device."""
    import cupy

    options = NVRTC_OPTIONS + ((f"-arch=sm_{ARCH_SPECIFIC[family]}",) if family in ARCH_SPECIFIC else ())
    module = cupy.RawModule(code=source(family), options=options + extra_options, name_expressions=(name_expression,))
    raw = module.get_function(name_expression)
    if smem_bytes > 48 * 1024:  # beyond the default dynamic shared-memory limit: opt in per kernel
        raw.max_dynamic_shared_size_bytes = smem_bytes
    return module, raw.kernel


def device_attribute(device: int, name: str) -> int:
    """A CUDA device attribute by CuPy's name (``MultiProcessorCount``, ...), looked up once per device."""
    key = (device, name)
    value = _attributes.get(key)
    if value is None:
        import cupy

        value = _attributes[key] = cupy.cuda.Device(device).attributes[name]
    return value


_attributes: dict[tuple[int, str], int] = {}


def sm_count(override: int | None = None, device: int | None = None) -> int:
    """The SMs that grids are sized for: ``override`` (KernelOptions.sm_count) where given, else the count of
    ``device`` (None: the current one)."""
    if override:
        return override
    if device is None:
        import cupy

        device = cupy.cuda.runtime.getDevice()
    return device_attribute(device, "MultiProcessorCount")


def clear_memory_cache() -> None:
    """Forget compiled kernels in this process (the on-disk cache stays); used to time cold compiles."""
    _kernels.clear()
    source.cache_clear()


def use_sources(directory) -> None:
    """Build this process's kernels from another copy of cuda/ (``None``: the package's own), for A/B timings of
    kernel versions (bench/); the kernels compiled so far are forgotten, and so must be plans that hold them."""
    global _source_dir
    _source_dir = None if directory is None else Path(directory).resolve()
    clear_memory_cache()


def compile_for_arch(family: str, name_expressions, arch: str, log: bool = False, ptx_only: bool = False,
                     front_end_only: bool = False, options: tuple = ()):
    """Compile with NVRTC for an explicit arch (e.g. "80", "90a") without needing a GPU.

    Returns (cubin bytes, NVRTC log, {name expression: mangled name}); with ``log=True`` the log holds ptxas's
    per-kernel register/spill report. ``ptx_only`` stops at PTX for the virtual arch (compute_XX; no ptxas, about
    half the time) and returns the PTX in place of the cubin; ``front_end_only`` stops after the C++ front end
    (every template instantiated and checked for the arch's preprocessor branch, no code generated: a few
    milliseconds) and returns no binary. ``options`` are more NVRTC options (``-DFA2_FWD_TRACE``, ...). Used by the
    CPU compile test; raises RuntimeError with NVRTC's log on failure.
    """
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source(family), f"{family}.cu", (), ())
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        virtual = ptx_only or front_end_only
        target = f"-arch=compute_{arch}" if virtual else f"-arch=sm_{arch}"
        options = NVRTC_OPTIONS + (target,) + tuple(options) + (("-Xptxas=-v",) if log and not virtual else ()) + (
            ("-fdevice-syntax-only",) if front_end_only else ())
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as error:
            raise RuntimeError(f"NVRTC failed for sm_{arch}:\n{nvrtc.getProgramLog(prog)}") from error
        lowered = {expr: nvrtc.getLoweredName(prog, expr) for expr in name_expressions}
        binary = b"" if front_end_only else nvrtc.getPTX(prog) if ptx_only else nvrtc.getCUBIN(prog)
        return binary, nvrtc.getProgramLog(prog), lowered
    finally:
        nvrtc.destroyProgram(prog)


class Launch:
    """One kernel launch with its parameter struct (fa2cupy/params.py, cuda/common/params.cuh) built once in a
    buffer of its own: cuLaunchKernel copies the struct from there, so a call writes only the fields that change
    and launches. About 3 us of host time, where a ``cupy.cuda.Function`` call, which converts each of its ~35
    arguments anew, costs ~15.

    ``params``: the struct with its fixed fields set (copied; :attr:`params` is the launch's own, whose fields a
    test or a plan may read by name). ``per_call``: the fields, by name (``"q"``, or ``"fwd.q"`` in a nested struct),
    that a call passes ``values`` for, in that order: 64-bit fields (pointers, the dropout seed and offset, counts),
    written as unsigned integers through offsets worked out here; a negative one raises ValueError rather than
    launching with a wrapped value.

    ``programmatic`` (sm_90 and later): launched with programmatic stream serialization (cuLaunchKernelEx), so that
    the kernel's launch overlaps the end of the kernel before it in the stream; the kernel must wait for it first
    (cuda/sm90/grid_dependencies.cuh: wait_for_prior_grids).

    ``maps``: the struct's tensor map fields by name (cuda/common/types.cuh: TensorMap); a call's ``write_maps``
    gets their host addresses (:attr:`map_addresses`, 64-byte aligned as cuTensorMapEncodeTiled requires: the
    buffer is aligned as the CUDA struct) under the launch's lock and encodes the maps there, before the launch
    copies the struct.
    """

    __slots__ = ("function", "grid", "block", "smem_bytes", "params", "per_call", "map_addresses", "_buffer",
                 "_words", "_indices", "_kernel_params", "_params_ptr", "_lock", "_config")

    def __init__(self, function, grid, block, smem_bytes: int, params, per_call=(), programmatic: bool = False,
                 maps=()):
        from . import params as structs

        self.function, self.grid, self.block, self.smem_bytes = function, tuple(grid), tuple(block), smem_bytes
        self._config = _programmatic_config(self.grid, self.block, smem_bytes) if programmatic else None
        struct = type(params)
        size, align = ctypes.sizeof(struct), structs.alignment(struct)
        self._buffer = (ctypes.c_ubyte * (size + align))()
        address = -(-ctypes.addressof(self._buffer) // align) * align
        ctypes.memmove(address, ctypes.addressof(params), size)
        self.params = struct.from_address(address)
        # The struct as 64-bit words: stores ints faster than ctypes fields (one store per per-call field).
        self._words = memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B").cast("Q")
        indices = []
        for name in per_call:
            offset, ctype = structs.field(struct, name)
            if ctypes.sizeof(ctype) != 8 or offset % 8:
                raise TypeError(f"{struct.__name__}.{name}: a per-call field is a 64-bit one")
            indices.append(offset // 8)
        self.per_call, self._indices = tuple(per_call), tuple(indices)
        self.map_addresses = tuple(address + structs.field(struct, name)[0] for name in maps)
        self._kernel_params = (ctypes.c_void_p * 1)(address)  # the kernel's one parameter
        self._params_ptr = ctypes.addressof(self._kernel_params)
        self._lock = threading.Lock()  # the buffer is shared; the launch copies it

    def __call__(self, stream_ptr: int, values, write_maps=None) -> None:
        global _launch_kernel
        if _launch_kernel is None:
            from cupy_backends.cuda.api import driver

            _launch_kernel = driver.launchKernel
        if not (self.grid[0] and self.grid[1] and self.grid[2]):
            return  # an empty grid (say varlen with max_seqlen_k = 0) has nothing to do; CUDA rejects it
        with self._lock:
            words = self._words
            for i, value in zip(self._indices, values):
                words[i] = value  # pointers and counts: >= 0 (a negative one raises ValueError)
            if write_maps is not None:
                write_maps(self.map_addresses)
            if self._config is None:
                _launch_kernel(self.function.ptr, *self.grid, *self.block, self.smem_bytes, stream_ptr,
                               self._params_ptr, 0)
                return
            config, config_ptr = self._config
            config.hStream = stream_ptr
            lib = _driver()
            status = lib.cuLaunchKernelEx(config_ptr, self.function.ptr, self._params_ptr, None)
            if status:
                raise RuntimeError(f"cuLaunchKernelEx failed: {driver_error(status)}")


_launch_kernel = None


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding, then a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int), ("rest", ctypes.c_byte * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("numAttrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def _programmatic_config(grid, block, smem_bytes):
    """A CUlaunchConfig with the programmatic stream serialization attribute (its stream set per call), and its
    address; the attribute is kept alive by the config's owner through the returned config."""
    attribute = _LaunchAttribute()
    attribute.id = _PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value = 1  # programmaticStreamSerializationAllowed
    config = _LaunchConfig(*grid, *block, smem_bytes, None, ctypes.addressof(attribute), 1)
    config._attribute = attribute  # (ctypes keeps the attribute alive with the config)
    return config, ctypes.addressof(config)


@functools.lru_cache(maxsize=1)
def _driver():
    """The CUDA driver library, with the signatures of cuLaunchKernelEx, cuTensorMapEncodeTiled (fa2cupy/
    tensor_maps.py) and cuGetErrorName."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    # (map, data type, rank, address, dims, strides, box, element strides, interleave, swizzle, L2 promotion, fill)
    lib.cuTensorMapEncodeTiled.argtypes = ((ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32) + (ctypes.c_void_p,) * 5
                                           + (ctypes.c_int,) * 4)
    lib.cuGetErrorName.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
    lib.cuLaunchKernelEx.restype = lib.cuTensorMapEncodeTiled.restype = lib.cuGetErrorName.restype = ctypes.c_int
    return lib


def driver_error(status: int) -> str:
    """A CUresult as ``NAME (number)`` for an exception's message."""
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(status, ctypes.byref(name))
    return f"{(name.value or b'unknown error').decode()} ({status})"


def memset_async(ptr: int, value: int, nbytes: int, stream_ptr: int) -> None:
    """cudaMemsetAsync of ``nbytes`` at ``ptr`` on the stream with handle ``stream_ptr``."""
    from cupy_backends.cuda.api import runtime

    runtime.memsetAsync(ptr, value, nbytes, stream_ptr)
