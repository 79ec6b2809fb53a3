"""One Hopper forward launch (bf16, d=128, s=8k, 16 heads, batch 2) for ncu:

    ncu --clock-control none -k regex:flash_fwd_hopper --section SpeedOfLight --section WarpStateStats \
        --section MemoryWorkloadAnalysis python bench/hopper_profile.py [--mma]
"""
import sys

import torch

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402
from fa2cupy import configs, forward  # noqa: E402

forward.HOPPER = "--mma" not in sys.argv
configs.HOPPER_MASKED_MIN_SEQLEN.update(dict.fromkeys(configs.HOPPER_MASKED_MIN_SEQLEN, 0))
causal = "--causal" in sys.argv
q, k, v = (torch.randn(2, 8192, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(2):
    fa2cupy.flash_attn_func(q, k, v, causal=causal)
torch.cuda.synchronize()
