"""Every shipped kernel instantiation compiles with NVRTC for sm_80 and sm_90 (the Hopper kernels, which use wgmma,
for sm_90a), and none spills registers on the arch family it is shipped for.

On an arch its table rows are shipped for, an instantiation is compiled to machine code (ptxas, with the spill
check); on the other arch, where it never runs, through NVRTC's front end (every template instantiated and checked
in that arch's preprocessor branch; its code generation is the home arch's, checked there). The float16 and
bfloat16 instantiations of one tile row differ only in their conversion and mma instructions, and compiled in full
the float16 one never needs more registers, spills or stack (every pair of the fwd, bwd and decode families on sm_80
and sm_90: the same registers but for the small merge kernel, 40 against 46-47): so every bfloat16 instantiation goes
to machine code, and of the float16 ones one per kernel template and
variant (its flags after the element type: mask, modifiers, varlen, ...), which compiles every float16 instruction
string through ptxas and is checked to match its bfloat16 twin; the other float16 ones go through the front end on
their home arch too. That keeps the README's test command under 5 minutes on two cores. All of a run's compiles go
to one thread pool at once, the costliest first, so that both cores of a CI machine stay busy to the end.

Runs on a CPU-only machine: NVRTC (pip's nvidia-cuda-nvrtc-cu12) is all it needs.
"""

import dataclasses
import itertools
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fa2cupy import build, configs, decode
from fa2cupy.options import KernelOptions

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")


def _nvrtc_available():
    try:
        nvrtc.getVersion()
        return True
    except Exception:  # the shared library itself is missing: CuPy imports fine without it
        return False


pytestmark = pytest.mark.skipif(
    not _nvrtc_available(), reason="libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12)"
)

#: Which compile target stands for each table family when checking registers.
FAMILY_ARCH = {"sm80": "80", "sm86": "80", "sm90": "90"}


def _ptxas_reports(log: str) -> dict[str, tuple[int, int]]:
    """ptxas -v log -> {mangled kernel name: (spill store bytes, stack frame bytes)}."""
    return {name: report[1:] for name, report in _ptxas_full_reports(log).items()}


def _ptxas_full_reports(log: str) -> dict[str, tuple[int, int, int]]:
    """ptxas -v log -> {mangled kernel name: (registers, spill store bytes, stack frame bytes)}."""
    reports = {}
    for entry in log.split("Compiling entry function")[1:]:
        name = re.search(r"'([^']+)'", entry).group(1)
        registers = int(re.search(r"Used (\d+) registers", entry).group(1))
        spill = int(re.search(r"(\d+) bytes spill stores", entry).group(1))
        stack = int(re.search(r"(\d+) bytes stack frame", entry).group(1))
        reports[name] = (registers, spill, stack)
    return reports


FAMILIES = {
    "fwd": configs.forward_instantiations,
    "bwd": configs.backward_instantiations,
    "decode": decode.instantiations,
}

# The sm_90a families: (family, their shipped instantiations, how many, their table rows with the byte count a
# launch asks for, the kernel template's name).
HOPPER_FAMILIES = {
    # (forward: padded, varlen and paged for every mask; with softcap/ALiBi padded causal, window and none, varlen
    # and paged window, at the head dims of HOPPER_MODS_HEADDIMS; padded only at HOPPER_MODS_PADDED_ONLY; ALiBi
    # alone padded causal and none; v's narrower head dims (FORWARD_HOPPER_V_TABLE) padded and varlen, every mask)
    "fwd_hopper": (configs.hopper_forward_instantiations,
                   len(configs.DTYPE_TAGS) * (len(configs.FORWARD_HOPPER_TABLE) * len(configs.MASKS) * 3
                                              + len(configs.HOPPER_MODS_HEADDIMS) * (5 + 2)
                                              - len(configs.HOPPER_MODS_PADDED_ONLY) * 2
                                              + len(configs.FORWARD_HOPPER_V_TABLE) * len(configs.MASKS) * 2),
                   lambda: [(c, c.smem_bytes) for c in (*configs.FORWARD_HOPPER_TABLE.values(),
                                                         *configs.FORWARD_HOPPER_MODS_TABLE.values(),
                                                         *configs.FORWARD_HOPPER_V_TABLE.values(),
                                                         *(dataclasses.replace(configs.FORWARD_HOPPER_TABLE[d],
                                                                               v_dim=v_dim)
                                                           for d, v_dim in configs.FORWARD_HOPPER_V_TABLE))],
                   "fa2::flash_fwd_hopper<"),
    # (backward: padded and varlen for every mask; with softcap/ALiBi the window variant at HOPPER_BWD_MODS_HEADDIMS,
    # padded only at HOPPER_BWD_MODS_PADDED_ONLY, and its padded ALiBi-only kernel; the rows' narrower score
    # products (HOPPER_BWD_SCORE_DIMS) likewise for every mask, but not varlen window at 128; v's narrower head dims
    # (HOPPER_BWD_V_DIMS) padded and varlen, for every mask)
    "bwd_hopper": (configs.hopper_backward_instantiations,
                   len(configs.DTYPE_TAGS) * (len(configs.BACKWARD_HOPPER_TABLE) * len(configs.MASKS) * 2
                                              + len(configs.HOPPER_BWD_MODS_HEADDIMS) * 3
                                              - len(configs.HOPPER_BWD_MODS_PADDED_ONLY)
                                              + sum(map(len, configs.HOPPER_BWD_SCORE_DIMS.values()))
                                              * len(configs.MASKS) * 2
                                              - len(configs.HOPPER_BWD_SCORE_DIMS[128])
                                              + sum(map(len, configs.HOPPER_BWD_V_DIMS.values())) * len(configs.MASKS)
                                              * 2),
                   lambda: [(c, c.smem_bytes()) for c in configs.BACKWARD_HOPPER_TABLE.values()],
                   "fa2::bwd_dkdv_hopper<"),
}

