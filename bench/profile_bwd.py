"""One backward call of fa2cupy and of SDPA flash at d=64 s=8k (bf16, non-causal), for Nsight Compute:

    ncu --clock-control none -k regex:"bwd_dkdv|flash_bwd_dq_dk_dv" -c 2 --section ... python bench/profile_bwd.py
"""

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".")
import fa2cupy  # noqa: E402

d, s = int(sys.argv[1]) if len(sys.argv) > 1 else 64, 8192
b, h = 16384 // s, 2048 // d
q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
out, lse, _ = fa2cupy.flash_attn_func(q, k, v, return_attn_probs=True)
fa2cupy.flash_attn_backward(dout, q, k, v, out, lse)
qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
    torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2).contiguous())
torch.cuda.synchronize()
