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
of all rows / wall time of the call (prefill included). TTFT = the best wall time of the same
call with one new token (prefill + first token); TPOT = (full call - TTFT) / (new tokens - 1).
``--device cuda`` runs both on the GPU (``--dtype bf16`` to cast both), timed between
``torch.cuda.synchronize()`` calls::

    python benchmarks/bench_vs_transformers.py --threads 4
    python benchmarks/bench_vs_transformers.py --device cuda --layers 12 --width 768 --heads 12
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
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (TPOT needs a second token)")
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
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    ours, theirs = ours.to(device, dtype), theirs.to(device, dtype)
    best: dict[tuple[str, int], float] = {}
    first: dict[tuple[str, int], float] = {}

    def run_ours(prompts: torch.Tensor, new: int) -> int:
        greedy = SamplingConfig(max_new_tokens=new, temperature=0)
        out = generate_batch(ours, list(prompts), greedy, tp_group=None)
        return sum(len(r.tokens) for r in out)

    def run_theirs(prompts: torch.Tensor, new: int) -> int:
        with torch.no_grad():
            out = theirs.generate(prompts, attention_mask=torch.ones_like(prompts),
                                  max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=0)
        return (out.shape[1] - prompts.shape[1]) * out.shape[0]

    def timed(fn, prompts: torch.Tensor, new: int) -> tuple[int, float]:  # noqa: ANN001
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = fn(prompts, new)
        if cuda:
            torch.cuda.synchronize()
        return tokens, time.perf_counter() - t0

    variants = {"torsh generate_batch": run_ours, "transformers generate": run_theirs}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(0, 256, (batch, args.prompt_len),
                                generator=torch.Generator().manual_seed(batch)).to(device)
        for fn in variants.values():  # warm up
            fn(prompts[:, :4], args.new_tokens)
        for round_ in range(args.rounds):
            order = list(variants.items())
            for name, fn in order if round_ % 2 == 0 else order[::-1]:
                tokens, wall = timed(fn, prompts, args.new_tokens)
                assert tokens == batch * args.new_tokens, (name, tokens)
                best[(name, batch)] = max(best.get((name, batch), 0.0), tokens / wall)
                _, ttft = timed(fn, prompts, 1)
                first[(name, batch)] = min(first.get((name, batch), float("inf")), ttft)
    where = torch.cuda.get_device_name(device) if cuda else platform.machine()
    print(f"\nmachine: {where}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {args.dtype}, {args.threads} thread(s); {args.layers} layers, width "
          f"{args.width}, {args.heads} heads, prompt {args.prompt_len}, {args.new_tokens} new "
          f"tokens, greedy, best of {args.rounds}\n")
    print("| batch | torsh tok/s | transformers tok/s | ratio | torsh TTFT / TPOT ms "
          "| transformers TTFT / TPOT ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = []
    ours_name, theirs_name = "torsh generate_batch", "transformers generate"
    for batch in sorted({b for _, b in best}):
        a, b = best[(ours_name, batch)], best[(theirs_name, batch)]
        row = {"batch": batch, "torsh_tok_s": a, "transformers_tok_s": b}
        for key, name in (("torsh", ours_name), ("transformers", theirs_name)):
            ttft = first[(name, batch)]
            full = batch * args.new_tokens / best[(name, batch)]
            row[f"{key}_ttft_s"] = ttft
            row[f"{key}_tpot_s"] = max(full - ttft, 0.0) / (args.new_tokens - 1)
        rows.append(row)
        print(f"| {batch} | {a:.0f} | {b:.0f} | {a / b:.2f}x | {1e3 * row['torsh_ttft_s']:.1f} / "
              f"{1e3 * row['torsh_tpot_s']:.2f} | {1e3 * row['transformers_ttft_s']:.1f} / "
              f"{1e3 * row['transformers_tpot_s']:.2f} |")
    if args.json:
        with open(args.json, "w") as fp:
            json.dump({"device": where, "dtype": args.dtype, "torch": torch.__version__,
                       "transformers": transformers.__version__, "rows": rows}, fp, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
