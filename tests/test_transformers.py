"""fa2cupy.integrations.transformers on CPU: the "fa2cupy" attention implementation of Hugging Face transformers.

fa2cupy.torch's kernels are replaced by the float64 reference (tests/torch_stand_ins.py), so these tests check what
the integration itself does: registration, the argument mapping (scaling, causal, GQA, sliding window, softcap,
dropout), unpadding and re-padding, packed sequences, caches and the errors. Tiny randomly initialised models built
from the real config classes run in float64 with attn_implementation="fa2cupy" and with transformers' own "sdpa"
(or "eager" where sdpa lacks the feature: Gemma 2's softcap), on the same weights; their logits and gradients must
agree to float64 rounding. The GPU counterparts (real kernels, bf16) are in test_transformers_gpu.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fa2cupy.torch as fa_torch  # noqa: E402
from fa2cupy.integrations import transformers as fa_hf  # noqa: E402
from torch_stand_ins import calls, cpu_kernels, cpu_varlen_kernels  # noqa: E402,F401 -- fixtures

TOL = dict(rtol=1e-9, atol=1e-9)  # float64 on both sides: only summation order differs
# Gemma 2 runs in float32 against eager: eager takes its softmax in float32 anyway (and in float64 its mask, the
# float64 minimum, becomes -inf there, so that fully masked padding rows turn into NaN that leak through 0 * NaN).
# float32 rounding (u = 6e-8) in both models' matmuls, grown through two layers and the LM head, bounds it.
TOL_EAGER = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture
def stand_ins(cpu_kernels, cpu_varlen_kernels, monkeypatch):  # noqa: F811
    """Both kernel families on the reference; the dropout seed drawn without CUDA."""
    monkeypatch.setattr(fa_torch, "_draw_dropout_rng", lambda device: (1, 2))
    return calls


# ---------------------------------------------------------------------------------------------- tiny models

COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)


def _config(name, **extra):
    c = transformers
    if name == "llama":
        return c.LlamaConfig(**COMMON, **extra)
    if name == "qwen2":
        return c.Qwen2Config(**COMMON, **extra)
    if name == "mistral":  # every layer slides over 5 keys
        return c.MistralConfig(**COMMON, sliding_window=5, **extra)
    if name == "gemma2":  # alternating sliding (window 4) and global layers, attention-logit softcap
        return c.Gemma2Config(**COMMON, head_dim=16, sliding_window=4, attn_logit_softcapping=3.0,
                              final_logit_softcapping=None, query_pre_attn_scalar=16, **extra)
    raise ValueError(name)


MODELS = ["llama", "qwen2", "mistral", "gemma2"]


def _reference_impl(name):
    return "eager" if name == "gemma2" else "sdpa"  # sdpa has no softcap


def _pair(name, **extra):
    """(fa2cupy model, reference model) in float64 (Gemma 2: float32, see TOL_EAGER) with the same random weights."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config(name, **extra), attn_implementation=_reference_impl(name))
    ours = transformers.AutoModelForCausalLM.from_config(_config(name, **extra), attn_implementation="fa2cupy")
    ours.load_state_dict(ref.state_dict())
    dtype = torch.float32 if _reference_impl(name) == "eager" else torch.float64
    return ours.to(dtype).eval(), ref.to(dtype).eval()


def _tokens(batch, seqlen, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 101, (batch, seqlen), generator=g)


def _padding_mask(lengths, seqlen, side):
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.long)
    for i, n in enumerate(lengths):
        if side == "right":
            mask[i, :n] = 1
        else:
            mask[i, seqlen - n:] = 1
    return mask


def _close(a, b, where=None, name="llama"):
    if where is not None:
        a, b = a[where], b[where]
    torch.testing.assert_close(a, b, **(TOL_EAGER if _reference_impl(name) == "eager" else TOL))


# ---------------------------------------------------------------------------------------------- registration


def test_registered_under_its_name():
    from transformers import AttentionInterface, AttentionMaskInterface

    assert AttentionInterface._global_mapping["fa2cupy"] is fa_hf.fa2cupy_attention_forward
    assert AttentionMaskInterface._global_mapping["fa2cupy"] is fa_hf.fa2cupy_mask
    assert fa_hf.NAME == "fa2cupy"


def test_import_error_names_the_extra(monkeypatch):
    import builtins
    import importlib
    import sys

    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    monkeypatch.delitem(sys.modules, "fa2cupy.integrations.transformers")
    with pytest.raises(ImportError, match=r"pip install 'fa2cupy\[transformers\]'"):
        importlib.import_module("fa2cupy.integrations.transformers")
    monkeypatch.undo()
    importlib.import_module("fa2cupy.integrations.transformers")


