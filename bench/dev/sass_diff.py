"""Which shipped kernels' machine code a change touches: SASS of two trees compared, no GPU needed.

    python bench/dev/sass_diff.py OLD_REV fwd 80 [filter ...]      # e.g. OLD_REV = HEAD~1, filter = kMaskNone
    python bench/dev/sass_diff.py OLD_REV fwd_hopper 90a            # the Hopper kernels (fwd_hopper, bwd_hopper)
    python bench/dev/sass_diff.py OLD_REV decode 90 --all --nvcc    # every instantiation, compiled by nvcc

Takes each kernel family's source (``fa2cupy.build.source``: the family's file with its headers inlined, whatever
the layout of that tree's cuda/) from OLD_REV (unpacked by ``git archive``, no worktree) and from the working tree,
compiles the instantiations both ship for ARCH (the tables of that arch's families: 80 -> sm80 and sm86, 90 ->
sm90, 90a -> the Hopper lists; ``--all``: every instantiation of the family) and that contain every filter string,
disassembles them with nvdisasm and prints SAME or DIFF per kernel, with ptxas's register counts where they differ.
Kernel-parameter offsets, the kernel's own symbol, label numbers, runs of blanks and the numbers NVRTC gives its
internal helpers (which depend on the other kernels in the module) are normalised, so a kernel whose instructions
did not change prints SAME even when the parameter list grew: the proof that a change left a kernel's code alone.

The compiler is NVRTC with the runtime's options (what fa2cupy builds on a GPU), or nvcc with ``--nvcc``. Results
are kept under ~/.cache/fa2cupy/sass_diff/, keyed by the compiler and the inlined source's content, so a second
comparison against the same revision, or of a family the change left alone, compiles nothing again. Needs nvdisasm
(``pip install nvidia-cuda-nvdisasm``; found on PATH, beside nvcc or in that wheel); ``--nvcc`` needs nvcc (12.8+).
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NORMALISATION = "2"  # (part of the cache key: bump when _disassemble's normalisation changes)
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fa2cupy" / "sass_diff"

#: The instantiation lists of each family, and the table families whose rows a compile target stands for.
LISTERS = {"fwd": "configs.forward_instantiations", "bwd": "configs.backward_instantiations",
           "decode": "decode.instantiations", "fwd_hopper": "configs.hopper_forward_instantiations",
           "bwd_hopper": "configs.hopper_backward_instantiations"}
ARCH_TABLES = {"80": ("sm80", "sm86"), "90": ("sm90",)}


def _tool(name: str) -> str:
    found = shutil.which(name) or next((str(p) for p in (
        *Path("/usr/local").glob(f"cuda*/bin/{name}"),
        *Path(sys.prefix).glob(f"lib/python3*/site-packages/nvidia/cu1*/bin/{name}"),
    ) if p.is_file()), None)
    if found is None:
        sys.exit(f"{name} not found (nvdisasm: pip install nvidia-cuda-nvdisasm)")
    return found


def tree_info(tree: Path, family: str, arch: str, every: bool) -> dict:
    """The family's inlined source, NVRTC options and shipped instantiations for `arch`, as `tree` defines them (its
    own fa2cupy, in a child process, so that two trees' modules never mix)."""
    lister = LISTERS[family]
    if family.endswith("_hopper") or every:
        names = f"{lister}()"  # (the Hopper lists are sm_90a's alone)
    else:
        names = f"sorted(set().union(*({lister}(t) for t in {ARCH_TABLES[arch]!r})))"
    code = (f"import json, sys\nsys.path.insert(0, {str(tree)!r})\nfrom fa2cupy import build, configs, decode\n"
            f"json.dump({{'source': build.source({family!r}), 'options': list(build.NVRTC_OPTIONS), "
            f"'names': sorted({names})}}, sys.stdout)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tree)
    if out.returncode:
        sys.exit(f"{tree}: {out.stderr}")
    return json.loads(out.stdout)


def _disassemble(cubin: bytes, work: Path) -> dict[str, list[str]]:
    """{mangled kernel: normalised instructions} of one cubin."""
    fd, path = tempfile.mkstemp(suffix=".cubin", dir=work)
    with os.fdopen(fd, "wb") as f:
        f.write(cubin)
    text = subprocess.run([_tool("nvdisasm"), "-c", path], capture_output=True, text=True, check=True).stdout
    os.unlink(path)
    kernels: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        section = re.match(r"\s*\.section\s+\.text\.([^,\s]+)", line)
        if section:
            current = section.group(1)
            kernels[current] = []
            continue
        instruction = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if instruction and current:
            ins = re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][param]", instruction.group(1))
            ins = re.sub(r"__internal_\d+_", "__internal_", ins)  # (helpers numbered per module)
            ins = re.sub(r"\s+", " ", ins)  # (nvdisasm pads branch-target notes by the labels' widths)
            kernels[current].append(re.sub(r"`\(_Z\w+\)", "`(self)", ins))
    for name, lines in kernels.items():
        labels: dict[str, str] = {}
        kernels[name] = [re.sub(r"\.L_x_\d+", lambda m: labels.setdefault(m.group(0), f"L{len(labels)}"), x)
                         for x in lines]
    return kernels