#: Seconds of one CPU core per instantiation compiled to machine code, roughly: the pool's order, costliest first.
_COST = {"fwd": 0.2, "bwd": 0.3, "decode": 0.45, "fwd_hopper": 0.5, "bwd_hopper": 0.5}


def _home_names(family: str, arch: str) -> set[str]:
    """The instantiations of `family` shipped for `arch`: its table families' rows."""
    if family in HOPPER_FAMILIES:
        return set(HOPPER_FAMILIES[family][0]())
    return set().union(*(FAMILIES[family](f) for f, a in FAMILY_ARCH.items() if a == arch))


_F16 = re.compile(r"fa2::f16\b")


def _variant(name: str) -> str:
    """A float16 instantiation's kernel template and variant: its name without the tile row, i.e. the template's
    name and what follows the element type (``fa2::flash_fwd<fa2::f16, fa2::kMaskCausal, false, true>>``)."""
    return re.sub(r"^(fa2::\w+<).*?(fa2::f16\b.*)$", r"\1\2", name)


def _float16_stand_ins(names) -> set[str]:
    """Of the float16 instantiations among `names`, the first of each kernel template and variant."""
    chosen: dict[str, str] = {}
    for name in sorted(n for n in names if _F16.search(n)):
        chosen.setdefault(_variant(name), name)
    return set(chosen.values())


def _machine_names(family: str, arch: str) -> set[str]:
    """The instantiations of `family` compiled to machine code for `arch`: of its table families' rows (the Hopper
    families: all their instantiations) every one but the float16 ones, of which one per kernel template and
    variant: they compile as their bfloat16 twins (test_instantiations_compile_without_spills checks the pairs)."""
    home = _home_names(family, arch)
    return {n for n in home if not _F16.search(n)} | _float16_stand_ins(home)


def _all_names(family: str) -> list[str]:
    return (FAMILIES[family] if family in FAMILIES else HOPPER_FAMILIES[family][0])()


def _jobs(targets):
    """(family, arch, names, front end only) of every compile that (family, arch) in `targets` need: machine code for
    the instantiations shipped for the arch, in chunks of 4; the front end for the family's others, in one go."""
    jobs = []
    for family, arch in sorted(targets):
        machine = sorted(_machine_names(family, arch))
        jobs += [(family, arch, machine[i : i + 4], False) for i in range(0, len(machine), 4)]
        others = sorted(set(_all_names(family)) - set(machine))
        if others:
            jobs.append((family, arch, others, True))
    return jobs


@dataclasses.dataclass
class Compiled:
    """What the compiles of one (family, arch) gave."""

    machine: list = dataclasses.field(default_factory=list)    # names compiled to machine code
    front_end: list = dataclasses.field(default_factory=list)  # names compiled through the front end only
    binaries: list = dataclasses.field(default_factory=list)   # the machine-code compiles' cubins
    logs: list = dataclasses.field(default_factory=list)       # and their NVRTC logs
    reports: dict = dataclasses.field(default_factory=dict)    # mangled name -> (spill bytes, stack bytes)
    full_reports: dict = dataclasses.field(default_factory=dict)  # mangled name -> (registers, spills, stack)
    lowered: dict = dataclasses.field(default_factory=dict)    # name expression -> mangled name


_SPILL_TESTS = ("test_instantiations_compile_without_spills", "test_hopper_kernels_compile_without_spills")