# ---------------------------------------------------------------------------------------------- the sliding window


def test_sliding_window_convention():
    """transformers' sliding_window counts the keys a causal query sees, itself included: fa2cupy's left = w - 1."""
    assert fa_hf.sliding_window_to_window_size(None, True) == (-1, -1)
    assert fa_hf.sliding_window_to_window_size(5, True) == (4, 0)
    assert fa_hf.sliding_window_to_window_size(5, False) == (5, 5)
    with pytest.raises(ValueError, match="sliding_window"):
        fa_hf.sliding_window_to_window_size(0, True)


def test_sliding_window_is_pinned_against_sdpa(stand_ins, monkeypatch):
    """Mistral (window 5) over 12 tokens equals transformers' sdpa path; the window one key wider or narrower does
    not (so the equality above is not vacuous)."""
    ours, ref = _pair("mistral")
    ids = _tokens(2, 12)
    with torch.no_grad():
        want = ref(ids).logits
        _close(ours(ids).logits, want)
        for shift in (-1, 1):
            monkeypatch.setattr(fa_hf, "sliding_window_to_window_size",
                                lambda w, causal, s=shift: (-1, -1) if w is None else (w - 1 + s, 0))
            assert not torch.allclose(ours(ids).logits, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- logits


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("padding", [None, "right", "left"])
def test_logits_equal_the_reference(stand_ins, name, padding):
    ours, ref = _pair(name)
    ids = _tokens(3, 11)
    mask = None if padding is None else _padding_mask([11, 6, 8], 11, padding)
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    _close(got, want, None if mask is None else mask.bool(), name)  # padded rows are don't-care in the reference
    if mask is not None:
        assert any(c["forward"] == "varlen_forward_with_lse" for c in stand_ins)  # unpadded, not masked
        assert not any(c["forward"] == "forward_with_lse" for c in stand_ins)


@pytest.mark.parametrize("name", MODELS)
def test_packed_position_ids_equal_separate_sequences(stand_ins, name):
    """One row holding three sequences, told apart only by position_ids restarting, equals running each alone."""
    ours, ref = _pair(name)
    lengths = [5, 7, 4]
    ids = _tokens(1, sum(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        got = ours(ids, position_ids=pos).logits[0]
        pieces, start = [], 0
        for n in lengths:
            pieces.append(ref(ids[:, start:start + n]).logits[0])
            start += n
    _close(got, torch.cat(pieces), name=name)
    assert [c["forward"] for c in stand_ins] == ["varlen_forward_with_lse"] * 2


def test_unpacked_position_ids_take_the_dense_kernel(stand_ins):
    ours, ref = _pair("llama")
    ids = _tokens(1, 9)
    with torch.no_grad():
        _close(ours(ids, position_ids=torch.arange(9)[None]).logits, ref(ids).logits)
    assert [c["forward"] for c in stand_ins] == ["forward_with_lse"] * 2


def test_varlen_keyword_arguments(stand_ins):
    """cu_seq_lens_q/k and max_length_q/k (padding-free training collators) reach the varlen kernel."""
    ours, ref = _pair("qwen2")
    lengths = [4, 6]
    ids = _tokens(1, 10)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        got = ours(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6).logits
        want = torch.cat([ref(ids[:, :4]).logits, ref(ids[:, 4:]).logits], 1)
    _close(got, want)


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", MODELS)
def test_training_step_gradients(stand_ins, name):
    ours, ref = _pair(name)
    ids = _tokens(2, 10)
    mask = _padding_mask([10, 7], 10, "right")
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in (ours, ref):
        model.train()
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], **(TOL_EAGER if name == "gemma2" else TOL), msg=n)


def test_dropout_reaches_the_kernels_in_training_only(stand_ins):
    ours, _ = _pair("llama", attention_dropout=0.25)
    ids = _tokens(2, 6)
    ours.train()
    ours(ids).logits.sum().backward()
    assert [c["dropout_p"] for c in stand_ins] == [0.25, 0.25]
    stand_ins.clear()
    ours.eval()
    with torch.no_grad():
        ours(ids)
    assert [c["dropout_p"] for c in stand_ins] == [0.0, 0.0]


# ---------------------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("name", ["llama", "gemma2"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("lengths", [[7, 4], [7, 7]])
def test_greedy_generation(stand_ins, name, cache, lengths):
    """Decoding (one query per sequence against the cache, bottom-right aligned) from a left-padded batch and an
    unpadded one (for which generate drops the mask: a static cache's unwritten slots are then marked by the mask
    function alone), with the dynamic and the static cache, sliding-window caches for Gemma 2."""
    ours, ref = _pair(name)
    ids = _tokens(2, 7)
    mask = _padding_mask(lengths, 7, "left")
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, output_scores=True,
              return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    if cache == "static":
        kw["cache_implementation"] = "static"
    outs = [model.generate(ids, **kw) for model in (ours, ref)]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].scores, outs[1].scores):
        _close(a, b, name=name)


