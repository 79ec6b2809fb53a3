"""The kernels' parameter structs (cuda/common/params.cuh) against their Python mirrors (fa2cupy/params.py), and the
launches that fill them (build.Launch): no GPU needed.

A probe generated from the mirrors, one static_assert per field offset and size and per struct size and alignment,
is compiled by NVRTC against the real header, so a field added, moved or retyped on one side only fails here."""

from __future__ import annotations

import ctypes
import inspect
import re
from pathlib import Path

import pytest

from fa2cupy import backward, build, decode, forward, params

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

ROOT = Path(__file__).resolve().parents[1]


def _nvrtc_available():
    try:
        nvrtc.getVersion()
        return True
    except Exception:  # the shared library itself is missing: CuPy imports fine without it
        return False


def probe_source() -> str:
    """C++ that includes common/params.cuh and checks every mirrored layout fact: each field's size, each struct's
    size and alignment (static_assert), each field's offset (NVRTC has no offsetof: a device object's field
    addresses, which the PTX spells ``generic(probe_X)+offset``, read back by :func:`probe_offsets`); and a kernel
    per struct that takes it as the kernels do (a __grid_constant__ parameter)."""
    lines = ['#include "common/params.cuh"']
    for name, struct in params.STRUCTS.items():
        cpp, paths = f"fa2::{name}", []
        for path, offset, size in params.fields(struct):
            paths.append(path)
            lines.append(f'static_assert(sizeof((({cpp}*)nullptr)->{path}) == {size}, "{name}.{path}: {size} bytes in '
                         f'fa2cupy/params.py");')
        lines.append(f'static_assert(sizeof({cpp}) == {ctypes.sizeof(struct)}, "{name}: '
                     f'{ctypes.sizeof(struct)} bytes in fa2cupy/params.py");')
        lines.append(f'static_assert(alignof({cpp}) == {params.alignment(struct)}, "{name}: aligned to '
                     f'{params.alignment(struct)} in fa2cupy/params.py");')
        lines.append(f"__device__ {cpp} probe_{name};")
        lines.append(f"__device__ const char* const probe_{name}_fields[] = {{"
                     + ", ".join(f"(const char*)&probe_{name}.{path}" for path in paths) + "};")
        lines.append(f"__global__ void probe_{name}_kernel(const __grid_constant__ {cpp} p) {{}}")
    return "\n".join(lines) + "\n"


def compile_probe(source: str) -> str:
    """The PTX of ``source`` for sm_90, cuda/ on the include path; raises RuntimeError with NVRTC's log."""
    prog = nvrtc.createProgram(source, "params_probe.cu", (), ())
    try:
        nvrtc.compileProgram(prog, build.NVRTC_OPTIONS + ("-arch=compute_90", f"-I{build.kernel_dir()}",
                                                          "-diag-suppress=177"))  # (the tables are never read)
        ptx = nvrtc.getPTX(prog)
    except nvrtc.NVRTCError as error:
        raise RuntimeError(nvrtc.getProgramLog(prog)) from error
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def probe_offsets(ptx: str) -> dict[str, list[int]]:
    """{struct: its fields' offsets, in the order of params.fields} as the device compiler laid them out."""
    found = {}
    for name, table in re.findall(r"probe_(\w+)_fields\[\d+\] = \{([^}]*)\}", ptx):
        found[name] = [int(offset or 0) for offset in re.findall(rf"generic\(probe_{name}\)(?:\+(\d+))?", table)]
    return found


@pytest.mark.skipif(not _nvrtc_available(), reason="libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12)")
def test_mirrors_match_the_cuda_structs():
    offsets = probe_offsets(compile_probe(probe_source()))
    assert set(offsets) == set(params.STRUCTS)
    for name, struct in params.STRUCTS.items():
        for (path, mirrored, _), compiled in zip(params.fields(struct), offsets[name], strict=True):
            assert compiled == mirrored, f"{name}.{path}: offset {compiled} in CUDA, {mirrored} in fa2cupy/params.py"


@pytest.mark.skipif(not _nvrtc_available(), reason="libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12)")
def test_probe_fails_on_a_drifted_mirror(monkeypatch):
    # The probe can fail: a mirror whose field is wider than the CUDA one, or whose fields are in another order, is
    # caught, and the field named.
    def merge_params(fields):
        return type("MergeParams", (ctypes.Structure,), {"_fields_": [
            ("parts", ctypes.c_uint64), ("lses", ctypes.c_uint64), ("out", ctypes.c_uint64),
            ("lse_out", ctypes.c_uint64), ("rows", ctypes.c_int64), *fields]})

    monkeypatch.setitem(params.STRUCTS, "MergeParams", merge_params([("n", ctypes.c_int64), ("headdim", ctypes.c_int32)]))
    with pytest.raises(RuntimeError, match=r'static assertion failed with "MergeParams.n: 8 bytes'):
        compile_probe(probe_source())
    monkeypatch.setitem(params.STRUCTS, "MergeParams", merge_params([("headdim", ctypes.c_int32), ("n", ctypes.c_int32)]))
    with pytest.raises(AssertionError, match=r"MergeParams.headdim: offset 44 in CUDA, 40 in fa2cupy/params.py"):
        test_mirrors_match_the_cuda_structs()