@pytest.fixture(scope="module")
def compiled(request) -> dict[tuple[str, str], Compiled]:
    """{(family, arch): Compiled} for the spill tests this run selected, compiled in one pool (NVRTC releases the
    GIL: its threads use every core of the CI machine), the costliest chunks first."""
    targets = set()
    for item in request.session.items:
        if getattr(item, "originalname", None) in _SPILL_TESTS:
            params = item.callspec.params
            targets.add((params["family"], params.get("arch", "90a")))
    jobs = _jobs(targets)
    order = sorted(range(len(jobs)), key=lambda i: 0 if jobs[i][3] else -_COST[jobs[i][0]] * len(jobs[i][2]))

    def run(i):
        family, arch, names, front_end = jobs[i]
        return build.compile_for_arch(family, names, arch, log=True, front_end_only=front_end)

    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        results = dict(zip(order, pool.map(run, order)))
    out: dict[tuple[str, str], Compiled] = {}
    for i, (family, arch, names, front_end) in enumerate(jobs):
        binary, log, lowered = results[i]
        entry = out.setdefault((family, arch), Compiled())
        entry.lowered.update(lowered)
        if front_end:
            entry.front_end += names
            continue
        entry.machine += names
        entry.binaries.append(binary)
        entry.logs.append(log)
        entry.reports.update(_ptxas_reports(log))
        entry.full_reports.update(_ptxas_full_reports(log))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("arch", ["80", "90"])
def test_instantiations_compile_without_spills(family, arch, compiled):
    instantiations = FAMILIES[family]
    names = instantiations()
    assert len(names) >= (len(decode.MERGE_DTYPES) if family == "decode" else 2 * 2 * len(configs.HEADDIMS))
    result = compiled[(family, arch)]
    # every instantiation once: machine code where its table rows are shipped (float16: one per kernel template and
    # variant), the front end elsewhere
    machine, home = _machine_names(family, arch), _home_names(family, arch)
    assert sorted(result.machine) == sorted(machine) and machine
    assert sorted(result.front_end) == sorted(set(names) - machine)
    assert set(result.lowered) == set(names)
    assert all(len(binary) > 0 for binary in result.binaries)
    assert {n for n in home if not _F16.search(n)} <= machine  # every bfloat16 (and dtype-free) one in machine code
    assert {_variant(n) for n in home if _F16.search(n)} == {_variant(n) for n in machine if _F16.search(n)}
    for name in machine:
        spill, stack = result.reports[result.lowered[name]]
        assert (spill, stack) == (0, 0), f"{name} spills {spill} bytes on sm_{arch}"
    twins = 0
    for name in (n for n in machine if _F16.search(n)):  # the float16 stand-ins compile as their bfloat16 twins
        twin = _F16.sub("fa2::bf16", name)
        if twin in machine:
            mine, theirs = (result.full_reports[result.lowered[n]] for n in (name, twin))
            assert mine[1:] == theirs[1:] and mine[0] <= theirs[0], \
                f"{name}: (registers, spills, stack) {mine}, its bfloat16 twin {theirs}"
            twins += 1
    assert twins > 0


def _probe_ptx(family: str, probes: list[str], arch: str) -> str:
    """The PTX of a kernel family's source with `probes` (device variables set from its traits' constants)
    appended, compiled for compute_<arch>: how a test reads the kernels' own byte counts."""
    prog = nvrtc.createProgram(build.source(family) + "\n" + "\n".join(probes) + "\n", "probe.cu", (), ())
    try:
        nvrtc.compileProgram(prog, build.NVRTC_OPTIONS + (f"-arch=compute_{arch}",))
        ptx = nvrtc.getPTX(prog)
        return ptx.decode() if isinstance(ptx, bytes) else ptx
    finally:
        nvrtc.destroyProgram(prog)


@pytest.mark.parametrize("family", sorted(HOPPER_FAMILIES))
def test_hopper_kernels_compile_without_spills(family, compiled):
    instantiations, count, _, _ = HOPPER_FAMILIES[family]
    names = instantiations()
    assert len(names) == count
    result = compiled[(family, "90a")]
    # every bfloat16 instantiation in machine code, and of the float16 ones one per mask and variant (the others
    # through the front end)
    machine = _machine_names(family, "90a")
    assert sorted(result.machine) == sorted(machine)
    assert sorted(result.front_end) == sorted(set(names) - machine)
    assert set(result.lowered) == set(names)
    assert {_variant(n) for n in names if _F16.search(n)} == {_variant(n) for n in machine if _F16.search(n)}
    assert all(len(binary) > 0 for binary in result.binaries)
    for log in result.logs:
        # ptxas's performance advisories (C75xx): C7512 is "wgmma serialized due to insufficient register
        # resources", which the unmasked backward had at 232 registers before its mask test was simplified (each
        # HGMMA then waited for the last).
        assert "C75" not in log, [line for line in log.splitlines() if "C75" in line]
    for name in machine:
        assert result.reports[result.lowered[name]] == (0, 0), f"{name} spills on sm_90a"
    for name in (n for n in machine if _F16.search(n)):  # the float16 stand-ins compile as their bfloat16 twins
        mine, theirs = (result.full_reports[result.lowered[n]] for n in (name, _F16.sub("fa2::bf16", name)))
        assert mine[1:] == theirs[1:] and mine[0] <= theirs[0], f"{name}: {mine}, its bfloat16 twin {theirs}"


