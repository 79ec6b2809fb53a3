"""Which shipped kernels' machine code a change touches: SASS of two trees compared, no GPU needed.

    python bench/dev/sass_diff.py OLD_REV fwd 90 [filter ...]     # e.g. OLD_REV = HEAD~1, filter = kMaskNone
    python bench/dev/sass_diff.py OLD_REV fwd_hopper 90a           # the Hopper kernels (fwd_hopper, bwd_hopper)

Builds each kernel family's source from ``git worktree`` checkouts of OLD_REV and of the working tree, compiles
the instantiations both trees ship (and that contain every filter string) with nvcc into one cubin per tree,
disassembles them with nvdisasm, and prints SAME or DIFF per kernel. Kernel-parameter offsets, the kernel's own
symbol and label numbers are normalised, so a kernel whose instructions did not change prints SAME even when
the parameter list grew: the proof that a feature left the other kernels' code alone. Needs nvcc (CUDA 12.8+)
and nvdisasm (``pip install nvidia-cuda-nvdisasm``; found on PATH or beside nvcc or in that wheel), and c++filt.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    found = shutil.which(name) or next((str(p) for p in (
        *Path("/usr/local").glob(f"cuda*/bin/{name}"),
        *Path(sys.prefix).glob(f"lib/python3*/site-packages/nvidia/cu1*/bin/{name}"),
    ) if p.is_file()), None)
    if found is None:
        sys.exit(f"{name} not found (nvdisasm: pip install nvidia-cuda-nvdisasm)")
    return found


def _run_in(tree: Path, code: str) -> str:
    return subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tree)!r})\n{code}"],
                          capture_output=True, text=True, check=True).stdout


def shipped(tree: Path, family: str, table_family: str) -> list[str]:
    lister = {"fwd": "configs.forward_instantiations", "bwd": "configs.backward_instantiations",
              "decode": "decode.instantiations", "fwd_hopper": "configs.hopper_forward_instantiations",
              "bwd_hopper": "configs.hopper_backward_instantiations"}[family]
    argument = "" if family.endswith("_hopper") else repr(table_family)  # (the Hopper lists are sm_90a's alone)
    return _run_in(tree, f"from fa2cupy import configs, decode\nprint('\\n'.join({lister}({argument})))").splitlines()


def sass(tree: Path, family: str, arch: str, names: list[str], work: Path) -> dict[str, list[str]]:
    """{demangled kernel: normalised instructions} for `names` compiled from `tree`'s sources."""
    source = _run_in(tree, f"from fa2cupy import build\nsys.stdout.write(build.source({family!r}))")
    source += "".join(f"\nvoid* fa2_keep_{i} = (void*)&{n};" for i, n in enumerate(names)) + "\n"
    cu = work / f"{tree.name}.cu"
    cu.write_text(source)
    target = f"-gencode=arch=compute_{arch},code=sm_{arch}"  # (sm_90a: -arch=sm_90a also runs a plain sm_90 pass)
    subprocess.run([_tool("nvcc"), "-cubin", target, "-std=c++17", "-w", "-o", f"{cu}.cubin", str(cu)], check=True)
    text = subprocess.run([_tool("nvdisasm"), "-c", f"{cu}.cubin"], capture_output=True, text=True, check=True).stdout
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
            kernels[current].append(re.sub(r"`\(_Z\w+\)", "`(self)", ins))
    for name, lines in kernels.items():
        labels: dict[str, str] = {}
        kernels[name] = [re.sub(r"\.L_x_\d+", lambda m: labels.setdefault(m.group(0), f"L{len(labels)}"), x)
                         for x in lines]
    mangled = list(kernels)
    plain = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True).stdout.split("\n")
    return {_canonical(d): kernels[m] for m, d in zip(mangled, plain)}


def _canonical(demangled: str) -> str:
    name = demangled.split("(")[0]
    traits = re.search(r"Traits<([^<>]*)>", name)
    if traits:
        args = [a.strip() for a in traits.group(1).split(",")]
        # (trailing false flags are defaulted ones a newer tree may add; the arity is fixed, so this stays 1:1)
        while args[-1] == "false":
            args.pop()
        name = name[:traits.start(1)] + ", ".join(args) + name[traits.end(1):]
    return name


def main(old_rev: str, family: str, arch: str, *filters: str) -> None:
    table_family = "sm90" if arch.startswith("90") else "sm80"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        old = work / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(old), old_rev], check=True)
        try:
            names = sorted(set(shipped(old, family, table_family)) & set(shipped(ROOT, family, table_family)))
            names = [n for n in names if all(f in n for f in filters)]
            before, after = sass(old, family, arch, names, work), sass(ROOT, family, arch, names, work)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=True)
    counts = {"SAME": 0, "DIFF": 0}
    for kernel in sorted(set(before) & set(after)):
        verdict = "SAME" if before[kernel] == after[kernel] else "DIFF"
        counts[verdict] += 1
        print(f"{verdict} {len(before[kernel]):>5}/{len(after[kernel]):<5} instructions  {kernel}")
    print(f"{counts['SAME']} kernels unchanged, {counts['DIFF']} changed ({family}, sm_{arch}, against {old_rev})")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