def test_mask_function_marks_a_static_caches_unwritten_slots():
    m = fa_hf.fa2cupy_mask(batch_size=2, kv_length=8, attention_mask=None, kv_offset=0, q_length=1, q_offset=4)
    assert m.shape == (2, 8) and m.dtype == torch.bool
    assert m[0].tolist() == [True] * 5 + [False] * 3
    # a padding mask over the tokens so far, shorter than the static keys: padded with False
    pad = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    m = fa_hf.fa2cupy_mask(batch_size=2, kv_length=8, attention_mask=pad, q_length=1, q_offset=4)
    assert m.tolist() == [[False] + [True] * 4 + [False] * 3, [True] * 5 + [False] * 3]
    # the older signature (cache_position instead of q_length/q_offset)
    m = fa_hf.fa2cupy_mask(batch_size=1, kv_length=6, cache_position=torch.tensor([2, 3]))
    assert m.tolist() == [[True] * 4 + [False] * 2]
    # nothing padded, nothing unwritten: no mask (the dense kernel)
    assert fa_hf.fa2cupy_mask(batch_size=2, kv_length=5, attention_mask=torch.ones(2, 5), q_length=5, q_offset=0) is None
    assert fa_hf.fa2cupy_mask(batch_size=2, kv_length=5, q_length=5, q_offset=0) is None
    # a sliding-window cache keeps the last kv_length slots of the padding mask
    m = fa_hf.fa2cupy_mask(batch_size=1, kv_length=3, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]]), q_length=1,
                           q_offset=5, kv_offset=3)
    assert m is None


# ---------------------------------------------------------------------------------------------- continuous batching

# transformers 5.0-5.18 run generate_batch under "paged|" + the model's implementation; later releases accept only
# their own implementations and hub kernels there (and refuse "fa2cupy" themselves).
CB_ROUTE = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 19)


@pytest.mark.skipif(not CB_ROUTE, reason=f"transformers {transformers.__version__}'s continuous batching takes no "
                                         f"registered implementation (5.0-5.18 do)")
@pytest.mark.parametrize("name", MODELS)
def test_continuous_batching_equals_generate(stand_ins, name, monkeypatch):
    """generate_batch with "fa2cupy" (transformers' paged cache; 4-token pages, so prompts span several, and a
    token budget that splits the prefill into chunks) gives each request the tokens the reference model's greedy
    generate gives it alone. Full-attention layers read the page pools through the paged kernel."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching import cache as cb_cache

    # transformers sizes the cache from the GPU's free memory, which a CPU run does not have
    monkeypatch.setattr(cb_cache, "get_device_and_memory_breakdown", lambda: ("cpu", 1 << 30, 0, 0))
    ours, ref = _pair(name)
    prompts = [_tokens(1, n, seed=n)[0].tolist() for n in (9, 3, 14, 6)]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = ours.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=(
        ContinuousBatchingConfig(num_blocks=48, max_batch_tokens=16, block_size=4, return_logprobs=True)))
    got = {tuple(o.prompt_ids): o for o in out.values()}
    for p in prompts:
        want = ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None,
                            output_scores=True, return_dict_in_generate=True)
        tokens = want.sequences[0, len(p):]
        assert got[tuple(p)].generated_tokens == tokens.tolist(), p
        # the chosen tokens' log-probabilities (continuous batching takes them from float32 logits)
        logprobs = [torch.log_softmax(s[0].double(), -1)[t] for s, t in zip(want.scores, tokens)]
        torch.testing.assert_close(torch.tensor(got[tuple(p)].logprobs, dtype=torch.float64), torch.stack(logprobs),
                                   rtol=1e-5, atol=1e-5)
    paged = [c["paged"] for c in calls if c["forward"] == "varlen_forward_with_lse"]
    assert paged and all(not c.get("paged", False) for c in calls if c["forward"] != "varlen_forward_with_lse")
    if name in ("llama", "qwen2", "gemma2"):  # Gemma 2's global layers; Mistral's layers all slide
        assert any(paged)


def test_block_table_from_read_index():
    """Request r's j-th page is the one holding its key j * page; entries past its keys are 0."""
    page = 4
    # request 0: 6 keys on pages 5, 2; request 1: 9 keys on pages 7, 0, 3; request 2: none
    read = torch.tensor([20, 21, 22, 23, 8, 9] + [28, 29, 30, 31, 0, 1, 2, 3, 12])
    cu_k = torch.tensor([0, 6, 15, 15], dtype=torch.int32)
    table = fa_hf._block_table(read, cu_k, 9, page)
    assert table.dtype == torch.int32 and table.tolist() == [[5, 2, 0], [7, 0, 3], [0, 0, 0]]