@pytest.mark.parametrize(("family", "define", "arch"), [("fwd_hopper", "FA2_FWD_TRACE", "90a"),
                                                        ("bwd_hopper", "FA2_BWD_TRACE", "90a"),
                                                        ("decode", "FA2_DECODE_TRACE", "90")])
def test_trace_builds_compile(family, define, arch):
    # bench/dev's trace scripts build one instantiation with their define (build.install_traced): it must compile,
    # and then hold the array the script reads.
    names = (HOPPER_FAMILIES[family][0] if family in HOPPER_FAMILIES else FAMILIES[family])()[:1]
    ptx, _, _ = build.compile_for_arch(family, names, arch, ptx_only=True, options=(f"-D{define}",))
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    array = {"FA2_FWD_TRACE": "fa2_fwd_trace", "FA2_BWD_TRACE": "fa2_bwd_trace", "FA2_DECODE_TRACE": "fa2_decode_trace"}
    assert f" {array[define]}[" in ptx


@pytest.mark.parametrize("family", sorted(HOPPER_FAMILIES))
def test_hopper_shared_memory_matches_the_kernel(family):
    # The config's byte count (what a launch asks for) against the traits' kSmemBytes, read from the PTX.
    _, _, rows, prefix = HOPPER_FAMILIES[family]
    rows = rows()
    probes = [f"__device__ int fa2_probe_{i} = {c.name_expression('float16', 'none')[len(prefix):-1]}::kSmemBytes;"
              for i, (c, _) in enumerate(rows)]
    ptx = _probe_ptx(family, probes, "90a")
    for i, (config, smem_bytes) in enumerate(rows):
        found = re.search(rf"fa2_probe_{i} = (\d+);", ptx)
        assert found and int(found[1]) == smem_bytes <= 227 * 1024, config
    # the wide rows too (forward: their Q buffers, which also stage the output rows, and rings take 217 and 225 KB;
    # backward: 64-key blocks with the P^T hand-over, 219 and 218.5 KB)
    assert {config.headdim for config, _ in rows} == {64, 128, 192, 256}


def test_hopper_backward_modifier_shared_memory_matches_the_kernel():
    # The modifier kernels' byte counts (dropout's keep-flag slots) and the ALiBi-only ones' (none) against the
    # traits' kSmemBytes.
    prefix = "fa2::bwd_dkdv_hopper<"
    cases = [(c, alibi_only) for c in configs.BACKWARD_HOPPER_TABLE.values()
             if configs.hopper_bwd_takes_mods(c.headdim, False) for alibi_only in (False, True)]
    probes = [f"__device__ int fa2_probe_{i} = "
              f"{c.name_expression('float16', 'window', mods=True, alibi_only=a)[len(prefix):-1]}::kSmemBytes;"
              for i, (c, a) in enumerate(cases)]
    ptx = _probe_ptx("bwd_hopper", probes, "90a")
    for i, (config, alibi_only) in enumerate(cases):
        found = re.search(rf"fa2_probe_{i} = (\d+);", ptx)
        smem_bytes = config.smem_bytes(mods=True, alibi_only=alibi_only)
        assert found and int(found[1]) == smem_bytes <= 227 * 1024, (config, alibi_only)
    assert len(cases) == 2 * len(configs.HOPPER_BWD_MODS_HEADDIMS)
    # (padded calls with modifiers only, at the row's own head dim)
    row = configs.BACKWARD_HOPPER_TABLE[192]
    for kw in (dict(mods=True, varlen=True), dict(mods=False), dict(mods=True, score_dim=160)):
        with pytest.raises(ValueError, match="ALiBi-only"):
            row.name_expression("float16", "window", alibi_only=True, **kw)


def test_hopper_backward_turn_planes_match_the_kernel():
    # The deterministic turn flags a call allocates (configs.HopperBwdConfig.turn_planes) against the traits'
    # kTurnPlanes: padded and varlen, with and without modifiers, wherever the row has that kernel.
    prefix = "fa2::bwd_dkdv_hopper<"
    cases = [(c, varlen, mods) for c in configs.BACKWARD_HOPPER_TABLE.values() for varlen in (False, True)
             for mods in (False, True) if not mods or configs.hopper_bwd_takes_mods(c.headdim, varlen)]
    probes = [f"__device__ int fa2_probe_{i} = "
              f"{c.name_expression('float16', 'window' if mods else 'none', mods=mods, varlen=varlen)[len(prefix):-1]}"
              f"::kTurnPlanes;" for i, (c, varlen, mods) in enumerate(cases)]
    ptx = _probe_ptx("bwd_hopper", probes, "90a")
    for i, (config, varlen, mods) in enumerate(cases):
        found = re.search(rf"fa2_probe_{i} = (\d+);", ptx)
        assert found and int(found[1]) == config.turn_planes, (config, varlen, mods)
    assert {c.headdim for c, v, m in cases if c.turn_planes == 2} == {192, 256}


