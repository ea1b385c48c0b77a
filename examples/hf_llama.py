"""A Hugging Face Llama with ZeRO-3, then back to transformers: the Python side of ``hf:``.

    torsh-dist run --nproc-per-node 2 examples/hf_llama.py --max-steps 20

Rank 0 writes a tiny ``LlamaForCausalLM`` directory (config + word-level tokenizer; offline,
nothing from the Hub) and a JSON-lines corpus under ``--workdir``. Every rank then trains it
with ZeRO-3, the FSDP units taken from the model's ``_no_split_modules``, on windows packed
from the corpus with the model's tokenizer, and saves a checkpoint. Rank 0 exports the
checkpoint as a Hugging Face directory and checks that ``AutoModelForCausalLM.from_pretrained``
gives the logits of our own loader. The command-line equivalent::

    torsh-dist train --nproc-per-node 2 --model hf:DIR --dataset hf:corpus.jsonl,seq_len=16 \\
        --zero-stage 3 --checkpoint-dir CKPT
    torsh-dist checkpoint export --format hf CKPT OUT
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

import torsh_distributed as td
from torsh_distributed.engine import Engine, EngineConfig
from torsh_distributed.hf.data import load_packed
from torsh_distributed.hf.export import export_hf
from torsh_distributed.hf.model import lm_loss, load_hf_model
from torsh_distributed.inference.load import load_model_state
from torsh_distributed.testing.hf import write_jsonl, write_tiny_llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--workdir", default="runs/hf_llama")
    args = parser.parse_args()
    work = Path(args.workdir)
    td.init()
    if td.rank() == 0:
        shutil.rmtree(work, ignore_errors=True)  # a fresh run, not a resume
        write_tiny_llama(work / "llama")
        write_jsonl(work / "corpus.jsonl")
    dist.barrier()

    hf = load_hf_model(f"hf:{work / 'llama'}")
    data = load_packed(f"hf:{work / 'corpus.jsonl'},seq_len=16", hf.tokenizer(),
                       max_positions=64, vocab_size=hf.config.vocab_size)
    config = EngineConfig(max_steps=args.max_steps, batch_size=8)
    config.parallel.zero_stage = 3
    config.checkpoint.dir = str(work / "ckpt")  # the final step is saved
    result = Engine(
        hf.build, dataset=data, loss_fn=lm_loss, config=config, blocks=hf.blocks(),
        tokens_per_sample=data.seq_len, model_info=hf.model_info(),
    ).fit()

    verdict = [""]
    if td.rank() == 0:
        from transformers import AutoModelForCausalLM

        out = work / "hf"
        export_hf(config.checkpoint.dir, out)  # sharded DCP of 2 ranks -> safetensors
        theirs = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        ours = hf.build().eval()
        load_model_state(ours, config.checkpoint.dir)
        x, _ = data[0]
        with torch.no_grad():
            diff = (theirs(x[None]).logits - ours(x[None]).logits).abs().max().item()
        verdict[0] = "yes" if diff < 1e-5 else f"NO (max diff {diff:.2e})"
    dist.broadcast_object_list(verdict, src=0)
    print(f"final loss {result.final_loss:.4f}; FSDP units {hf.blocks()}.*; transformers "
          f"logits equal ours: {verdict[0]}")
    td.shutdown()


if __name__ == "__main__":
    main()
