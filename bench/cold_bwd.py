"""First fa2cupy backward call in a fresh process (compile + load of the preprocess, dK/dV and dQ-conversion kernels),
d=128 causal fp16: run with an empty CUPY_CACHE_DIR (cold) and again with the same one (disk cache)."""
import sys, time
sys.path.insert(0, ".")
import cupy as cp
import fa2cupy
q, k, v, do = (cp.random.standard_normal((1, 1024, 16, 128), dtype=cp.float32).astype(cp.float16) for _ in range(4))
out, lse, _ = fa2cupy.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
cp.cuda.runtime.deviceSynchronize()
t0 = time.perf_counter(); fa2cupy.flash_attn_backward(do, q, k, v, out, lse, causal=True); cp.cuda.runtime.deviceSynchronize()
t1 = time.perf_counter(); fa2cupy.flash_attn_backward(do, q, k, v, out, lse, causal=True); cp.cuda.runtime.deviceSynchronize()
t2 = time.perf_counter()
print(f"first backward call (fresh process, cache {sys.argv[1]}): {t1 - t0:.3f} s; second: {(t2 - t1) * 1e3:.2f} ms")
