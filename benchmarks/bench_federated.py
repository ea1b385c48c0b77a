"""Federated rounds on Flower: accuracy vs rounds by data split and by strategy under stragglers,
and the built-in corpus split by package, each configuration a real ``torsh-dist federated`` run.

Every configuration is started as a user would start it (``python -m torsh_distributed.cli.main
federated ...`` in a subprocess: a SuperLink, one SuperNode per client, the ServerApp on Flower's
deployment engine), with its own run directory under a temporary directory and ``--resume
never``; its ``--summary-json`` is read back. The configurations of a group run one after the
other in the same invocation, so they share the machine's conditions. Three groups:

* ``iid-vs-dirichlet``: FedAvg on scikit-learn's digits (``examples/federated_digits.py``: 1,497
  training images dealt to the clients, the server's accuracy on 256 of the 300 held-out ones)
  with an IID split and a Dirichlet(``--alpha``) label split, everything else equal;
* ``stragglers``: the Dirichlet split with ``--stragglers`` of the clients doing a uniform share
  of their local steps each round (the FedProx paper's systems heterogeneity): FedAvg dropping
  the stragglers' updates (``--straggler-policy drop``, FedAvg as that paper runs it), FedProx
  keeping their partial work (``keep``, proximal term ``--proximal-mu``) and FedAdam keeping it
  (server learning rate ``--server-lr``);
* ``corpus``: the default run of the issue, ``torsh-dist federated --clients 3 --rounds 3`` (the
  built-in GPT on the standard library split by package), timed end to end (process start to
  exit) with its loss per round.

The digits runs use the first seed from ``--seed`` whose first Dirichlet draw already gives
every client at least one batch (printed; the same seed in every digits run). Since commit
895cd50 the run's task redraws a split that leaves a client less than a batch; before, such a
client failed every round. With this seed the split is the same either way.

    .venv/bin/python benchmarks/bench_federated.py --json fl.json --plot fl.png
    .venv/bin/python benchmarks/bench_federated.py --only stragglers
    .venv/bin/python benchmarks/bench_federated.py --smoke      # 2 clients, 1 round, IID only
    .venv/bin/python benchmarks/bench_federated.py --check      # parse every run's flags, start nothing
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "federated_digits.py"
GROUPS = ("iid-vs-dirichlet", "stragglers", "corpus")


def _digits_flags() -> list[str]:
    return [
        "--model", f"{DIGITS}:make_model", "--dataset", f"{DIGITS}:train_set",
        "--val-dataset", f"{DIGITS}:test_set",
    ]  # fmt: skip


def _seed_with_full_batches(args: argparse.Namespace) -> int:
    """The first seed from ``args.seed`` whose first Dirichlet draw gives every client a batch."""
    sys.path.insert(0, str(DIGITS.parent))
    import federated_digits

    from torsh_distributed.federated.partition import partition_indices

    data = federated_digits.train_set()
    for seed in range(args.seed, args.seed + 1000):
        parts = partition_indices("dirichlet", data, num_clients=args.clients, seed=seed, alpha=args.alpha)
        if min(len(p) for p in parts) >= args.batch_size:
            sizes = sorted(len(p) for p in parts)
            print(f"seed {seed}: Dirichlet({args.alpha:g}) client sizes {sizes}", flush=True)
            return seed
    raise SystemExit(f"no seed in [{args.seed}, {args.seed + 1000}) gives every client {args.batch_size} samples")


def _configs(args: argparse.Namespace, groups: list[str]) -> list[dict[str, Any]]:
    """(group, name, CLI flags) of every run, in the order they run."""
    runs: list[dict[str, Any]] = []
    if {"iid-vs-dirichlet", "stragglers"} & set(groups):
        seed = _seed_with_full_batches(args)
        common = [
            *_digits_flags(), "--clients", str(args.clients), "--rounds", str(args.rounds),
            "--local-steps", str(args.local_steps), "--batch-size", str(args.batch_size),
            "--lr", str(args.lr), "--seed", str(seed),
        ]  # fmt: skip
        dirichlet = ["--partition", "dirichlet", "--alpha", str(args.alpha)]
        if "iid-vs-dirichlet" in groups:
            runs.append({"group": "iid-vs-dirichlet", "name": "FedAvg, IID",
                         "flags": [*common, "--strategy", "fedavg", "--partition", "iid"]})
            runs.append({"group": "iid-vs-dirichlet", "name": f"FedAvg, Dirichlet({args.alpha:g})",
                         "flags": [*common, "--strategy", "fedavg", *dirichlet]})
        if "stragglers" in groups:
            slow = [*dirichlet, "--stragglers", str(args.stragglers)]
            runs.append({"group": "stragglers", "name": "FedAvg, drop stragglers",
                         "flags": [*common, *slow, "--strategy", "fedavg", "--straggler-policy", "drop"]})
            runs.append({"group": "stragglers", "name": f"FedProx mu={args.proximal_mu:g}, keep",
                         "flags": [*common, *slow, "--strategy", "fedprox", "--straggler-policy", "keep",
                                   "--proximal-mu", str(args.proximal_mu)]})
            runs.append({"group": "stragglers", "name": f"FedAdam eta={args.server_lr:g}, keep",
                         "flags": [*common, *slow, "--strategy", "fedadam", "--straggler-policy", "keep",
                                   "--server-lr", str(args.server_lr)]})
    if "corpus" in groups:
        flags = ["--clients", str(args.corpus_clients), "--rounds", str(args.corpus_rounds)]
        runs.append({"group": "corpus", "name": "built-in corpus by package", "flags": flags + args.corpus_extra})
    return runs


def _check(runs: list[dict[str, Any]]) -> None:
    """Parse every run's flags with the real CLI into its validated config; start nothing."""
    from torsh_distributed.cli.federated import config_from_args
    from torsh_distributed.cli.main import build_parser

    parser = build_parser("federated")
    for run in runs:
        ns = parser.parse_args(["federated", *run["flags"], "--resume", "never"])
        cfg = config_from_args(ns)
        print(
            f"check {run['group']}: {run['name']}: strategy {cfg.strategy}, partition {cfg.partition}, "
            f"alpha {cfg.alpha:g}, clients {cfg.clients}, rounds {cfg.rounds}, local steps "
            f"{cfg.client.local_steps}, stragglers {cfg.stragglers:g} ({cfg.straggler_policy}), "
            f"mu {cfg.proximal_mu:g}, server lr {cfg.server_lr:g}, seed {cfg.seed}"
        )


