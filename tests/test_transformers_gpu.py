"""fa2cupy.integrations.transformers on a GPU: tiny random Llama, Qwen2, Mistral and Gemma 2 models in bfloat16 with
attn_implementation="fa2cupy" against transformers' "sdpa" ("eager" for Gemma 2, whose softcap sdpa lacks), on the
same weights. (The mapping itself is checked to float64 rounding on CPU in test_transformers.py.)

The bound. Both implementations compute attention in float32 and round its output to bfloat16 (u = 2**-8), but not
in the same order, so their logits differ by bf16 roundings propagated through the layers, however correct both are.
Rather than guess the propagation factor, each test also runs the same model in float32 ("truth") and requires
fa2cupy's error against it to be at most twice the reference implementation's own bf16 error plus
u * max|truth| (the error of rounding the result itself once):
``max|x_fa2cupy - x_truth| <= 2 * max|x_ref_bf16 - x_truth| + u * max|x_truth|``. The same bound applies to each
parameter's gradient after one training step. A wrong mask or window changes logits by O(1) and fails it.
"""

from __future__ import annotations

import pytest

from gpu_helpers import UNIT_ROUNDOFF, torch_cuda

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")

U = UNIT_ROUNDOFF["bf16"]
MODELS = ["llama", "qwen2", "mistral", "gemma2"]
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def torch():
    torch = torch_cuda()
    import fa2cupy.integrations.transformers  # noqa: F401 -- registers "fa2cupy"

    return torch


def _config(name):
    c = transformers
    if name == "llama":
        return c.LlamaConfig(**COMMON)
    if name == "qwen2":
        return c.Qwen2Config(**COMMON)
    if name == "mistral":
        return c.MistralConfig(**COMMON, sliding_window=16)
    return c.Gemma2Config(**COMMON, head_dim=16, sliding_window=16, attn_logit_softcapping=20.0,
                          final_logit_softcapping=None, query_pre_attn_scalar=16)


def _models(torch, name):
    """{"fa2cupy": bf16, "ref": bf16 sdpa/eager, "truth": float32 sdpa/eager}, same weights, on CUDA."""
    ref_impl = "eager" if name == "gemma2" else "sdpa"
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_config(name), attn_implementation=ref_impl)
    out = {}
    for key, impl, dtype in (("fa2cupy", "fa2cupy", torch.bfloat16), ("ref", ref_impl, torch.bfloat16),
                             ("truth", ref_impl, torch.float32)):
        m = transformers.AutoModelForCausalLM.from_config(_config(name), attn_implementation=impl)
        m.load_state_dict(base.state_dict())
        out[key] = m.to(device="cuda", dtype=dtype).eval()
    return out


def _batch(torch, lengths=(48, 30, 41), seqlen=48, side="left"):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (len(lengths), seqlen), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        if side == "left":
            mask[i, seqlen - n:] = 1
        else:
            mask[i, :n] = 1
    return ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()


def _bound(truth, ref):
    return 2 * (ref.float() - truth).abs().max().item() + U * truth.abs().max().item()


def _assert_within(got, ref, truth, what):
    err = (got.float() - truth).abs().max().item()
    bound = _bound(truth, ref)
    assert err <= bound, f"{what}: fa2cupy's error {err:.3g} > bound {bound:.3g}"


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", MODELS)
def test_gpu_padded_logits(torch, name, side):
    models = _models(torch, name)
    ids, mask = _batch(torch, side=side)
    with torch.no_grad():
        logits = {k: m(ids, attention_mask=mask).logits for k, m in models.items()}
    keep = mask.bool()  # padded positions are don't-care
    _assert_within(logits["fa2cupy"][keep], logits["ref"][keep], logits["truth"][keep], f"{name} logits")


@pytest.mark.parametrize("name", MODELS)
def test_gpu_training_step_gradients(torch, name):
    models = _models(torch, name)
    ids, mask = _batch(torch, side="right")
    labels = ids.masked_fill(mask == 0, -100)
    grads = {}
    for key, m in models.items():
        m.train()
        m.zero_grad()
        m(ids, attention_mask=mask, labels=labels).loss.backward()
        grads[key] = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert grads["fa2cupy"].keys() == grads["truth"].keys()
    for n in grads["truth"]:
        _assert_within(grads["fa2cupy"][n], grads["ref"][n], grads["truth"][n], f"{name} grad {n}")


def _greedy(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, pad_token_id=0, eos_token_id=None, **kw)