def _registers(log: str) -> dict[str, int]:
    """ptxas -v log -> {mangled kernel: registers}."""
    found = {}
    for entry in log.split("Compiling entry function")[1:]:
        name = re.search(r"'([^']+)'", entry).group(1)
        regs = re.search(r"Used (\d+) registers", entry)
        found[name] = int(regs.group(1)) if regs else -1
    return found


def _nvrtc_cubin(prog: int) -> bytes:
    """The cubin of a compiled NVRTC program, through the library CuPy loaded (CuPy's getCUBIN drops its last byte)."""
    import ctypes

    path = next(line.split()[-1] for line in open("/proc/self/maps") if "libnvrtc.so" in line)
    lib = ctypes.CDLL(path)
    size = ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(ctypes.c_void_p(prog), ctypes.byref(size)):
        sys.exit("nvrtcGetCUBINSize failed")
    buffer = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetCUBIN(ctypes.c_void_p(prog), buffer):
        sys.exit("nvrtcGetCUBIN failed")
    return buffer.raw


def _program(source: str, names: list[str], options) -> tuple[int, dict[str, str]]:
    """A compiled NVRTC program of `source` with `names` and {mangled name: name expression}."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "sass_diff.cu", (), ())
    for name in names:
        nvrtc.addNameExpression(prog, name)
    try:
        nvrtc.compileProgram(prog, tuple(options))
    except nvrtc.NVRTCError:
        log = nvrtc.getProgramLog(prog)
        nvrtc.destroyProgram(prog)
        sys.exit(f"NVRTC failed:\n{log}")
    return prog, {nvrtc.getLoweredName(prog, name): name for name in names}


def _compile_nvrtc(source: str, options: list[str], arch: str, names: list[str], work: Path):
    from cupy_backends.cuda.libs import nvrtc

    prog, lowered = _program(source, names, (*options, f"-arch=sm_{arch}", "-Xptxas=-v"))
    try:
        return _disassemble(_nvrtc_cubin(prog), work), _registers(nvrtc.getProgramLog(prog)), lowered
    finally:
        nvrtc.destroyProgram(prog)


def _compile_nvcc(source: str, options: list[str], arch: str, names: list[str], work: Path):
    from cupy_backends.cuda.libs import nvrtc

    fd, path = tempfile.mkstemp(suffix=".cu", dir=work)
    with os.fdopen(fd, "w") as f:
        f.write(source + "".join(f"\nvoid* fa2_keep_{i} = (void*)&{n};" for i, n in enumerate(names)) + "\n")
    target = f"-gencode=arch=compute_{arch},code=sm_{arch}"  # (sm_90a: -arch=sm_90a also runs a plain sm_90 pass)
    out = subprocess.run([_tool("nvcc"), "-cubin", target, "-std=c++17", "-w", "-Xptxas=-v", "-o", f"{path}.cubin",
                          path], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"nvcc failed:\n{out.stderr}")
    # (the mangled names from NVRTC's front end alone)
    prog, lowered = _program(source, names, (*options, f"-arch=compute_{arch}", "-fdevice-syntax-only"))
    nvrtc.destroyProgram(prog)
    return _disassemble(Path(f"{path}.cubin").read_bytes(), work), _registers(out.stderr), lowered


def sass(info: dict, arch: str, names: list[str], nvcc: bool, jobs: int, work: Path) -> dict[str, dict]:
    """{name expression: {"sass": normalised instructions, "registers": n}} of `names` built from `info`."""
    chunks = [names[i:i + 8] for i in range(0, len(names), 8)]

    def one(chunk):
        if nvcc:
            return _compile_nvcc(info["source"], info["options"], arch, chunk, work)
        return _compile_nvrtc(info["source"], info["options"], arch, chunk, work)

    result = {}
    with ThreadPoolExecutor(jobs) as pool:  # (NVRTC releases the GIL; nvcc runs as a child process)
        for kernels, registers, lowered in pool.map(one, chunks):
            for mangled, lines in kernels.items():
                if mangled in lowered:
                    result[lowered[mangled]] = {"sass": lines, "registers": registers.get(mangled, -1)}
    missing = set(names) - set(result)
    if missing:
        sys.exit(f"no SASS found for {sorted(missing)[:3]} ...")
    return result


def cached_sass(info: dict, arch: str, names: list[str], nvcc: bool, jobs: int, work: Path) -> dict[str, dict]:
    """sass() through a cache keyed by the source's content (so an unchanged family, or OLD_REV's, compiles once)."""
    key = hashlib.sha256("\0".join([_compiler_version(nvcc), info["source"], *info["options"], arch,
                                     NORMALISATION]).encode())
    key = key.hexdigest()[:24]
    cache = CACHE / f"{'nvcc' if nvcc else 'nvrtc'}_{key}.json.gz"
    known = json.loads(gzip.decompress(cache.read_bytes())) if cache.is_file() else {}
    todo = [n for n in names if n not in known]
    if todo:
        known.update(sass(info, arch, todo, nvcc, jobs, work))
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}")
        partial.write_bytes(gzip.compress(json.dumps(known).encode()))
        partial.replace(cache)
    return {n: known[n] for n in names}


def _compiler_version(nvcc: bool) -> str:
    if nvcc:
        return subprocess.run([_tool("nvcc"), "--version"], capture_output=True, text=True).stdout
    from cupy_backends.cuda.libs import nvrtc

    return f"nvrtc {nvrtc.getVersion()}"


def old_tree(rev: str, work: Path) -> Path:
    """OLD_REV's fa2cupy/ and cuda/, unpacked by git archive."""
    tree = work / "old"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", f"{rev}^{{commit}}", "fa2cupy", "cuda"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old_rev")
    parser.add_argument("family", choices=sorted(LISTERS))
    parser.add_argument("arch", choices=("80", "90", "90a"))
    parser.add_argument("filters", nargs="*", help="substrings every compared name must contain")
    parser.add_argument("--all", action="store_true", help="every instantiation of the family, not the arch's own")
    parser.add_argument("--nvcc", action="store_true", help="compile with nvcc instead of NVRTC")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--show", type=int, default=0, help="print this many lines of the first DIFF's diff")
    parser.add_argument("--tree", type=Path, default=ROOT,
                        help="the tree to compare with OLD_REV (its fa2cupy/ and cuda/; default: this working tree)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print the DIFF lines and the summary only")
    args = parser.parse_args()
    if args.family.endswith("_hopper") != (args.arch == "90a"):
        sys.exit("the Hopper families build for 90a alone, the others for 80 or 90")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        old_info = tree_info(old_tree(args.old_rev, work), args.family, args.arch, args.all)
        info = tree_info(args.tree.resolve(), args.family, args.arch, args.all)
        old_names = old_info["names"]
        names = [n for n in sorted(set(old_names) & set(info["names"])) if all(f in n for f in args.filters)]
        before = cached_sass(old_info, args.arch, names, args.nvcc, args.jobs, work)
        after = cached_sass(info, args.arch, names, args.nvcc, args.jobs, work)
    counts = {"SAME": 0, "DIFF": 0}
    shown = False
    for name in names:
        old, new = before[name], after[name]
        verdict = "SAME" if old["sass"] == new["sass"] else "DIFF"
        counts[verdict] += 1
        registers = "" if old["registers"] == new["registers"] else f"  registers {old['registers']}->{new['registers']}"
        if verdict == "DIFF" or not args.quiet:
            print(f"{verdict} {len(old['sass']):>5}/{len(new['sass']):<5} instructions  {name}{registers}")
        if verdict == "DIFF" and args.show and not shown:
            shown = True
            diff = difflib.unified_diff(old["sass"], new["sass"], "old", "new", lineterm="", n=2)
            print("\n".join(list(diff)[:args.show]))
    only = set(old_names) ^ set(info["names"])
    if only:
        print(f"({len(only)} instantiations shipped by one tree only, not compared)")
    compiler = "nvcc" if args.nvcc else "NVRTC"
    print(f"{counts['SAME']} kernels unchanged, {counts['DIFF']} changed ({args.family}, sm_{args.arch}, {compiler}, "
          f"against {args.old_rev})")


if __name__ == "__main__":
    main()