def _cuda_fields() -> dict[str, list[str]]:
    """{struct: its field names in order}, read from the text of cuda/common/params.cuh."""
    text = (build.kernel_dir() / "common" / "params.cuh").read_text()
    found = {}
    for name, body in re.findall(r"^struct (\w+) \{\n(.*?)^\};", text, re.MULTILINE | re.DOTALL):
        body = re.sub(r"//[^\n]*", "", body)
        found[name] = re.findall(r"(\w+)\s*;", body)
    return found


def test_mirrors_have_every_cuda_field_in_order():
    # (The compiled probe checks the mirrors' fields; a CUDA field that only fills a padding hole would not move any
    # of them: the header's own field list must be the mirror's.)
    cuda = _cuda_fields()
    assert set(cuda) == set(params.STRUCTS)
    for name, struct in params.STRUCTS.items():
        mirrored = [n for n, _ in struct._fields_ if not n.startswith("_pad")]
        assert cuda[name] == mirrored, name


def test_tensor_maps_sit_on_64_byte_boundaries():
    for struct, names in ((params.FwdHopperParams, ("tmap_q", "tmap_k", "tmap_v", "tmap_o")),
                          (params.BwdHopperParams, ("tmap_q", "tmap_k", "tmap_v", "tmap_do", "tmap_dq"))):
        assert params.alignment(struct) == 64 and ctypes.sizeof(struct) % 64 == 0
        for name in names:
            offset, ctype = params.field(struct, name)
            assert offset % 64 == 0 and ctypes.sizeof(ctype) == 128


def test_field_paths():
    assert params.field(params.FwdHopperParams, "fwd.q") == (0, ctypes.c_uint64)
    assert params.field(params.FwdHopperParams, "tile_counter")[0] == params.FwdParams.seed.offset + 24
    with pytest.raises(AttributeError, match=r"FwdParams has no field 'seed_lo'"):
        params.field(params.FwdParams, "seed_lo")
    with pytest.raises(AttributeError, match=r"FwdHopperParams has no field 'fwd.nope'"):
        params.field(params.FwdHopperParams, "fwd.nope")


def test_launch_places_maps_and_per_call_fields_by_name(monkeypatch):
    calls = []
    monkeypatch.setattr(build, "_launch_kernel", lambda *args: calls.append(args))

    class Function:
        ptr = 5

    fixed = params.FwdHopperParams(batch=3)
    fixed.fwd.scale = 0.5
    launch = build.Launch(Function(), (1, 1, 1), (384, 1, 1), 0, fixed, ("fwd.q", "fwd.seed", "tile_counter"),
                          maps=("tmap_q", "tmap_o"))
    assert all(address % 64 == 0 for address in launch.map_addresses)
    seen = []
    launch(1, (0xA000, 1 << 40, 0xC000), lambda addresses: seen.append(addresses))
    assert seen == [launch.map_addresses]
    struct_address = ctypes.cast(calls[0][9], ctypes.POINTER(ctypes.c_void_p))[0]
    assert struct_address % 64 == 0 and struct_address == ctypes.addressof(launch.params)
    assert launch.map_addresses == (struct_address + params.FwdHopperParams.tmap_q.offset,
                                    struct_address + params.FwdHopperParams.tmap_o.offset)
    p = launch.params
    assert (p.fwd.q, p.fwd.seed, p.tile_counter, p.batch, p.fwd.scale) == (0xA000, 1 << 40, 0xC000, 3, 0.5)
    with pytest.raises(TypeError, match=r"FwdParams.max_seqlen_q: a per-call field is a 64-bit one"):
        build.Launch(Function(), (1, 1, 1), (128, 1, 1), 0, params.FwdParams(), ("max_seqlen_q",))


def test_no_argument_is_located_by_counting_positions():
    # Launches take a struct and per-call field names; the planners and run functions name fields, never slots.
    assert list(inspect.signature(build.Launch).parameters) == ["function", "grid", "block", "smem_bytes", "params",
                                                                "per_call", "programmatic", "maps"]
    positional = re.compile(r"rng_slot|rng_at|_slots\b|variable\b|\blen\((scalars|args|sizes)\)|\brange\(\d+\)"
                            r"|\b\d+\s*\+\s*len\(")
    for module in (forward, backward, decode, build):
        source = inspect.getsource(module)
        assert not positional.search(source), (module.__name__, positional.search(source).group(0))


def test_unit_mods_constants():
    # the unit of the Hopper forward's modified scores and its reciprocal (UnitModsConstants): the cap, else the scale,
    # else 1
    from fa2cupy import forward

    assert forward.unit_mods_constants(0.125, 30.0) == (30.0, 1 / 30.0)
    assert forward.unit_mods_constants(0.125, 0.0) == (0.125, 8.0)
    assert forward.unit_mods_constants(0.0, 0.0) == (1.0, 1.0)
