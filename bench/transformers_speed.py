"""Training-step speed of a Hugging Face transformers model with attn_implementation="fa2cupy" against "sdpa" (and
"flash_attention_2" where flash-attn is installed): forward + backward of a randomly initialised Llama-architecture
model, in real (unpadded) tokens per second.

    python bench/transformers_speed.py                          # both cases below
    python bench/transformers_speed.py --cases dense --layers 4  # a quicker look
    python bench/transformers_speed.py --json /tmp/hf_speed.json
    (from the repository root, after ``pip install -e '.[transformers]'``: the harness is the installed package
    ``fa2cupy_bench``)

Cases (bf16, the model's loss on its own input ids as labels, no optimizer step):
* dense:  a batch of 2 sequences of 8192 tokens, no attention mask (every implementation runs the same work);
* padded: a batch of 8 right-padded sequences of mixed lengths from 512 to 8192 (fixed seed) with their attention
  mask; sdpa attends over the padded (8, 8192) batch with a 4-D mask, fa2cupy unpads and runs the varlen kernels,
  so only the real tokens count. Activations are checkpointed per layer in this case (for every implementation):
  those of 64k padded tokens do not fit an H200's 141 GB otherwise.

The model is Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 query heads and 8 key/value heads of 64, MLP 8192)
(1.04B parameters) with a 32,000-token vocabulary, so that the logits of the padded case fit beside the activations. Each
implementation loads the same weights; steps are timed as `fa2cupy bench` times calls (harness.time_gpu: CUDA
events after warm-up steps, median of --steps).
"""

from __future__ import annotations

import argparse
import json
import sys

from fa2cupy_bench import harness as B


def model_config(transformers, layers: int):
    return transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                                    num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                    max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True)


def make_batch(torch, case: str, seed: int = 0):
    """(input_ids, attention_mask or None, labels, real tokens, lengths), the tensors on the GPU."""
    g = torch.Generator().manual_seed(seed)
    if case == "dense":
        lengths, seqlen = [8192, 8192], 8192
    else:
        lengths = sorted(torch.randint(512, 8193, (7,), generator=g).tolist() + [8192], reverse=True)
        seqlen = 8192
    ids = torch.randint(3, 32000, (len(lengths), seqlen), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    ids = ids.masked_fill(mask == 0, 0)
    attention_mask = None if case == "dense" else mask.cuda()
    return ids.cuda(), attention_mask, labels.cuda(), sum(lengths), lengths


def time_step(model, ids, mask, labels, warmup: int, steps: int) -> float:
    """Median milliseconds of one forward + backward step."""
    def step():
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    # (every step timed: max_seconds does not cut the repeats of steps of a second or more)
    return B.time_gpu(step, B.TorchEvents(), warmup=warmup, repeats=steps, max_seconds=float("inf")).median_ms


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="dense,padded", help="comma-separated: dense, padded")
    p.add_argument("--impls", default="fa2cupy,sdpa,flash_attention_2",
                   help="attn_implementation names; flash_attention_2 is skipped where flash-attn is missing")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    import torch
    import transformers

    import fa2cupy.integrations.transformers  # noqa: F401 -- registers "fa2cupy"

    config = model_config(transformers, args.layers)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config).to(dtype=torch.bfloat16)
    params = sum(t.numel() for t in base.parameters())
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"Llama-architecture model of {params / 1e9:.2f}B parameters, bf16, forward + backward")
    results = []
    for case in args.cases.split(","):
        ids, mask, labels, tokens, lengths = make_batch(torch, case)
        row = {"case": case, "checkpointing": case == "padded", "lengths": lengths, "real_tokens": tokens, "padded_tokens": ids.numel()}
        for impl in args.impls.split(","):
            if impl == "flash_attention_2":
                try:
                    import flash_attn  # noqa: F401
                except ImportError:
                    continue
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
            model.load_state_dict(base.state_dict())
            model = model.to(device="cuda", dtype=torch.bfloat16).train()
            if case == "padded":
                model.gradient_checkpointing_enable()
            try:
                ms = time_step(model, ids, mask, labels, args.warmup, args.steps)
            except torch.OutOfMemoryError as exc:
                row[impl] = {"error": f"out of memory: {str(exc).splitlines()[0]}"}
                print(f"{case:7s} {impl:18s} out of memory")
            else:
                row[impl] = {"ms": ms, "tokens_per_s": tokens / ms * 1e3,
                             "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
                print(f"{case:7s} {impl:18s} {ms:9.1f} ms/step {tokens / ms * 1e3:10.0f} tokens/s "
                      f"(peak {row[impl]['peak_gib']:.1f} GiB)")
            del model
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        ref = row.get("sdpa", {}).get("tokens_per_s")
        ours = row.get("fa2cupy", {}).get("tokens_per_s")
        if ref and ours:
            row["fa2cupy_over_sdpa"] = ours / ref
            print(f"{case:7s} fa2cupy / sdpa tokens/s: {ours / ref:.3f}x")
        results.append(row)
        del ids, mask, labels
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "transformers": transformers.__version__, "parameters": params, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