def test_hopper_forward_is_chosen_only_where_it_runs():
    for d in (64, 128, 192, 256):
        assert configs.hopper_forward_config(90, d, "bfloat16") is configs.FORWARD_HOPPER_TABLE[d]
        assert configs.hopper_forward_config(90, d, "float16") is configs.FORWARD_HOPPER_TABLE[d]
        for arch in (80, 86, 89, 100, 120):  # wgmma is sm_90a's own: not even later GPUs run it
            assert configs.hopper_forward_config(arch, d, "bfloat16") is None
        # dropout: the modifier rows (varlen not at 256), as softcap and ALiBi
        dropped = configs.hopper_forward_config(90, d, "bfloat16", dropout=True)
        assert dropped is configs.hopper_forward_row(d, mods=True)
        assert (dropped is configs.FORWARD_HOPPER_TABLE[d]) == (d != 64)  # (d = 64: two consumer warpgroups)
        dropped = configs.hopper_forward_config(90, d, "bfloat16", dropout=True, varlen=True)
        assert dropped is (configs.hopper_forward_row(d, mods=True) if d in (64, 128, 192) else None)
        assert configs.hopper_forward_config(80, d, "bfloat16", dropout=True) is None
        assert configs.hopper_forward_config(90, d, "bfloat16", varlen=True) is configs.FORWARD_HOPPER_TABLE[d]
        # paged K/V (varlen) runs where packed K/V does (the choice does not look at it), on its own instantiation
        row = configs.FORWARD_HOPPER_TABLE[d]
        paged = row.name_expression("bfloat16", "causal", varlen=True, paged=True)
        assert paged.endswith("kMaskCausal, true, true>>") and paged in configs.hopper_forward_instantiations()
        with pytest.raises(ValueError, match="varlen"):
            row.name_expression("bfloat16", "none", paged=True)
    for d in (32, 40, 96, 120, 160, 224):
        assert configs.hopper_forward_config(90, d, "bfloat16") is None
    for d, shortest in configs.HOPPER_MASKED_MIN_SEQLEN.items():  # masked calls: from a length on
        for mask, varlen in itertools.product(("causal", "window"), (False, True)):
            kw = dict(mask=mask, varlen=varlen)
            assert configs.hopper_forward_config(90, d, "float16", seqlen_q=shortest - 1, **kw) is None
            assert configs.hopper_forward_config(90, d, "float16", seqlen_q=shortest, **kw) is not None
        assert configs.hopper_forward_config(90, d, "float16", mask="none", seqlen_q=1) is not None
    with pytest.raises(ValueError, match="dtype"):
        configs.hopper_forward_config(90, 64, "float32")


def test_hopper_forward_takes_softcap_alibi_and_dropout():
    # Softcap, ALiBi and dropout run on the Hopper forward at the head dims of HOPPER_MODS_HEADDIMS (padded only at
    # HOPPER_MODS_PADDED_ONLY), in their own instantiations (HopperFwdTraits' Mods) for the masks
    # forward.kernel_variant gives modifier calls: padded causal, none and window, varlen and paged window.
    from fa2cupy import forward

    names = set(configs.hopper_forward_instantiations())
    for d in configs.FORWARD_HOPPER_TABLE:
        row = configs.hopper_forward_row(d, mods=True)
        for varlen, paged in ((False, False), (True, False), (True, True)):
            for causal in (False, True):
                mask, mods, _, _ = forward.kernel_variant(causal, (-1, -1), 30.0, False, causal_mods=not varlen,
                                                          unmasked_mods=not varlen)
                chosen = configs.kernel_rows(90, d, "bfloat16", mask, mods, varlen, seqlen_q=4096)
                dropped = configs.kernel_rows(90, d, "bfloat16", mask, mods, varlen, seqlen_q=4096, dropout=True)
                if not configs.hopper_takes_mods(d, varlen):
                    assert chosen.forward.family == "fwd" and dropped.forward.family == "fwd"
                    assert row.name_expression("bfloat16", mask, mods, varlen, paged) not in names
                    continue
                assert chosen.forward is row and dropped.forward is row  # (dropout: the same instantiation)
                name = row.name_expression("bfloat16", mask, mods, varlen, paged)
                assert name.endswith(f"{str(varlen).lower()}, {str(paged).lower()}, true>>") and name in names
    # the modifier rows' head dims: every width, varlen calls not at 256; d = 64's on two consumer warpgroups (its
    # plain row's three spill with the modifiers)
    assert [d for d in configs.FORWARD_HOPPER_TABLE if configs.hopper_takes_mods(d, False)] == [64, 128, 192, 256]
    assert [d for d in configs.FORWARD_HOPPER_TABLE if configs.hopper_takes_mods(d, True)] == [64, 128, 192]
    assert configs.hopper_forward_row(64, mods=True).consumer_wgs == 2
    assert configs.FORWARD_HOPPER_TABLE[64].consumer_wgs == 3
    # the plain instantiations keep their names (and machine code)
    assert configs.FORWARD_HOPPER_TABLE[128].name_expression("float16", "causal").endswith("fa2::kMaskCausal>>")
    # the ALiBi-only kernels (HopperFwdTraits::kAlibiOnly): padded, without a mask and causal, at every modifier
    # head dim and dtype; no windowed or varlen one
    alibi_only = {n for n in names if n.endswith("false, false, true, true>>")}
    assert alibi_only == {configs.hopper_forward_row(d, mods=True).name_expression(dtype, mask, True, alibi_only=True)
                          for d in configs.HOPPER_MODS_HEADDIMS for dtype in configs.DTYPE_TAGS
                          for mask in ("none", "causal")}
    for kw in (dict(mask="window"), dict(mask="none", varlen=True), dict(mask="none", mods=False)):
        with pytest.raises(ValueError, match="ALiBi-only"):
            configs.hopper_forward_row(128, mods=True).name_expression("float16", **dict(dict(mods=True), **kw),
                                                                        alibi_only=True)


