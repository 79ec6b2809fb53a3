"""First fa2cupy backward call in a fresh process (compile + load of the preprocess, dK/dV and dQ-conversion kernels),
causal fp16 at head dim argv[2] (default 128): run with an empty CUPY_CACHE_DIR (cold) and again with the same one
(disk cache).

    CUPY_CACHE_DIR=$(mktemp -d) python bench/cold_bwd.py cold 64"""
import sys, time
sys.path.insert(0, ".")
import cupy as cp
import fa2cupy
headdim = int(sys.argv[2]) if len(sys.argv) > 2 else 128
q, k, v, do = (cp.random.standard_normal((1, 1024, 16, headdim), dtype=cp.float32).astype(cp.float16) for _ in range(4))
out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
cp.cuda.runtime.deviceSynchronize()
t0 = time.perf_counter(); fa2cupy.flash_attn_backward(do, q, k, v, out, lse, causal=True); cp.cuda.runtime.deviceSynchronize()
t1 = time.perf_counter(); fa2cupy.flash_attn_backward(do, q, k, v, out, lse, causal=True); cp.cuda.runtime.deviceSynchronize()
t2 = time.perf_counter()
print(f"d={headdim}: first backward call (fresh process, cache {sys.argv[1]}): {t1 - t0:.3f} s; second: {(t2 - t1) * 1e3:.2f} ms")
