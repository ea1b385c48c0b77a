"""Our ``generate_batch`` vs Hugging Face ``transformers``' ``generate`` on a model of the same
shape, greedy, at batch 1, 8 and 32 on the CPU, side by side in one process.

Both models are GPT-2-shaped (learned positions, pre-norm blocks, GELU MLP, tied nothing that
changes the work): ours is the built-in GPT (``--layers``, ``--width``, ``--heads``, context
``--context``, byte vocabulary 256), theirs ``GPT2LMHeadModel`` with the same ``n_layer``,
``n_embd``, ``n_head``, ``n_positions`` and ``vocab_size``; both randomly initialised under a
fixed seed, fp32, in eval mode, KV cache on, ``--threads`` intra-op threads. Every request is
``--prompt-len`` random token ids continued by exactly ``--new-tokens`` tokens (``transformers``
gets no end-of-sequence token, so neither stops early). The variants alternate for ``--rounds``
rounds (order flipped each round); the best round of each is kept. Tokens/s = generated tokens
of all rows / wall time of the call (prefill included)::

    python benchmarks/bench_vs_transformers.py --threads 4
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from torsh_distributed.inference import SamplingConfig, generate_batch
from torsh_distributed.models.config import ModelConfig
from torsh_distributed.models.gpt import GPT


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours = GPT(ModelConfig(vocab_size=256, block_size=args.context, n_layer=args.layers,
                           n_head=args.heads, d_model=args.width)).eval()
    theirs = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.context,
                                        n_embd=args.width, n_layer=args.layers,
                                        n_head=args.heads, bos_token_id=0,
                                        eos_token_id=None, pad_token_id=0)).eval()
    greedy = SamplingConfig(max_new_tokens=args.new_tokens, temperature=0)
    best: dict[tuple[str, int], float] = {}

    def run_ours(prompts: torch.Tensor) -> int:
        out = generate_batch(ours, list(prompts), greedy, tp_group=None)
        return sum(len(r.tokens) for r in out)

    def run_theirs(prompts: torch.Tensor) -> int:
        with torch.no_grad():
            out = theirs.generate(prompts, attention_mask=torch.ones_like(prompts),
                                  max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, do_sample=False,
                                  pad_token_id=0)
        return (out.shape[1] - prompts.shape[1]) * out.shape[0]

    variants = {"torsh generate_batch": run_ours, "transformers generate": run_theirs}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(0, 256, (batch, args.prompt_len),
                                generator=torch.Generator().manual_seed(batch))
        for fn in variants.values():  # warm up
            fn(prompts[:, :4])
        for round_ in range(args.rounds):
            order = list(variants.items())
            for name, fn in order if round_ % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                tokens = fn(prompts)
                rate = tokens / (time.perf_counter() - t0)
                assert tokens == batch * args.new_tokens, (name, tokens)
                best[(name, batch)] = max(best.get((name, batch), 0.0), rate)
    print(f"\nmachine: {platform.machine()}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {args.threads} thread(s); {args.layers} layers, width "
          f"{args.width}, {args.heads} heads, prompt {args.prompt_len}, {args.new_tokens} new "
          f"tokens, greedy, best of {args.rounds}\n")
    print("| batch | torsh generate_batch tok/s | transformers generate tok/s | ratio |")
    print("|---:|---:|---:|---:|")
    rows = []
    for batch in sorted({b for _, b in best}):
        a, b = best[("torsh generate_batch", batch)], best[("transformers generate", batch)]
        rows.append({"batch": batch, "torsh_tok_s": a, "transformers_tok_s": b})
        print(f"| {batch} | {a:.0f} | {b:.0f} | {a / b:.2f}x |")
    if args.json:
        with open(args.json, "w") as fp:
            json.dump(rows, fp, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
