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

``--backends gloo,auto`` compares other backend names (``auto`` is the default of ``torsh-dist
train``: ``gloo+shm`` for several ranks of one host); the summary's ``backend`` says what each run
resolved to. ``--burners-per-core B`` runs B busy-loop processes per core beside every run (the
neighbours of a busy host), ``--env KEY=VALUE`` sets a variable for the ranks (repeatable; e.g.
``TORSH_SHM_ASYNC=0``), ``--train-arg`` adds a flag to every run (repeatable), ``--second-arg`` to the second
backend's runs only::

    python benchmarks/bench_shm_train.py --ranks 2 --zero-stages 0 --backends gloo,auto \
        --burners-per-core 1 --rounds 3
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

import _burners

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BACKENDS = "gloo,gloo+shm"


def _run(backend: str, ranks: int, zero: int, args: argparse.Namespace, extra: list[str]) -> dict:
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
            *args.train_arg,
            *extra,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
        env.update(item.split("=", 1) for item in args.env)
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
    parser.add_argument("--backends", default=DEFAULT_BACKENDS, help="comma list, 2 names")
    _burners.add_argument(parser)
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the ranks (repeatable)",
    )
    parser.add_argument(
        "--train-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument of every `torsh-dist train` run (repeatable; write flags with "
        "their value as --train-arg=--bucket-cap-mb --train-arg=5)",
    )
    parser.add_argument(
        "--second-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="like --train-arg, for the second backend's runs only (its defaults against the "
        "first backend's: --second-arg=--bucket-cap-mb --second-arg=5)",
    )
    parser.add_argument("--json", default="", help="write the results to this file")
    args = parser.parse_args(argv)
    backends = tuple(b.strip() for b in args.backends.split(","))
    if len(backends) != 2 or args.burners_per_core < 0:
        parser.error("--backends takes two names; --burners-per-core must be >= 0")
    if any("=" not in item for item in args.env):
        parser.error("--env takes KEY=VALUE")
    with _burners.burning(args.burners_per_core) as burners:
        return _measure(args, backends, burners)


def _measure(args: argparse.Namespace, backends: tuple[str, str], burners: int) -> int:
    load_before = os.getloadavg()
    # the second backend's column is named with its own flags (``auto,auto`` then compares them)
    labels = (backends[0], " ".join([backends[1], *args.second_arg]))
    rows = []
    for ranks in (int(x) for x in args.ranks.split(",")):
        for zero in (int(x) for x in args.zero_stages.split(",")):
            runs: dict[str, list[dict]] = {b: [] for b in labels}
            for r in range(args.rounds):
                for i in (0, 1) if r % 2 == 0 else (1, 0):
                    extra = args.second_arg if i == 1 else []
                    runs[labels[i]].append(_run(backends[i], ranks, zero, args, extra))
            tps = {b: statistics.median(x["tokens_per_s"] for x in runs[b]) for b in labels}
            losses = {b: {round(x["final_loss"], 5) for x in runs[b]} for b in labels}
            rows.append(
                {
                    "ranks": ranks,
                    "zero_stage": zero,
                    "tokens_per_s": tps,
                    "all_tokens_per_s": {b: [x["tokens_per_s"] for x in runs[b]] for b in labels},
                    "final_losses": {b: sorted(v) for b, v in losses.items()},
                    "resolved": {b: sorted({x.get("backend", b) for x in runs[b]}) for b in labels},
                    "params": runs[labels[0]][0]["num_params"],
                }
            )
    load_after = os.getloadavg()
    a, b = labels
    print(
        f"| ranks | ZeRO stage | {a} tokens/s (runs) | {b} tokens/s (runs) | {b} / {a} | final loss "
        f"({a} / {b}) | resolved |\n|---:|---:|---:|---:|---:|---|---|"
    )
    for row in rows:
        t, every = row["tokens_per_s"], row["all_tokens_per_s"]
        runs_a = ", ".join(f"{x:.0f}" for x in every[a])
        runs_b = ", ".join(f"{x:.0f}" for x in every[b])
        print(
            f"| {row['ranks']} | {row['zero_stage']} | {t[a]:.0f} ({runs_a}) | {t[b]:.0f} "
            f"({runs_b}) | {t[b] / t[a]:.2f} | {row['final_losses'][a]} / "
            f"{row['final_losses'][b]} | {row['resolved'][a]} / {row['resolved'][b]} |"
        )
    print(
        f"parameters: {rows[0]['params']}; {burners} burner process(es); load average "
        f"before {load_before}, after {load_after}; ranks' env: {args.env or 'default'}; "
        f"train args: {args.train_arg or 'default'}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "load": [load_before, load_after]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
