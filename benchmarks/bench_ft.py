"""Replica groups vs today's full restart: time and steps lost per failure, paired in one run.

The same job, ``torsh-dist train --nproc-per-node 4 --zero-stage 2 --preset tiny --max-steps
60``, runs four times, interleaved: without and with a SIGKILL of rank 3 after step
``--kill-step``, each

* **full restart** (today): ``--max-restarts 1 --checkpoint-dir D --checkpoint-every E``: the
  torchrun-style agent restarts every rank, which resume from the newest checkpoint
  (``TORSH_FAULT=kill:...``);
* **replica groups**: ``--ft.replica-groups 2`` (2 groups x 2 ranks, ZeRO-2 inside): only group 1
  restarts and heals from group 0 over the network (``TORSH_FT_FAULT=kill:...``).

Printed per mode: the job's wall time without and with the failure (their difference is the time
the failure cost the job), the time from the kill to the first step after it (full restart) or the
healthy group's stall and the restarted group's rejoin (replica groups), the steps redone by every
rank (full restart: kill step - checkpoint step) or lost by the healthy groups (0), the steps
trained without the dead group's share, and the final loss. Also the load average.

Usage::

    python benchmarks/bench_ft.py [--kill-step 20] [--every 15] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _job(
    mode: str,
    *,
    kill: bool,
    kill_step: int,
    every: int,
    steps: int,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        log, summary = Path(tmp) / "faults.jsonl", Path(tmp) / "summary.json"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env["TORSH_FAULT_LOG"] = str(log)
        argv = [
            sys.executable,
            "-m",
            "torsh_distributed.cli.main",
            "train",
            "--nproc-per-node",
            "4",
            "--zero-stage",
            "2",
            "--preset",
            "tiny",
            "--max-steps",
            str(steps),
            "--progress",
            "false",
            "--eval-batches",
            "1",
            "--summary-json",
            str(summary),
            "--energy.meter",
            "off",
        ]
        if mode == "full restart":
            argv += [
                "--max-restarts",
                "1",
                "--checkpoint-dir",
                str(Path(tmp) / "ckpt"),
                "--checkpoint-every",
                str(every),
            ]
            if kill:
                env["TORSH_FAULT"] = f"kill:rank=3:step={kill_step}"
        elif mode == "replica groups":
            argv += ["--ft.replica-groups", "2", *extra]
            if kill:
                env["TORSH_FT_FAULT"] = f"kill:rank=3:step={kill_step}"
        started = time.perf_counter()
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - started
        if proc.returncode:
            raise SystemExit(f"{mode} job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        events = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        result = json.loads(summary.read_text())
    out: dict[str, Any] = {
        "wall_s": wall,
        "final_loss": result["final_loss"],
        "steps": result["steps"],
        "fit_s": result.get("wall_time_s"),  # the reporting rank's fit(): no process start-up
    }
    if "ft" in result and result["ft"]:
        out["ft_time_s"] = result["ft"].get("time_s")
    if not kill:
        return out
    kill_event = next(e for e in events if e["event"] == "kill")
    if mode == "full restart":
        resumed = next(e for e in events if e["event"] == "resumed")
        first = next(e for e in events if e["event"] == "first_step" and e["attempt"] == 1)
        out.update(
            recovery_s=first["t"] - kill_event["t"],
            redone_steps=kill_event["step"] - resumed["step"],
            ranks_redoing=4,
            steps_without_group=0,
            stall_s=first["t"] - kill_event["t"],
        )
    else:
        failure, *more = result["ft"]["failures"]  # more: the restarted group failed again
        out["failures"] = result["ft"]["failures"]
        membership = result["ft"]["steps"]
        out.update(
            recovery_s=failure["recovery_s"],
            stall_s=failure["healthy_stall_s"],
            stall_steps=failure["healthy_stall_steps"],
            redone_steps=0,
            ranks_redoing=0,
            steps_without_group=sum(1 for m in membership if len(m) < 2),
            rejoined_step=failure["rejoined_step"],
            median_step_s=result["ft"]["median_step_s"],
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--every", type=int, default=15, help="full restart's checkpoint interval")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    load = [os.getloadavg()[0]]
    runs: dict[tuple[str, bool], dict[str, Any]] = {}
    for kill in (False, True):  # interleaved: both modes see the same load drift
        for mode in ("full restart", "replica groups"):
            runs[(mode, kill)] = _job(
                mode, kill=kill, kill_step=args.kill_step, every=args.every, steps=args.steps
            )
            load.append(os.getloadavg()[0])
            print(
                f"{mode} {'kill' if kill else 'clean'}: {json.dumps(runs[(mode, kill)])}",
                flush=True,
            )
    print(f"\nload average (1 min) during the runs: {min(load):.1f}-{max(load):.1f}\n")
    print(
        "| mode | job wall, no failure | job wall, 1 failure | cost of the failure | "
        "kill -> first step after it | healthy ranks' stall | steps redone (x ranks) | "
        "steps without the group's share | final loss (kill) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in ("full restart", "replica groups"):
        clean, hit = runs[(mode, False)], runs[(mode, True)]
        stall = (
            f"{hit['stall_s']:.1f} s (all ranks down)"
            if mode == "full restart"
            else f"{hit['stall_s']:.2f} s ({hit['stall_steps']} steps of "
            f"{hit['median_step_s']:.3f} s)"
        )
        if mode == "full restart":
            first = f"{hit['recovery_s']:.1f} s"
        elif hit["recovery_s"] is None:
            first = "group 1 had not rejoined when group 0 finished; group 0 never stopped"
        else:
            first = (
                f"group 1 rejoined after {hit['recovery_s']:.1f} s (step "
                f"{hit['rejoined_step']}); group 0 never stopped"
            )
        print(
            f"| {mode} | {clean['wall_s']:.1f} s | {hit['wall_s']:.1f} s | "
            f"{hit['wall_s'] - clean['wall_s']:+.1f} s | {first} | {stall} | "
            f"{hit['redone_steps']} (x {hit['ranks_redoing']}) | {hit['steps_without_group']} | "
            f"{hit['final_loss']:.4f} (clean {clean['final_loss']:.4f}) |"
        )


if __name__ == "__main__":
    main()
