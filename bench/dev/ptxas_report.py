"""Registers and spills of shipped kernel instantiations, from ptxas via NVRTC (no GPU needed).

    python bench/dev/ptxas_report.py fwd 90 kMaskWindow bf16     # family, arch, substrings every name must contain
    python bench/dev/ptxas_report.py fwd_hopper 90a kMaskCausal   # the Hopper families, for sm_90a

Prints one line per kernel: registers, spill-store bytes, name. Check a kernel change here before spending
device time: the forward and backward rows sit at the 255-register cap, and a few more live values spill.
"""

import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fa2cupy import build, configs, decode  # noqa: E402

FAMILIES = {"fwd": configs.forward_instantiations, "bwd": configs.backward_instantiations,
            "decode": decode.instantiations, "fwd_hopper": lambda _: configs.hopper_forward_instantiations(),
            "bwd_hopper": lambda _: configs.hopper_backward_instantiations()}


def main(family: str, arch: str, *filters: str) -> None:
    table_family = "sm90" if arch.startswith("90") else "sm80"
    names = [n for n in FAMILIES[family](table_family) if all(f in n for f in filters)]
    chunks = [names[i:i + 4] for i in range(0, len(names), 4)]
    with ThreadPoolExecutor() as pool:
        results = list(pool.map(lambda chunk: build.compile_for_arch(family, chunk, arch, log=True), chunks))
    for _, log, lowered in results:
        readable = {mangled: name for name, mangled in lowered.items()}
        for entry in log.split("Compiling entry function")[1:]:
            mangled = re.search(r"'([^']+)'", entry).group(1)
            regs = re.search(r"Used (\d+) registers", entry).group(1)
            spill = re.search(r"(\d+) bytes spill stores", entry).group(1)
            print(f"{regs:>4} regs {spill:>4} B spilled  {readable.get(mangled, mangled)}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