def test_hopper_forward_wide_rows():
    # d=192 and 256: two consumer warpgroups on 64-key tiles, run wherever d=64 and 128 would be.
    for d in (192, 256):
        row = configs.FORWARD_HOPPER_TABLE[d]
        assert row.headdim == d and row.consumer_wgs == 2 and row.block_n == 64
        for dtype, varlen in itertools.product(("float16", "bfloat16"), (False, True)):
            assert configs.hopper_forward_config(90, d, dtype, varlen=varlen) is row
        for mask, (varlen, paged) in itertools.product(configs.MASKS, ((False, False), (True, False), (True, True))):
            assert row.name_expression("float16", mask, varlen=varlen, paged=paged) in \
                configs.hopper_forward_instantiations()


def test_hopper_backward_is_chosen_only_where_it_runs():
    for d in (64, 128, 192, 256):
        row = configs.BACKWARD_HOPPER_TABLE[d]
        assert configs.hopper_backward_config(90, d, mods=False) is row
        for arch in (80, 86, 89, 100, 120):
            assert configs.hopper_backward_config(arch, d, mods=False) is None
        assert configs.hopper_backward_config(90, d, mods=True) is None
        # softcap and ALiBi: the modifier rows at every head dim (varlen: not at 128), the window variant; dropout
        # there too except at HOPPER_BWD_NO_DROPOUT (d = 64: no registers for its keep flags)
        takes = configs.hopper_bwd_takes_mods(d, varlen=False)
        assert takes and configs.hopper_bwd_takes_mods(d, varlen=True) == (d != 128)
        assert configs.hopper_backward_config(90, d, mods=True, with_mods=True) is row
        assert (configs.hopper_backward_config(90, d, mods=True, with_mods=True, varlen=True) is row) == (d != 128)
        dropped = d not in configs.HOPPER_BWD_NO_DROPOUT
        assert configs.hopper_bwd_takes_mods(d, varlen=False, dropout=True) == dropped
        assert (configs.hopper_backward_config(90, d, mods=True, dropout=True, with_mods=True) is row) == dropped
        assert configs.hopper_backward_config(90, d, mods=False, dropout=True, with_mods=True) is (
            row if dropped else None)  # (dropout alone is a modifier call)
        assert (configs.hopper_backward_config(90, d, mods=True, dropout=True, with_mods=True, varlen=True) is row) \
            == (dropped and d != 128)
        assert configs.hopper_backward_config(90, d, mods=True, dropout=True) is None  # (hopper_backward_mods=False)
        assert configs.hopper_backward_config(80, d, mods=True, dropout=True, with_mods=True) is None
        rows = configs.kernel_rows(90, d, "bfloat16", "window", mods=True, dropout=True)
        assert (rows.backward is row if dropped else rows.backward.family == "bwd") and rows.backward_dq is None
        off = configs.kernel_rows(90, d, "bfloat16", "window", mods=True, dropout=True,
                                  options=KernelOptions(hopper_backward_mods=False))
        assert off.backward.family == "bwd"
        if takes:
            name = row.name_expression("float16", "window", mods=True)
            assert name.endswith("fa2::kMaskWindow, false, true>>") and name in configs.hopper_backward_instantiations()
        else:
            with pytest.raises(ValueError, match="softcap and ALiBi"):
                row.name_expression("float16", "window", mods=True)
        assert row.name_expression("bfloat16", "causal", varlen=True).endswith("fa2::kMaskCausal, true>>")
        # (deterministic=True is a run-time switch of the same kernel: its dQ reductions take turns)
        assert row.name_expression("float16", "none", atomic_dq=False) == row.name_expression("float16", "none")
        with pytest.raises(ValueError, match="softcap and ALiBi"):
            row.name_expression("float16", "causal", mods=True)
        rows = configs.kernel_rows(90, d, "bfloat16", deterministic=True)
        assert rows.backward is row and rows.backward_dq is None  # (no separate dQ kernel)
        assert configs.kernel_rows(80, d, "bfloat16", deterministic=True).backward_dq is not None
    assert configs.HOPPER_BWD_NO_DROPOUT == (64,)  # (dropout's rows: 128, 192 and 256, varlen 192 and 256)
    # Head dim 64 splits dQ_i by keys: by columns each warpgroup's 32 would be half a swizzled slab.
    assert configs.BACKWARD_HOPPER_TABLE[64].dq_by_keys and not configs.BACKWARD_HOPPER_TABLE[128].dq_by_keys
    for d in (32, 40, 96, 160, 224):
        assert configs.hopper_backward_config(90, d, mods=False) is None


