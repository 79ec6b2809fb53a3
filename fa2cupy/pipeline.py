"""The one call pipeline behind every generic entry point: the arguments described, checked, planned, the outputs
allocated, the kernels launched, and the results handed back in the caller's framework, on the caller's stream.

An entry point (:mod:`fa2cupy.attention`, :mod:`fa2cupy.kvcache`) is a thin function: it gathers its arguments into
three tuples and hands them to :func:`run` with its :class:`Kind`, a declarative object that says what differs
between entry points: the array arguments, the checks, the planner, the allocations, the kernel family's launch
and the result's shape. :func:`run` does the rest the same way for every kind:

* fast path: a call whose arrays have the metadata (type, shape, strides, dtype, device) and whose options equal
  those of an earlier checked call, with 16-byte aligned pointers on the current device, skips the checks, the
  array adaptation and the planning (about 90% of a small call's host time): it allocates the outputs and launches
  the remembered plan on the arrays' pointers.
* checked path: every array described (:func:`fa2cupy.arrays.describe`) and checked without touching the GPU; then,
  on the inputs' device with the caller's stream current, adapted into kernel-ready CuPy views (copies only where
  the kernels need them), planned, allocated, launched; the plan is remembered for the fast path when no input had
  to be copied.

Pointers travel by name: a launch gets a dict from argument and output names to device pointers (0 for an absent
optional array), and each family's run function reads the ones it takes. The plan cache's key holds the kind, each
array's metadata (None for an absent one), the options and the KernelOptions, which choose kernels too: two calls
that differ only in their kernel options never share a plan.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import cupy

from . import arrays, checks
from .options import DEFAULT, KernelOptions

# --------------------------------------------------------------------------------------------- the kinds


@dataclass
class Call:
    """What the checks of one call found (checked path only): where it runs, and the per-call values its launch
    takes besides pointers (dropout seed and offset, an int cache length). Kinds add their own fields."""

    framework: str
    device: int
    values: tuple = ()


class Kind:
    """What one kind of call declares; :func:`run` drives it. Subclass, set the attributes and override the
    methods; an instance is a module-level constant.

    Attributes:
        name: what the kind is called (its kind of call, for tests and diagnostics; the plan cache's key starts
            with the kind itself).
        arrays: the array arguments, in the order :func:`run` gets them (None for an absent optional one); they are
            also the names of their pointers at the launch.
        returned: the allocations handed back to the caller; the kind's allocations list them first, in this order.
        poisoned: the allocations that KernelOptions.debug_poison fills with NaN before the launch.
        cacheable: whether repeated calls may take the fast path.
        launch: the kernel family's run function, ``launch(plan, pointers, values, stream_ptr, framework, device)``
            (a staticmethod): ``pointers`` maps the given arrays' and the allocations' names to device pointers.
        no_pointers: every pointer name the launch reads, with 0 (the family's NO_POINTERS): a call's pointers start
            from a copy of it, so an absent array or output is 0.
    """

    name = ""
    arrays: tuple = ()
    no_pointers: dict = {}
    returned: tuple = ()
    poisoned: tuple = ()
    cacheable = True
    launch = None

    def fixed_values(self, call: Call):
        """The launch's per-call values where every call with the same key has them (the fast path then takes them
        as they are), else None (it then checks each call's with :meth:`values_check`)."""
        return call.values

    def values_check(self, call: Call, plan, options: tuple):
        """``check(values) -> the launch's per-call values``, validated as the checks would, for the fast path of
        calls whose values are not fixed."""
        return _SAME

    def describe(self, named: dict) -> dict:
        """ArrayInfo of every given array by name (it raises for a non-array)."""
        return {name: arrays.describe(x, name) for name, x in named.items()}

    def check(self, infos: dict, options: tuple, values: tuple) -> Call:
        """Validates the call from its arrays' descriptions and its options, without touching the GPU."""
        raise NotImplementedError

    def choose(self, call: Call, infos: dict, arch: int, options: KernelOptions) -> None:
        """Settles, in ``call``, what adapt needs of the GPU and the kernel options (say, a head dim to pad to);
        nothing by default."""

    def adapt(self, call: Call, named: dict, infos: dict) -> dict:
        """Kernel-ready CuPy views of the given arrays by name (copies where the kernels need them), with the
        launch stream current. Every given array must be in it: the fast path launches on all of their pointers."""
        raise NotImplementedError

    def plan(self, call: Call, ready: dict, arch: int, device: int, options: KernelOptions):
        """The launch plan (it depends on metadata and options only, never on pointers)."""
        raise NotImplementedError

    def allocations(self, call: Call, plan) -> tuple:
        """``((name, shape, dtype), ...)``: the outputs and workspaces, the returned ones first."""
        raise NotImplementedError

    def results(self, call: Call, outs: list, views: dict) -> list:
        """The returned outputs in the caller's framework, as the checked path hands them over (say, sliced to the
        head dim); ``views``: every allocation as a CuPy array by name."""
        return outs

    def result(self, options: tuple):
        """``shape(outs) -> the call's result`` for these options: the result's shape made of the returned outputs
        (``outs``: on the checked path the returned ones, on the fast path every allocation, in order). A cached call
        keeps it; a C-level ``operator.itemgetter`` where it can be (it runs on every fast call)."""
        return FIRST

    def cached_result(self, call: Call, options: tuple):
        """What a cached call of this metadata returns from every allocation (the fast path's ``made``): result's
        shape, and whatever ``results`` does to the returned outputs (which, used in place, only slicing may need)."""
        return self.result(options)


#: The result of most calls: the first returned output.
FIRST = operator.itemgetter(0)


def _SAME(values: tuple) -> tuple:  # (per-call values used as they are)
    return values


# --------------------------------------------------------------------------------------------- the pipeline


class _CachedCall:
    """What a checked call left behind for identical later calls: the plan; each allocation's name and allocator
    (arrays.allocator: dtype and allocator resolved once), in allocation order; the launch's per-call values where
    they are fixed, else None and their check (Kind.fixed_values, Kind.values_check); the caller's stream getter;
    the result's shape (Kind.result)."""

    __slots__ = ("plan", "device", "framework", "allocations", "values", "check", "stream", "result")

    def __init__(self, plan, device: int, framework: str, layout, values=None, check=None, result=None):
        self.plan, self.device, self.framework, self.values = plan, device, framework, values
        self.check, self.result = check or _SAME, result or FIRST
        self.allocations = tuple((name, arrays.allocator(shape, dtype, framework, device))
                                 for name, shape, dtype in layout)
        self.stream = arrays.stream_ptr_getter(framework)


#: Checked plans by call metadata (see arrays.fast_meta): a repeated call skips checks, array adaptation and
#: planning, which are ~90% of the host time of a small problem.
_cached_calls: dict = {}
_MAX_CACHED_CALLS = 1024


def run(kind: Kind, given: tuple, options: tuple, values: tuple = (), kernel_options: KernelOptions | None = None):
    """Runs one call of ``kind``: ``given`` holds the array arguments in ``kind.arrays`` order (None where absent),
    ``options`` the hashable scalar arguments that, with the arrays' metadata, decide the plan, ``values`` the
    per-call ones that do not (dropout seed and offset, an int cache length), and ``kernel_options`` the
    KernelOptions (None: the defaults), which choose kernels too and so are part of the key.

    The fast path's look-up is written out here, not called, as is all of its work: this is the host time of every
    repeated call. Its key holds each array's metadata (arrays.fast_meta; None for an absent one), the options and
    the kernel options; a call whose arrays have no fast metadata (NumPy, JAX) or whose options cannot be hashed
    (say a list window_size) takes the checked path uncached, as does a call with debug poisoning. A cached call
    is used only if every pointer is 16-byte aligned and its device is the current one."""
    if kernel_options is None:
        kernel_options = DEFAULT
    elif type(kernel_options) is not KernelOptions:
        raise TypeError(f"kernel_options must be a fa2cupy.KernelOptions or None, got {type(kernel_options).__name__}")
    elif kernel_options.debug_poison:  # (outputs filled on the checked path)
        return _checked(kind, given, options, values, kernel_options, None, None)
    key = pointers = None
    if kind.cacheable:
        names, fast_meta = kind.arrays, arrays.fast_meta
        metas, pointers, bits, i = [None] * len(given), kind.no_pointers.copy(), 0, 0
        for x in given:
            if x is not None:
                meta = fast_meta(x)
                if meta is None:
                    return _checked(kind, given, options, values, kernel_options, None, None)
                metas[i], pointer = meta
                pointers[names[i]] = pointer
                bits |= pointer
            i += 1
        key = (kind, tuple(metas), options, kernel_options._token)
        try:
            cached = _cached_calls.get(key)
        except TypeError:  # an unhashable option
            return _checked(kind, given, options, values, kernel_options, None, None)
        if cached is not None and not bits & 15 and cupy.cuda.runtime.getDevice() == cached.device:
            framework, device, fixed = cached.framework, cached.device, cached.values
            values = cached.check(values) if fixed is None else fixed
            made = []
            for name, allocate in cached.allocations:
                array, pointers[name] = allocate()
                made.append(array)
            kind.launch(cached.plan, pointers, values, cached.stream(device), framework, device)
            return cached.result(made)
    return _checked(kind, given, options, values, kernel_options, key, pointers)


def forget_plans() -> None:
    """Drops every remembered plan, so that the next calls plan anew: for what changes plans without being part of
    their key (build.use_sources' other kernel sources, a test's stand-in for a device query)."""
    _cached_calls.clear()


def _remember(key, cached: _CachedCall) -> None:
    if len(_cached_calls) >= _MAX_CACHED_CALLS:
        _cached_calls.clear()
    _cached_calls[key] = cached


def _checked(kind: Kind, given: tuple, options: tuple, values: tuple, kernel_options: KernelOptions, key,
             given_pointers):
    """The checked path (see the module docstring); remembers the plan under ``key`` when every input was used in
    place (its kernel-ready view has the given array's pointer)."""
    named = {name: x for name, x in zip(kind.arrays, given) if x is not None}
    infos = kind.describe(named)
    call = kind.check(infos, options, values)
    framework, device = call.framework, call.device
    with cupy.cuda.Device(device):
        stream = arrays.caller_stream(framework, device)
        with stream:  # copies made while adapting inputs belong on the caller's stream too
            kind.choose(call, infos, arch(device), kernel_options)
            ready = kind.adapt(call, named, infos)
            plan = kind.plan(call, ready, arch(device), device, kernel_options)
            layout = kind.allocations(call, plan)
            made = [arrays.new_empty(shape, dtype, framework, device) for _, shape, dtype in layout]
            pointers = kind.no_pointers.copy()
            pointers.update((name, x.data.ptr) for name, x in ready.items())
            poison = kernel_options.debug_poison
            for (name, _, _), (_, view) in zip(layout, made):
                pointers[name] = view.data.ptr
                if poison and name in kind.poisoned:
                    view.fill(float("nan"))
            kind.launch(plan, pointers, call.values, stream.ptr, framework, device)
            if key is not None and all(x.data.ptr == given_pointers[name] for name, x in ready.items()):
                _remember(key, _CachedCall(plan, device, framework, tuple(layout), kind.fixed_values(call),
                                           kind.values_check(call, plan, options), kind.cached_result(call, options)))
            outs = [arrays.make_result(native, view, framework)
                    for (name, _, _), (native, view) in zip(layout, made) if name in kind.returned]
            views = {name: view for (name, _, _), (_, view) in zip(layout, made)}
            return kind.result(options)(kind.results(call, outs, views))


# --------------------------------------------------------------------------------------------- helpers for kinds

_arch_by_device: dict[int, int] = {}


def arch(device: int) -> int:
    """The compute capability of ``device`` as an int (80, 90, ...), looked up once."""
    found = _arch_by_device.get(device)
    if found is None:
        found = _arch_by_device[device] = int(cupy.cuda.Device(device).compute_capability)
    return found


def device_of(info) -> int:
    """The CUDA device a call runs on: its array's, or the current one for host NumPy inputs."""
    return info.device[1] if info.device[0] == "cuda" else cupy.cuda.runtime.getDevice()


def padded_headdim(headdim: int) -> int:
    """The head dim the kernels see: a multiple of 8 (zero columns added by :func:`kernel_ready`)."""
    return -(-headdim // 8) * 8


def kernel_ready(x, headdim: int, width: int | None = None):
    """A view or copy of CuPy array ``x`` (head dim ``headdim``) that the kernels can read: head dim padded with
    zeros to ``width`` (default: to a multiple of 8; v's to q's where they differ, or q's and k's to v's),
    16-byte aligned rows, and row strides that fit the kernels' 32-bit row arithmetic.

    Zero padding is exact: padded q/k columns add 0 to every score and padded v columns only produce output
    columns that are sliced away.
    """
    padded = padded_headdim(headdim) if width is None else width
    if padded != headdim:
        wide = cupy.zeros(x.shape[:-1] + (padded,), dtype=x.dtype)
        wide[..., :headdim] = x
        return wide
    item = x.itemsize
    aligned = x.data.ptr % 16 == 0 and all(s % (8 * item) == 0 for s in x.strides[:-1])
    if not aligned or abs(x.strides[-3]) // item >= checks.MAX_ROW_STRIDE:
        return cupy.ascontiguousarray(x)
    return x


def contiguous(x, info):
    """A C-contiguous CuPy view of a small side array (cu_seqlens, lse, a block table, the dropout rng state): the
    caller's own memory when it already is contiguous, else a copy."""
    return cupy.ascontiguousarray(arrays.to_cupy(x, info))


def alibi_ready(x, info):
    """(CuPy slopes with a contiguous head axis, their batch stride in elements: 0 for ``(nheads,)`` slopes)."""
    given = arrays.to_cupy(x, info)
    slopes = given if given.strides[-1] == 4 and given.data.ptr % 4 == 0 else cupy.ascontiguousarray(given)
    return slopes, (slopes.strides[0] // 4 if slopes.ndim == 2 else 0)


def elem_strides(x) -> tuple:
    """A CuPy array's strides in elements."""
    return tuple(s // x.itemsize for s in x.strides)


def c_strides(shape) -> tuple:
    """The element strides of a C-contiguous array of ``shape`` (the pipeline's allocations)."""
    return arrays._c_strides(shape)


def returned_head_dim(outs: list, headdim, padded: int) -> list:
    """Outputs sliced to the caller's head dim where the kernels ran on a padded one; ``headdim`` an int for all
    of them, or a sequence of one per output."""
    dims = tuple(headdim) if isinstance(headdim, (tuple, list)) else (headdim,) * len(outs)
    return [x if d == padded else x[..., :d] for x, d in zip(outs, dims)]
