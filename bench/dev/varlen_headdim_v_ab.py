"""Varlen calls with v's own head dim: flash_attn_varlen_func and flash_attn_varlen_backward at d_qk 192 / d_v 128
beside the varlen square call (192 / 192) and the padded pair (flash_attn_func at 192 / 128), in rounds taking turns.

    python bench/dev/varlen_headdim_v_ab.py

fp16, 16k tokens, 10 heads, the batch's rows packed as equal-length sequences at seqlen 2k and 8k, causal and not;
each call's best round of 10-call medians (CUDA events, after 4 warm-up calls). TFLOPs/s count each product at its
own width: forward 2 sq sk (d_qk + d_v) a head, backward 2.5 times that, causal halved. "ratio" is the pair's rate
over the varlen square call's (issue 47's 0.95 bar; a pair as fast as the square call reads 320 / 384 = 0.83),
"varlen/padded" the varlen pair's over the padded pair's. Needs a CUDA GPU with CuPy.
"""
import sys
sys.path.insert(0, ".")
import cupy as cp, fa2cupy
def timeit(fn, reps=10, warm=4):
    for _ in range(warm): fn()
    ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(reps)]
    for a, b in ev:
        a.record(); fn(); b.record()
    ev[-1][1].synchronize()
    return sorted(cp.cuda.get_elapsed_time(a, b) for a, b in ev)[reps // 2]
rs = cp.random.RandomState(0)
for s in (2048, 8192):
    for causal in (False, True):
        b, h = 16384 // s, 10
        cu = cp.arange(0, b * s + 1, s, dtype=cp.int32)
        q, k = (rs.standard_normal((b * s, h, 192), dtype=cp.float32).astype(cp.float16) for _ in range(2))
        v = {w: rs.standard_normal((b * s, h, w), dtype=cp.float32).astype(cp.float16) for w in (192, 128)}
        do = {w: rs.standard_normal((b * s, h, w), dtype=cp.float32).astype(cp.float16) for w in (192, 128)}
        runs = {}
        for w in (192, 128):
            o, lse, _ = fa2cupy.flash_attn_varlen_func(q, k, v[w], cu, cu, s, s, causal=causal, return_attn_probs=True)
            runs[("fwd", "varlen", w)] = lambda w=w: fa2cupy.flash_attn_varlen_func(q, k, v[w], cu, cu, s, s, causal=causal)
            runs[("bwd", "varlen", w)] = lambda w=w, o=o, lse=lse: fa2cupy.flash_attn_varlen_backward(
                do[w], q, k, v[w], o, lse, cu, cu, s, s, causal=causal)
        P = lambda x: x.reshape(b, s, h, x.shape[-1])
        o, lse, _ = fa2cupy.flash_attn_func(P(q), P(k), P(v[128]), causal=causal, return_attn_probs=True)
        runs[("fwd", "padded", 128)] = lambda: fa2cupy.flash_attn_func(P(q), P(k), P(v[128]), causal=causal)
        runs[("bwd", "padded", 128)] = lambda: fa2cupy.flash_attn_backward(P(do[128]), P(q), P(k), P(v[128]), o, lse,
                                                                           causal=causal)
        best = {}
        keys = list(runs)
        for r in range(3):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                best[key] = min(best.get(key, 1e9), timeit(runs[key]))
        for mode in ("fwd", "bwd"):
            fl = lambda w: (2.5 if mode == "bwd" else 1) * 2 * b * h * s * s * (192 + w) / (2 if causal else 1)
            t = {key[1:]: fl(key[2]) / best[key] / 1e9 for key in runs if key[0] == mode}
            print(f"{mode} s{s} causal={causal}: varlen square {t[('varlen', 192)]:.1f}  varlen pair "
                  f"{t[('varlen', 128)]:.1f} (ratio {t[('varlen', 128)] / t[('varlen', 192)]:.3f})  padded pair "
                  f"{t[('padded', 128)]:.1f} (varlen/padded {t[('varlen', 128)] / t[('padded', 128)]:.3f})", flush=True)