def test_paged_name_without_the_paged_cache_raises():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match='paged\\|fa2cupy.*attn_implementation="fa2cupy"'):
        fa_hf.fa2cupy_paged_attention_forward(_Module(), q, k, v, None)
    assert transformers.AttentionInterface._global_mapping[fa_hf.PAGED_NAME] is fa_hf.fa2cupy_paged_attention_forward


# ---------------------------------------------------------------------------------------------- the call itself


class _Module(torch.nn.Module):
    is_causal = True


def _qkv(b=2, h=4, hkv=2, sq=6, sk=6, d=16):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(b, h, sq, d, generator=g, dtype=torch.float64),
            torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64),
            torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64))


def test_inputs_are_taken_zero_copy(monkeypatch):
    seen = {}

    def record(q, k, v, **kw):
        seen.update(q=q, k=k, v=v, **kw)
        return q

    monkeypatch.setattr(fa_torch, "flash_attn_func", record)
    q, k, v = _qkv()
    fa_hf.fa2cupy_attention_forward(_Module(), q, k, v, None, scaling=0.3, sliding_window=3, softcap=2.0)
    for name, x in zip("qkv", (q, k, v)):
        assert seen[name].data_ptr() == x.data_ptr() and seen[name].shape == x.transpose(1, 2).shape
        assert seen[name].stride() == x.transpose(1, 2).stride()
    assert (seen["softmax_scale"], seen["causal"], seen["window_size"], seen["softcap"]) == (0.3, True, (2, 0), 2.0)


def test_decoding_against_a_padded_cache(stand_ins):
    """One query per row against a left-padded cache: the varlen kernel on the written keys only."""
    from fa2cupy import reference

    q, k, v = _qkv(sq=1, sk=7)
    mask = _padding_mask([7, 3], 7, "left").bool()
    out, weights = fa_hf.fa2cupy_attention_forward(_Module(), q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (2, 1, 4, 16)
    for b, n in enumerate([7, 3]):
        want, _ = reference.attention_ref(q[b:b + 1].transpose(1, 2).numpy(), k[b:b + 1, :, 7 - n:].transpose(1, 2).numpy(),
                                          v[b:b + 1, :, 7 - n:].transpose(1, 2).numpy(), 0.25, True)
        torch.testing.assert_close(out[b:b + 1], torch.from_numpy(want), **TOL)


def test_padded_query_rows_are_zero(stand_ins):
    q, k, v = _qkv()
    mask = _padding_mask([6, 2], 6, "right").bool()
    out, _ = fa_hf.fa2cupy_attention_forward(_Module(), q, k, v, mask)
    assert torch.count_nonzero(out[1, 2:]) == 0 and torch.count_nonzero(out[1, :2]) > 0


# ---------------------------------------------------------------------------------------------- what raises


def test_output_attentions_raises(stand_ins):
    ours, _ = _pair("llama")
    with pytest.raises(NotImplementedError, match="output_attentions.*eager"):
        ours(_tokens(1, 4), output_attentions=True)


def test_a_float_4d_mask_raises(stand_ins):
    ours, _ = _pair("llama")
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="4-D.*sdpa"):
        ours(_tokens(1, 4), attention_mask=mask)


@pytest.mark.parametrize("kwargs, feature", [
    (dict(s_aux=torch.zeros(4)), "s_aux"),
    (dict(position_bias=torch.zeros(1)), "position bias"),
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), "decode fast path"),
])
def test_unsupported_features_raise(kwargs, feature):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=feature):
        fa_hf.fa2cupy_attention_forward(_Module(), q, k, v, None, **kwargs)


def test_float_2d_mask_raises():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="arbitrary attention mask"):
        fa_hf.fa2cupy_attention_forward(_Module(), q, k, v, torch.zeros(2, 6))


def test_mask_overlays_raise():
    with pytest.raises(NotImplementedError, match="mask overlay"):
        fa_hf.fa2cupy_mask(batch_size=1, kv_length=4, q_length=4, q_offset=0, use_vmap=True)
