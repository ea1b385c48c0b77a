"""The built-in trainer's throughput on ``gloo`` vs ``gloo+shm``, runs alternated in one invocation.

Usage::

    python benchmarks/bench_shm_train.py --ranks 2,4 --rounds 3 --json out.json

Each round runs ``torsh-dist train`` once per backend (order alternating from round to round) with
the same model, data, seed and steps, and reads ``tokens_per_s`` and ``final_loss`` from
``--summary-json``. The model is chosen so that gradient communication is a real part of a step
(a GPT of ``--d-model 384 --n-layer 4``, about 7.5 M parameters, 30 MB of float32 gradients per
step, at a small batch), as in data-parallel training of a mid-sized model on many CPU ranks;
``--zero-stage 3`` adds FSDP2's all-gathers and reduce-scatters. Prints a Markdown table: median
tokens/s per backend, their ratio, and whether the losses agree (they must: the backends compute
the same sums).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("gloo", "gloo+shm")


def _run(backend: str, ranks: int, zero: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        cmd = [
            sys.executable,
            "-c",
            "from torsh_distributed.cli.main import main; raise SystemExit(main())",
            "train",
            "--preset",
            "small",
            "--d-model",
            str(args.d_model),
            "--n-layer",
            str(args.n_layer),
            "--batch-size",
            str(args.batch_size * ranks),
            "--max-steps",
            str(args.steps),
            "--eval-batches",
            "1",
            "--zero-stage",
            str(zero),
            "--nproc-per-node",
            str(ranks),
            "--backend",
            backend,
            "--progress",
            "off",
            "--summary-json",
            str(summary),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        return json.loads(summary.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma list of world sizes")
    parser.add_argument("--zero-stages", default="0,3", help="comma list: 0 = DDP, 3 = FSDP2")
    parser.add_argument("--rounds", type=int, default=3, help="runs per backend and setting")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run")
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2, help="per rank")
    parser.add_argument("--json", default="", help="write the results to this file")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    for ranks in (int(x) for x in args.ranks.split(",")):
        for zero in (int(x) for x in args.zero_stages.split(",")):
            runs: dict[str, list[dict]] = {b: [] for b in BACKENDS}
            for r in range(args.rounds):
                for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
                    runs[backend].append(_run(backend, ranks, zero, args))
            tps = {b: statistics.median(x["tokens_per_s"] for x in runs[b]) for b in BACKENDS}
            losses = {b: {round(x["final_loss"], 5) for x in runs[b]} for b in BACKENDS}
            rows.append(
                {
                    "ranks": ranks,
                    "zero_stage": zero,
                    "tokens_per_s": tps,
                    "all_tokens_per_s": {b: [x["tokens_per_s"] for x in runs[b]] for b in BACKENDS},
                    "final_losses": {b: sorted(v) for b, v in losses.items()},
                    "params": runs["gloo"][0]["num_params"],
                }
            )
    load_after = os.getloadavg()
    print(
        "| ranks | ZeRO stage | Gloo tokens/s | gloo+shm tokens/s | shm / Gloo | final loss "
        "(Gloo / shm) |\n|---:|---:|---:|---:|---:|---|"
    )
    for row in rows:
        t = row["tokens_per_s"]
        print(
            f"| {row['ranks']} | {row['zero_stage']} | {t['gloo']:.0f} | {t['gloo+shm']:.0f} | "
            f"{t['gloo+shm'] / t['gloo']:.2f} | {row['final_losses']['gloo']} / "
            f"{row['final_losses']['gloo+shm']} |"
        )
    print(f"parameters: {rows[0]['params']}; load average before {load_before}, after {load_after}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "load": [load_before, load_after]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