def test_hopper_backward_wide_rows():
    # d=192 and 256: 64-key blocks, 64 query rows a step, dQ_i by columns; d = 256 with a one-slot ring.
    for d in (192, 256):
        row = configs.BACKWARD_HOPPER_TABLE[d]
        assert row.headdim == d and row.wide and row.block_n == 64 and row.block_m == 64 and not row.dq_by_keys
        assert configs.hopper_backward_config(90, d, mods=False) is row
        for dtype, mask, varlen in itertools.product(("float16", "bfloat16"), configs.MASKS, (False, True)):
            assert row.name_expression(dtype, mask, varlen=varlen) in configs.hopper_backward_instantiations()
    assert configs.BACKWARD_HOPPER_TABLE[256].stages == 1
    for d in (64, 128):
        assert not configs.BACKWARD_HOPPER_TABLE[d].wide and configs.BACKWARD_HOPPER_TABLE[d].block_n == 128


def test_hopper_backward_score_dims():
    """A call narrower than its Hopper backward row (configs.padded_call_width) takes the row's instantiation whose
    score products S^T and dP^T stop at the smallest HOPPER_BWD_SCORE_DIMS entry that holds its head dim (k16 steps
    of zero columns left out), where the row has one; modifier calls and the varlen window kernel at 128 keep the
    row's own."""
    assert configs.HOPPER_BWD_SCORE_DIMS == {64: (), 128: (80, 96), 192: (160,), 256: ()}
    cases = {(80, 128): 80, (72, 128): 80, (66, 128): 80, (81, 128): 96, (96, 128): 96, (100, 128): 128,
             (128, 128): 128, (160, 192): 160, (136, 192): 160, (168, 192): 192, (224, 256): 256, (40, 64): 64}
    for (d, width), want in cases.items():
        for mask, varlen in itertools.product(configs.MASKS, (False, True)):
            got = configs.hopper_bwd_score_dim(d, width, False, mask, varlen)
            assert got == (width if (width, mask, varlen) == (128, "window", True) else want), (d, width, mask, varlen)
            assert configs.hopper_bwd_score_dim(d, width, True, mask, varlen) == width  # (modifiers)
            row = configs.BACKWARD_HOPPER_TABLE[width]
            name = row.name_expression("bfloat16", mask, varlen=varlen, score_dim=got)
            assert name in configs.hopper_backward_instantiations()
            if got != width:
                assert name.endswith(f", {str(varlen).lower()}, false, {got}>>")
    row = configs.BACKWARD_HOPPER_TABLE[128]
    assert row.name_expression("float16", "none", score_dim=128) == row.name_expression("float16", "none")
    for bad in dict(score_dim=112), dict(score_dim=80, mods=True, mask="window"):
        with pytest.raises(ValueError, match="score products"):
            row.name_expression("float16", bad.pop("mask", "none"), **bad)