def _load() -> float:
    return os.getloadavg()[0]


def _attempt(cmd: list[str], timeout: float) -> tuple[int, list[str]]:
    """Run ``cmd``, echoing its round lines as they come; (exit code, output lines)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # round lines as they happen
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )  # fmt: skip

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)  # the CLI stops its SuperLink and SuperNodes

    killer = threading.Timer(timeout, kill)
    killer.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("federated: round"):
                print("  " + line.rstrip(), flush=True)
        return proc.wait(), lines
    finally:
        killer.cancel()


def _result(
    run: dict[str, Any], summary: dict[str, Any], *, wall: float | None, load: tuple[float, float] | None
) -> dict[str, Any]:
    """One run's record from its summary (``wall``: end to end; ``load``: 1-min load average
    before and after; ``None`` when rebuilt from a kept run directory)."""
    rounds = summary["rounds"]
    return {
        **{k: run[k] for k in ("group", "name")},
        "command": "torsh-dist federated " + " ".join(run["flags"]),
        "wall_s": wall,
        "server_wall_s": summary.get("wall_time_s"),
        "load_before": load[0] if load else None,
        "load_after": load[1] if load else None,
        "rounds": [
            {
                "round": r["round"],
                "loss": r["loss"],
                "train_loss": r.get("train_loss"),
                "accuracy": r.get("accuracy"),
                "sampled": r["sampled"],
                "answered": r["answered"],
                "stragglers_kept": sum(1 for c in r["clients"] if c["straggler"]),
                "steps": sum(c["steps"] for c in r["clients"]),
                "bytes": r["bytes"]["total"],
                "seconds": r["seconds"],
                "failed": r["failed"],
            }
            for r in rounds
        ],
        "errors": sorted({e for r in rounds for e in r.get("errors", [])}),
        "failed_attempts": [],
    }


def _slug(run: dict[str, Any]) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in f"{run['group']}-{run['name']}").lower()


def _from_runs(runs: list[dict[str, Any]], work: Path) -> list[dict[str, Any]]:
    """The records of the runs whose summary a kept ``--keep-runs`` directory holds (the last
    attempt's); end-to-end wall time and load are not in a summary and show as n/a."""
    results = []
    for run in runs:
        found = sorted(work.glob(f"{_slug(run)}-[0-9]*.json"))
        if found:
            results.append(_result(run, json.loads(found[-1].read_text()), wall=None, load=None))
            print(f"{run['name']}: {found[-1]}")
    return results


def _run(run: dict[str, Any], work: Path, timeout: float, retries: int) -> dict[str, Any]:
    slug = _slug(run)
    print(f"\n== {run['group']}: {run['name']}\n$ torsh-dist federated {' '.join(run['flags'])}", flush=True)
    failures: list[str] = []
    for attempt in range(retries + 1):
        run_dir, out = work / f"{slug}-{attempt}", work / f"{slug}-{attempt}.json"
        flags = [*run["flags"], "--run-dir", str(run_dir), "--resume", "never", "--summary-json", str(out)]
        cmd = [sys.executable, "-m", "torsh_distributed.cli.main", "federated", *flags]
        load_before = _load()
        started = time.perf_counter()
        code, lines = _attempt(cmd, timeout)
        wall = time.perf_counter() - started
        if code == 0 and out.exists():
            break
        tail = " | ".join(lines[-3:])
        failures.append(f"attempt {attempt + 1}: exit {code} after {wall:.0f} s: {tail}")
        print(f"  FAILED ({failures[-1]}); logs in {run_dir / 'logs'}", flush=True)
    else:  # recorded, and the other runs go on
        return {**{k: run[k] for k in ("group", "name")}, "command": "torsh-dist federated " + " ".join(run["flags"]),
                "rounds": [], "failed_attempts": failures}
    result = _result(run, json.loads(out.read_text()), wall=wall, load=(load_before, _load()))
    result["failed_attempts"] = failures
    errors = result["errors"]
    if errors:
        print(f"  client errors: {errors}", flush=True)
    return result


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None or value != value else format(value, spec)


def _first_round(result: dict[str, Any], target: float) -> str:
    for r in result["rounds"]:
        if (r["accuracy"] or 0.0) >= target:
            return str(r["round"])
    return "never"


def _group_tables(group: str, results: list[dict[str, Any]]) -> str:
    rows = [r for r in results if r["group"] == group and r["rounds"]]
    if not rows:
        return ""
    metric = "accuracy" if rows[0]["rounds"][0]["accuracy"] is not None else "loss"
    spec = ".3f" if metric == "accuracy" else ".4f"
    what = "accuracy (and loss)" if metric == "accuracy" else "loss"
    lines = [f"### {group}: server {what} after each round", ""]
    lines.append("| round | " + " | ".join(r["name"] for r in rows) + " |")
    lines.append("|---:|" + "---:|" * len(rows))
    for i in range(max(len(r["rounds"]) for r in rows)):
        cells = []
        for r in rows:
            if i >= len(r["rounds"]):
                cells.append("")
                continue
            rd = r["rounds"][i]
            cell = _fmt(rd[metric], spec)
            if metric == "accuracy":
                cell += f" ({_fmt(rd['loss'], '.3f')})"
            cells.append(cell)
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines += ["", "| run | final " + metric + " | best | first round >= 0.7 | >= 0.8 | updates aggregated "
              "per round | straggler updates kept | local steps aggregated per round | MB per round | s per round "
              "| wall s | load avg before/after |", "|---|" + "---:|" * 11]
    for r in rows:
        rds = r["rounds"]
        values = [rd[metric] for rd in rds]
        best = max(values) if metric == "accuracy" else min(values)
        n = len(rds)
        lines.append(
            f"| {r['name']} | {_fmt(values[-1], spec)} | {_fmt(best, spec)} | "
            + (f"{_first_round(r, 0.7)} | {_first_round(r, 0.8)} | " if metric == "accuracy" else "- | - | ")
            + f"{sum(rd['answered'] for rd in rds) / n:.1f} of {sum(rd['sampled'] for rd in rds) / n:.1f} | "
            f"{sum(rd['stragglers_kept'] for rd in rds) / n:.1f} | {sum(rd['steps'] for rd in rds) / n:.0f} | "
            f"{sum(rd['bytes'] for rd in rds) / n / 1e6:.2f} | {sum(rd['seconds'] for rd in rds) / n:.1f} | "
            f"{_fmt(r['wall_s'], '.0f')} | {_fmt(r['load_before'], '.1f')} / {_fmt(r['load_after'], '.1f')} |"
        )
    return "\n".join(lines) + "\n"


def _plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g for g in GROUPS if any(r["group"] == g for r in results)]
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4), squeeze=False)
    for ax, group in zip(axes[0], groups, strict=True):
        for r in (r for r in results if r["group"] == group and r["rounds"]):
            xs = [rd["round"] for rd in r["rounds"]]
            acc = [rd["accuracy"] for rd in r["rounds"]]
            ys = acc if acc[0] is not None else [rd["loss"] for rd in r["rounds"]]
            ax.plot(xs, ys, marker="o", markersize=3, label=r["name"])
        ax.set_title(group)
        ax.set_xlabel("round")
        ax.set_ylabel("server accuracy" if group != "corpus" else "server val loss")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot written to {path}")


