"""Our ZeRO-3 (``torsh-dist train --model hf:DIR --zero-stage 3``) vs Accelerate's FSDP on the
same Hugging Face Llama, paired: tokens/s side by side in one run.

The script writes a Llama config (``--hidden``, ``--layers``, 4 heads, 2 key/value heads, random
weights under the seed) with a word-level tokenizer and a JSON-lines corpus into ``--workdir``,
then alternates for ``--rounds`` rounds (order flipped each round) between

* **ours**: ``torsh-dist train --nproc-per-node N --model hf:DIR --dataset hf:FILE,seq_len=L
  --zero-stage 3`` (FSDP2 units from ``_no_split_modules``; AdamW, clipping 1.0, fp32), its
  summary's ``tokens_per_s``, with the default backend (``auto``: ``gloo+shm`` for CPU ranks of
  one host) and again with ``--backend gloo`` (Accelerate's transport);
* **accelerate**: ``torsh-dist run --nproc-per-node N benchmarks/_hf_accelerate_worker.py``, the
  same model, packed windows, global batches (our sampler) and AdamW under Accelerate's
  ``FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")``.

Both through the same launcher (one intra-op thread per rank), both timed the engine's way:
global batch x steps x seq_len / summed step wall time, first step included. The ratio per
round is ours / accelerate; the first-step losses are printed to show both train the same
thing::

    python benchmarks/bench_hf_fsdp.py --rounds 3 --steps 30 --json runs/hf_fsdp.json

Needs ``pip install accelerate`` and two or more GPUs: Accelerate turns FSDP on only for
accelerator ranks (CPU ranks get DDP, ``DistributedType.MULTI_CPU``, with the plugin ignored),
so on a CPU-only machine the Accelerate side stops with that reason instead of timing DDP.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "torsh_distributed.cli.main"]


def _prepare(work: Path, hidden: int, layers: int, context: int) -> tuple[Path, Path]:
    from torsh_distributed.testing.hf import tiny_corpus, write_jsonl, write_tiny_llama

    model = write_tiny_llama(work / "llama", weights=True, hidden_size=hidden, num_layers=layers,
                             context=context)
    data = write_jsonl(work / "corpus.jsonl", tiny_corpus(4000))
    return model, data


def _ours(args: argparse.Namespace, model: Path, data: Path, out: Path, backend: str) -> dict:
    summary = out / "ours.json"
    cmd = [*CLI, "train", "--nproc-per-node", str(args.nproc), "--model", f"hf:{model}",
           "--dataset", f"hf:{data},seq_len={args.seq_len}", "--zero-stage", "3",
           "--max-steps", str(args.steps), "--batch-size", str(args.batch_size), "--seed", "0",
           "--progress", "false", "--backend", backend, "--summary-json", str(summary)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"ours failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    s = json.loads(summary.read_text())
    return {"tokens_per_s": s["tokens_per_s"], "first_loss": s["initial_loss"]}


def _accelerate(args: argparse.Namespace, model: Path, data: Path) -> dict:
    cmd = [*CLI, "run", "--nproc-per-node", str(args.nproc),
           str(REPO / "benchmarks" / "_hf_accelerate_worker.py"), "--model", str(model),
           "--data", str(data), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--seed", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if '"tokens_per_s"' in ln), None)
    if proc.returncode or line is None:
        raise SystemExit(f"accelerate failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    found = json.loads(line[line.index("{"):])
    return {"tokens_per_s": found["tokens_per_s"], "first_loss": found["losses"][0],
            "distributed_type": found["distributed_type"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default="runs/bench_hf_fsdp")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    import accelerate
    import torch
    import transformers

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model, data = _prepare(work, args.hidden, args.layers, args.seq_len)
    rows = []
    names = ["ours", "ours_gloo", "accelerate"]
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        got = {}
        for name in order:
            if name == "accelerate":
                got[name] = _accelerate(args, model, data)
            else:
                got[name] = _ours(args, model, data, work, "auto" if name == "ours" else "gloo")
        acc = got["accelerate"]["tokens_per_s"]
        ratio, ratio_gloo = got["ours"]["tokens_per_s"] / acc, got["ours_gloo"]["tokens_per_s"] / acc
        rows.append({"round": r, **{f"{k}_{n}": v for n in got for k, v in got[n].items()},
                     "ratio": ratio, "ratio_gloo": ratio_gloo})
        print(f"round {r}: ours (auto backend) {got['ours']['tokens_per_s']:.0f} tok/s, ours (gloo) "
              f"{got['ours_gloo']['tokens_per_s']:.0f}, accelerate {acc:.0f}; ours/accelerate "
              f"{ratio:.3f}, ours gloo/accelerate {ratio_gloo:.3f} (first losses "
              f"{got['ours']['first_loss']:.6f} / {got['ours_gloo']['first_loss']:.6f} / "
              f"{got['accelerate']['first_loss']:.6f})", flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpus": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "accelerate": accelerate.__version__, "args": vars(args), "rounds": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