def _assert_same_greedy_path(torch, ours, ref, truth):
    """The same tokens; where they part, the reference's top two scores were within the bound of each other (a
    near tie that bf16 rounding may break either way), and the scores agree within the bound up to there (or up to
    where float32 itself takes another token: past it the three runs see different contexts)."""
    for step, (a, b, t) in enumerate(zip(ours.scores, ref.scores, truth.scores)):
        _assert_within(a, b, t, f"scores at step {step}")
        pa, pb = a.argmax(-1), b.argmax(-1)
        if not torch.equal(t.argmax(-1), pb):
            return
        if not torch.equal(pa, pb):
            top2 = b.float().topk(2, dim=-1).values
            gap = (top2[:, 0] - top2[:, 1])[pa != pb].max().item()
            assert gap <= _bound(t, b), f"tokens part at step {step} though the reference's margin was {gap:.3g}"
            return
    assert torch.equal(ours.sequences, ref.sequences)


@pytest.mark.parametrize("name", MODELS)
def test_gpu_greedy_generation_dynamic_cache(torch, name):
    models = _models(torch, name)
    ids, mask = _batch(torch, lengths=(20, 11, 16), seqlen=20)
    outs = {k: _greedy(m, ids, mask) for k, m in models.items()}
    _assert_same_greedy_path(torch, outs["fa2cupy"], outs["ref"], outs["truth"])


@pytest.mark.parametrize("name", ["llama", "gemma2"])
@pytest.mark.parametrize("padded", [True, False])
def test_gpu_greedy_generation_static_cache_compiled(torch, name, padded):
    """generate() with a static cache compiles the decoding step (torch.compile, transformers' default compile
    config); with an unpadded batch generate drops the mask and the mask function marks the unwritten slots."""
    models = _models(torch, name)
    ids, mask = _batch(torch, lengths=(20, 11, 16) if padded else (20, 20, 20), seqlen=20)
    compile_config = transformers.CompileConfig(fullgraph=False)
    outs = {k: _greedy(m, ids, mask, cache_implementation="static", compile_config=compile_config)
            for k, m in models.items()}
    _assert_same_greedy_path(torch, outs["fa2cupy"], outs["ref"], outs["truth"])


CB_ROUTE = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 19)  # see test_transformers.py


@pytest.mark.skipif(not CB_ROUTE, reason=f"transformers {transformers.__version__}'s continuous batching takes no "
                                         f"registered implementation (5.0-5.18 do)")
@pytest.mark.parametrize("name", MODELS)
def test_gpu_continuous_batching(torch, name):
    """generate_batch on fa2cupy's paged kernels (16-token pages; a 64-token budget chunks the longer prefills)
    follows each prompt's greedy path under generate() of the bf16 reference, with the chosen tokens'
    log-probabilities within twice the logits' bound of float32's (log-softmax moves by at most twice the largest
    logit change) until the paths part, which only a near tie of the reference may make them do."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    models = _models(torch, name)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 7, 23, 16, 33)]
    n_new = 16
    config = GenerationConfig(max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = models["fa2cupy"].generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=(
        ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=64, block_size=16, return_logprobs=True)))
    got = {tuple(o.prompt_ids): o for o in out.values()}
    assert models["fa2cupy"].config._attn_implementation == "fa2cupy"  # restored after the batch
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        ref, truth = (models[k].generate(ids, max_new_tokens=n_new, do_sample=False, output_scores=True,
                                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
                      for k in ("ref", "truth"))
        tokens = got[tuple(p)].generated_tokens
        assert len(tokens) == n_new
        for step, (b, t) in enumerate(zip(ref.scores, truth.scores)):
            chosen = int(b[0].argmax())
            if int(t[0].argmax()) != chosen:
                break  # float32 itself goes another way: past here the runs see different contexts
            if tokens[step] != chosen:
                top2 = b[0].float().topk(2).values
                gap = (top2[0] - top2[1]).item()
                assert gap <= _bound(t, b), f"{p[:3]}...: parts at step {step} though the margin was {gap:.3g}"
                break
            want = torch.log_softmax(t[0].float(), -1)[chosen].item()
            err = abs(got[tuple(p)].logprobs[step] - want)
            assert err <= 2 * _bound(t, b), f"{p[:3]}... step {step}: log-probability off by {err:.3g}"


def test_gpu_inputs_reach_the_kernel_without_copies(torch, monkeypatch):
    """The (batch, seq, heads, dim) views of the model's projections go to the kernel as they are."""
    import fa2cupy.torch as fa_torch

    seen = []
    real = fa_torch.flash_attn_func

    def record(q, k, v, **kw):
        # Views of the projections' outputs, whatever their layout (Llama's (b, s, h, d) projections make the
        # transposed-back views contiguous); a copy would be a tensor of its own (no _base).
        seen.append(all(x._base is not None for x in (q, k, v)))
        return real(q, k, v, **kw)

    monkeypatch.setattr(fa_torch, "flash_attn_func", record)
    models = _models(torch, "llama")
    ids, _ = _batch(torch, lengths=(48, 48, 48))
    with torch.no_grad():
        models["fa2cupy"](ids)
    assert len(seen) == 2 and all(seen)  # one call per layer, each on views, not copies
