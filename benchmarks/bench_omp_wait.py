"""OpenMP's wait policy on a busy host: one process's torch threads, spinning vs sleeping.

Usage::

    python benchmarks/bench_omp_wait.py --presets tiny,demo --rounds 3 --burners-per-core 1 \
        --variants unset,OMP_WAIT_POLICY=PASSIVE,torsh-dist

torch's CPU kernels run on an OpenMP team of ``torch.get_num_threads()`` threads (every usable core
by default, and the engine's default for a one-process job). Between parallel regions GNU
OpenMP's threads *spin* for a while before they sleep (``OMP_WAIT_POLICY`` unset), which is
cheap when every thread has a core of its own and ruinous when another process holds the core a
spinning thread waits for: the team's barrier waits for a thread that is not running while its
peers burn the time slices it needs. ``OMP_WAIT_POLICY=PASSIVE`` makes them sleep at once.

Each round runs ``torsh-dist train --nproc-per-node 1`` once per environment (``--variants``;
the order rotates from round to round; the policy must be in the environment before torch is imported, so every run is
a fresh command; it calls the CLI's ``main()``, since the ``torsh-dist`` script itself sets
``OMP_WAIT_POLICY=PASSIVE`` when the variable is unset) and reads ``tokens_per_s`` from ``--summary-json``; the CPU seconds are the
command's and its children's (``RUSAGE_CHILDREN``). ``--burners-per-core B`` runs B busy-loop
processes per core beside every run (the neighbours of a busy host). Prints a Markdown table:
median tokens/s and CPU-s per environment, the ratio to the first, and the losses (they must
agree: the wait policy changes no arithmetic).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _burners

ROOT = Path(__file__).resolve().parents[1]
UNSET = "unset"
DECIDES = "torsh-dist"  # the console script's own decision: PASSIVE on a busy host, else unset
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _env(variant: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("OMP_NUM_THREADS", None)  # the engine's default: every usable core
    for name in WAIT_VARIABLES:
        env.pop(name, None)
    env.pop("TORSH_OMP_WAIT", None)
    if variant not in (UNSET, DECIDES):
        env.update(item.split("=", 1) for item in variant.split("+"))
    return env


def _cli(argv: list[str], env: dict[str, str], *, script: bool = False) -> float:
    """Run ``torsh-dist ARGV`` through the CLI's ``main()``, which leaves OpenMP's wait policy to
    ``env``, or with ``script`` as the console script (it decides: runtime/_omp_wait.py); the CPU
    seconds it and its children used."""
    entry = "entry()" if script else "raise SystemExit(main())"
    cmd = [
        sys.executable,
        "-c",
        f"from torsh_distributed.cli.main import entry, main; {entry}",
        *argv,
    ]
    before = _cpu_children()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return _cpu_children() - before


def _train_argv(preset: str, args: argparse.Namespace, *out: str) -> list[str]:
    """``train`` of ``preset`` for ``--steps`` steps, one evaluation batch, no progress bar."""
    return ["train", "--preset", preset, "--max-steps", str(args.steps), "--eval-batches", "1",
            "--progress", "off", *out, *args.train_arg]  # fmt: skip


def _checkpoint(preset: str, directory: Path, args: argparse.Namespace) -> None:
    """A checkpoint of ``preset`` for ``--command generate`` (trained once, default environment)."""
    _cli(_train_argv(preset, args, "--checkpoint-dir", str(directory)), _env(UNSET))


def _run(variant: str, preset: str, args: argparse.Namespace, checkpoint: Path | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        if checkpoint is None:
            argv = _train_argv(preset, args, "--nproc-per-node", "1", "--summary-json", str(out))
        else:
            argv = [
                "generate",
                "--checkpoint",
                str(checkpoint),
                "--prompt",
                "def main():",
                "--temperature",
                "0",
                "--max-new-tokens",
                str(args.new_tokens),
                "--output",
                str(out),
            ]
        cpu = _cli(argv, _env(variant), script=variant == DECIDES)
        result = json.loads(out.read_text())
        result["cpu_s"] = cpu
        if checkpoint is not None:  # greedy: every environment must decode the same tokens
            result["final_loss"] = hash(tuple(result["tokens"])) % 100_000
            result["num_params"] = "generate"
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,demo", help="comma list of --preset names")
    parser.add_argument(
        "--variants",
        default=f"{UNSET},OMP_WAIT_POLICY=PASSIVE,{DECIDES}",
        help=f"comma list of environments, KEY=VALUE joined by '+' ({UNSET!r}: neither "
        f"OMP_WAIT_POLICY nor GOMP_SPINCOUNT set, GNU OpenMP's default; {DECIDES!r}: what the "
        "torsh-dist command decides from the host's load); ratios are to the first",
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs per environment and preset")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    _burners.add_argument(parser)
    parser.add_argument(
        "--train-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument of every run (repeatable; --train-arg=--batch-size --train-arg=4)",
    )
    parser.add_argument(
        "--command",
        choices=("train", "generate"),
        default="train",
        help="train: tokens/s of training; generate: decode tokens/s of a checkpoint "
        "trained first (greedy, so every environment must give the same tokens)",
    )
    parser.add_argument(
        "--new-tokens", type=int, default=100, help="--command generate: tokens per run"
    )
    parser.add_argument("--json", default="", help="write the results to this file")
    args = parser.parse_args(argv)
    variants = tuple(v.strip() for v in args.variants.split(","))
    bad = [
        v for v in variants if v not in (UNSET, DECIDES) and any("=" not in i for i in v.split("+"))
    ]
    if len(variants) < 2 or bad or args.burners_per_core < 0 or args.rounds < 1:
        parser.error(
            f"--variants takes 2 or more environments (bad: {bad}); --burners-per-core >= 0; "
            "--rounds >= 1"
        )
    with _burners.burning(args.burners_per_core) as burners:
        return _measure(args, variants, burners)


def _measure(args: argparse.Namespace, variants: tuple[str, ...], burners: int) -> int:
    load_before = os.getloadavg()
    rows = []
    for preset in args.presets.split(","):
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if args.command == "generate":
                checkpoint = Path(tmp) / "ck"
                _checkpoint(preset, checkpoint, args)
            for r in range(args.rounds):
                # each round in another order, so no variant always runs first or last
                shift = r % len(variants)
                for v in variants[shift:] + variants[:shift]:
                    runs[v].append(_run(v, preset, args, checkpoint))
        rows.append(
            {
                "preset": preset,
                "params": runs[variants[0]][0]["num_params"],
                "tokens_per_s": {v: [x["tokens_per_s"] for x in runs[v]] for v in variants},
                "cpu_s": {v: [x["cpu_s"] for x in runs[v]] for v in variants},
                "final_losses": {
                    v: sorted({round(x["final_loss"], 5) for x in runs[v]}) for v in variants
                },
            }
        )
    base = variants[0]
    last = "final loss" if args.command == "train" else "tokens' hash"
    print(
        f"| preset (params) | environment | {args.command} tokens/s median (runs) | / {base} | CPU-s per run | {last} |"
    )
    print("|---|---|---:|---:|---:|---|")
    for row in rows:
        tps, cpu = row["tokens_per_s"], row["cpu_s"]
        med = {v: statistics.median(tps[v]) for v in variants}
        for v in variants:
            print(
                f"| {row['preset']} ({row['params']}) | {v} | {med[v]:.0f} "
                f"({', '.join(f'{x:.0f}' for x in tps[v])}) | {med[v] / med[base]:.2f} "
                f"| {statistics.median(cpu[v]):.1f} | {row['final_losses'][v]} |"
            )
    print(
        f"{burners} burner process(es) on {os.cpu_count()} cores; load average before "
        f"{load_before}, after {os.getloadavg()}; command {args.command}; train args: {args.train_arg or 'default'}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "burners": burners}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
