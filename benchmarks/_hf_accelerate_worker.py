"""One rank of the Accelerate side of ``bench_hf_fsdp.py``: the same Hugging Face model, data,
global batches and AdamW as ``torsh-dist train --model hf:DIR --zero-stage 3``, trained with
Accelerate's FSDP (version 2: ``fully_shard`` of each ``_no_split_modules`` block, then the
root). Launched by ``torsh-dist run --nproc-per-node N`` (Accelerate reads the torchrun
environment). Accelerate enables FSDP only on accelerator ranks (on CPU ranks it would run DDP
and ignore the plugin): the worker refuses to measure anything else. Rank 0 prints one JSON line: tokens/s over all steps (the engine's definition:
global batch x steps x seq_len / summed step wall time, the first step included) and the
losses."""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    from accelerate import Accelerator, DistributedType, FullyShardedDataParallelPlugin

    from torsh_distributed.data.sampler import EpochSampler, fetch, shard
    from torsh_distributed.hf.data import load_packed
    from torsh_distributed.hf.model import lm_loss, load_hf_model

    hf = load_hf_model(f"hf:{args.model}")
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=sorted(hf.meta_model._no_split_modules),
        reshard_after_forward=True,
    )
    acc = Accelerator(fsdp_plugin=plugin, cpu=not torch.cuda.is_available())
    if acc.distributed_type != DistributedType.FSDP:
        # Accelerate turns FSDP on only for accelerator ranks: CPU ranks get MULTI_CPU (DDP),
        # and a number measured so would not be FSDP's
        raise SystemExit(
            f"Accelerate runs {acc.distributed_type} here, not FSDP: its FSDP needs accelerator "
            "ranks (CUDA, XPU, ...); on CPU ranks it ignores the FSDP plugin"
        )
    torch.manual_seed(args.seed)
    model = hf.build()
    data = load_packed(f"hf:{args.data},seq_len={args.seq_len}", hf.tokenizer(),
                       max_positions=None, vocab_size=int(hf.config.vocab_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.01)
    model, optimizer = acc.prepare(model, optimizer)
    sampler = EpochSampler(len(data), global_batch=args.batch_size, seed=args.seed)
    losses: list[float] = []
    loop = 0.0
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = fetch(data, shard(sampler.indices(step), rank=acc.process_index,
                                 num_ranks=acc.num_processes))
        x, y = x.to(acc.device), y.to(acc.device)
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(acc.reduce(loss.detach(), reduction="mean")))
        loop += time.perf_counter() - t0
    if acc.is_main_process:
        tokens = args.batch_size * args.steps * args.seq_len
        print(json.dumps({"tokens_per_s": tokens / loop, "losses": losses,
                          "distributed_type": str(acc.distributed_type)}), flush=True)
    acc.end_training()


if __name__ == "__main__":
    main()