def _write_json(path: str, results: list[dict[str, Any]], wall: float) -> None:
    import flwr
    import torch

    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flwr": flwr.__version__,
        "argv": sys.argv[1:],
        "wall_s": wall,
    }
    Path(path).write_text(json.dumps({"meta": meta, "runs": results}, indent=2) + "\n")


def _report(args: argparse.Namespace, results: list[dict[str, Any]], total: float) -> None:
    print()
    for group in GROUPS:
        table = _group_tables(group, results)
        if table:
            print(table)
    for r in results:
        if not r["rounds"]:
            print(f"{r['name']}: FAILED every attempt: {r['failed_attempts']}")
            continue
        print(f"{r['name']}: {_fmt(r['wall_s'], '.1f')} s end to end (server loop {r['server_wall_s']:.1f} s)")
        for failure in r["failed_attempts"]:
            print(f"  earlier failed attempt, rerun: {failure}")
    print(f"benchmark wall time: {total:.0f} s")
    if args.json:
        _write_json(args.json, results, total)
        print(f"results written to {args.json}")
    if args.plot:
        _plot(results, args.plot)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=GROUPS, default=list(GROUPS), help="run these groups")
    parser.add_argument("--clients", type=int, default=10, help="digits runs: clients")
    parser.add_argument("--rounds", type=int, default=8, help="digits runs: rounds")
    parser.add_argument("--local-steps", type=int, default=25, help="digits runs: local SGD steps per round")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1, help="client learning rate")
    parser.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration")
    parser.add_argument("--stragglers", type=float, default=0.3)
    parser.add_argument("--proximal-mu", type=float, default=0.01, help="FedProx's mu (the CLI's default)")
    parser.add_argument("--server-lr", type=float, default=0.1, help="FedAdam's eta (the CLI's default)")
    parser.add_argument("--seed", type=int, default=1234, help="first seed tried for the Dirichlet split")
    parser.add_argument("--corpus-clients", type=int, default=3)
    parser.add_argument("--corpus-rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    parser.add_argument("--retries", type=int, default=1,
                        help="rerun a run that ended without a summary this often (recorded in the JSON)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG of accuracy (loss) vs rounds here")
    parser.add_argument("--keep-runs", help="run directories go here (default: a deleted temp dir)")
    parser.add_argument("--from-runs", metavar="DIR",
                        help="run nothing: tables, JSON and plot from the summaries a --keep-runs DIR holds")
    parser.add_argument("--smoke", action="store_true", help="seconds, not minutes: 2 clients, 1 round, IID")
    parser.add_argument("--check", action="store_true", help="only parse every run's flags with the CLI")
    args = parser.parse_args(argv)
    args.corpus_extra = []
    if args.smoke:
        args.only = ["iid-vs-dirichlet"]
        args.clients, args.rounds, args.local_steps, args.alpha = 2, 1, 2, 100.0

    runs = _configs(args, args.only)
    if args.smoke:
        runs = runs[:1]
    if args.check:
        _check(runs)
        return 0
    started = time.perf_counter()
    if args.from_runs:
        results = _from_runs(runs, Path(args.from_runs))
        _report(args, results, time.perf_counter() - started)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-federated-") as tmp:
        work = Path(args.keep_runs) if args.keep_runs else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = []
        for run in runs:
            results.append(_run(run, work, args.timeout, args.retries))
            if args.json:  # after every run: a stopped benchmark keeps what it measured
                _write_json(args.json, results, time.perf_counter() - started)
    _report(args, results, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