def test_every_table_entry_fits_its_family():
    limits = {"sm80": 163 * 1024, "sm86": 99 * 1024, "sm90": 227 * 1024}
    for (family, width), config in [*configs.FORWARD_TABLE.items(), *configs.FORWARD_MASKED_TABLE.items()]:
        assert config.headdim == width
        assert config.smem_bytes <= limits[family], (family, width, config)
        assert config.block_m % (16 * config.warps) == 0
    assert {family for family, _ in configs.FORWARD_TABLE} == set(configs.ARCH_FAMILIES)
    assert {width for _, width in configs.FORWARD_TABLE} == set(configs.HEADDIMS)
    for table in (configs.BACKWARD_TABLE, configs.BACKWARD_DQ_TABLE):
        assert set(table) == set(configs.FORWARD_TABLE)
    for (family, width), config in [*configs.BACKWARD_TABLE.items(), *configs.BACKWARD_CAUSAL_TABLE.items()]:
        assert config.headdim == width and config.block_n % (16 * config.warps_keys) == 0
        assert config.smem_bytes(atomic_dq=True) <= limits[family], (family, width, config)
        assert (config.block_m // 16) <= config.warps and width % (16 * config.dslices) == 0
    for (family, width), config in configs.BACKWARD_DQ_TABLE.items():
        assert config.headdim == width and config.smem_bytes <= limits[family], (family, width, config)
    for (family, width), config in (*configs.DECODE_TABLE.items(), *configs.DECODE_DEEP_TABLE.items(),
                                    *configs.DECODE_WARP_TABLE.items()):
        assert config.headdim == width and config.smem_bytes <= limits[family], (family, width, config)
    for key, twin in configs.DECODE_DEEP_TABLE.items():  # the twin shares its row's tile shape (the split count)
        assert twin.deep_ring and dataclasses.replace(twin, deep_ring=False) == configs.DECODE_TABLE[key]
    for key, twin in configs.DECODE_WARP_TABLE.items():  # likewise (its ring depth is its own)
        assert twin.warp_items and dataclasses.replace(twin, warp_items=False, deep_ring=False) \
            == configs.DECODE_TABLE[key]
    assert set(configs.DECODE_TABLE) == set(configs.FORWARD_TABLE)


def test_decode_shared_memory_matches_the_kernel(monkeypatch):
    # DecodeConfig's byte counts (what a launch asks for) against DecodeTraits' own constants, read from the PTX of
    # a probe variable compiled with the kernel source: shipped rows and tuning candidates (bench/dev/candidates.py).
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), os.pardir, "bench", "dev"))
    import candidates

    warp_items_rings = {dataclasses.replace(c, deep_ring=not c.deep_ring) for c in configs.DECODE_WARP_TABLE.values()}
    rows = sorted(set(configs.DECODE_TABLE.values()) | set(configs.DECODE_DEEP_TABLE.values())
                  | set(configs.DECODE_WARP_TABLE.values()) | warp_items_rings | set(candidates.DECODE_CANDIDATES),
                  key=repr)
    probes = []
    for i, config in enumerate(rows):
        traits = config.name_expression("float16", False, False)[len("fa2::decode_attention<"):-1]
        probes.append(f"__device__ int fa2_probe_{i}_one = {traits}::kSmemBytes;")
        probes.append(f"__device__ int fa2_probe_{i}_walk = {traits}::kPersistentSmemBytes;")
    ptx = _probe_ptx("decode", probes, "80")
    for i, config in enumerate(rows):
        one = re.search(rf"fa2_probe_{i}_one = (\d+);", ptx)
        walk = re.search(rf"fa2_probe_{i}_walk = (\d+);", ptx)
        assert one and walk, f"probe {i} not in the PTX"
        assert (int(one[1]), int(walk[1])) == (config.smem_bytes, config.persistent_smem_bytes), config


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["fwd_hopper", "bwd_hopper"])
def test_source_inlines_headers_once(family):
    text = build.source(family)
    assert '#include "' not in text
    headers = sorted(build.kernel_dir().rglob("*.cuh"))
    assert len(headers) > 10
    for header in headers:  # (a header's opening comment, up to its #pragma once, marks its text)
        opening = header.read_text().split("#pragma once")[0]
        assert len(opening) > 40 and text.count(opening) <= 1, header
    assert text.count((build.kernel_dir() / "common" / "types.cuh").read_text().split("#pragma once")[0]) == 1


def test_every_kernel_source_is_shipped():
    # The files build.py names exist, and pyproject.toml's package data (globs in cuda/) takes every source file.
    root = build.kernel_dir()
    for family, path in build.FAMILY_SOURCES.items():
        assert (root / path).is_file(), family
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    globs = re.search(r'^"fa2cupy\.cuda" = \[(.*)\]$', pyproject, re.MULTILINE)[1]
    shipped = {p for pattern in re.findall(r'"([^"]+)"', globs) for p in root.glob(pattern)}
    assert shipped == set(root.rglob("*.cu")) | set(root.rglob("*.cuh"))


def test_use_sources_builds_from_another_copy(tmp_path):
    """bench/'s A/B timings build kernels from a copy of cuda/: build.use_sources switches every family's
    source to it and forgets what was built, and None switches back."""
    own = build.source("fwd")
    copy = tmp_path / "cuda"
    shutil.copytree(build.kernel_dir(), copy)
    types = copy / "common" / "types.cuh"
    types.write_text("// another copy\n" + types.read_text())
    try:
        build.use_sources(copy)
        assert build.kernel_dir() == copy.resolve()
        assert "// another copy" in build.source("fwd") and "// another copy" not in own
    finally:
        build.use_sources(None)
    assert build.source("fwd") == own


def test_use_sources_reads_a_flat_copy(tmp_path):
    """A copy of cuda/ from before its folders (every family as <family>.cu beside one header) still builds: the A/B
    timings compare kernels across the change of layout."""
    (tmp_path / "primitives.cuh").write_text("#pragma once\n// the old header\n")
    (tmp_path / "fwd_hopper.cu").write_text('#include "primitives.cuh"\n// the old kernel\n')
    try:
        build.use_sources(tmp_path)
        assert build.source("fwd_hopper") == "#pragma once\n// the old header\n\n// the old kernel\n"
    finally:
        build.use_sources(None)
