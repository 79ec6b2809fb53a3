"""Host time of cached calls, A/B in one process (the device machine's host drifts by 2x between runs, so only
interleaved rounds compare): torch allocation forms, then whole cached decode and forward calls from torch with
the allocation and stream look-up before session 25 ("old": torch.empty with a size tuple, the raw-stream
function looked up per call) and as shipped ("new"), beside SDPA. Rounds alternate; median per variant.

    python bench/host_ab.py
"""
import sys, time, statistics
sys.path.insert(0, ".")
import torch, cupy
import fa2cupy
from fa2cupy import arrays

def old_new_empty_raw(shape, dtype, framework, device):
    if framework == "torch":
        tdtype, tdevice = arrays._torch_args(dtype, device)
        t = sys.modules["torch"].empty(shape, dtype=tdtype, device=tdevice)
        return t, t.data_ptr()
    arr = arrays._cupy().empty(shape, dtype=arrays._cupy_dtype(dtype))
    return arr, arr.data.ptr

def old_stream_ptr(framework, device):
    if framework == "torch":
        torch = sys.modules["torch"]
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream
    return arrays._cupy().cuda.get_current_stream(device).ptr

new_raw, new_stream = arrays.new_empty_raw, arrays.caller_stream_ptr

def ab(variants, n=400, rounds=25):
    times = {name: [] for name, *_ in variants}
    for name, fn, setup in variants:
        setup(); [fn() for _ in range(100)]
    for r in range(rounds):
        for name, fn, setup in (variants if r % 2 == 0 else variants[::-1]):
            setup()
            t = time.perf_counter()
            for _ in range(n): fn()
            times[name].append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    for name, *_ in variants:
        print(f"  {name:<34} median {statistics.median(times[name]):6.2f} us  min {min(times[name]):6.2f}", flush=True)

nop = lambda: None
q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
dt, dev = torch.bfloat16, torch.device("cuda", 0)
shape = (1, 1, 32, 128)
tmpl = torch.empty(0, dtype=dt, device=dev)
print("allocation forms")
ab([("torch.empty(tuple, dtype=, device=)", lambda: torch.empty(shape, dtype=dt, device=dev), nop),
    ("torch.empty(*shape, dtype=, device=)", lambda: torch.empty(*shape, dtype=dt, device=dev), nop),
    ("template.new_empty(tuple)", lambda: tmpl.new_empty(shape), nop),
    ("torch.empty_like(q)", lambda: torch.empty_like(q), nop)])

def old(): arrays.new_empty_raw, arrays.caller_stream_ptr = old_new_empty_raw, old_stream_ptr
def new(): arrays.new_empty_raw, arrays.caller_stream_ptr = new_raw, new_stream
qd = q
kc = torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
lens = torch.full((1,), 1024, device="cuda", dtype=torch.int32)
qf = torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16)
kvc = lambda: fa2cupy.flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=lens)
kvl = lambda: fa2cupy.flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=lens, return_softmax_lse=True)
fwd = lambda: fa2cupy.flash_attn_func(qf, qf, qf)
qt, kt = qd.transpose(1, 2), kc.transpose(1, 2).contiguous()
qft = qf.transpose(1, 2)
def cudnn():
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, kt, enable_gqa=True)
def flash():
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(qft, qft, qft)
for label, fn, ref in (("kvcache torch", kvc, cudnn), ("kvcache torch, lse", kvl, None), ("fwd torch", fwd, flash)):
    print(label)
    rows = [("old", fn, old), ("new", fn, new)] + ([("SDPA (with its backend context)", ref, nop)] if ref else [])
    ab(rows)
new()
