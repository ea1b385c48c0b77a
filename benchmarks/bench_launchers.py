"""Launchers side by side: start-up to the first training step, and recovery after a node dies.

Start-up. The same 2-rank training of the tiny built-in GPT (5 steps) through each launcher, in
turns (round 1: every launcher once, round 2: ...), so load drifts hit all alike. The figure is
the trainer's ``first_step_unix_s`` minus ``time.time()`` just before the launcher starts:

* ``torsh-dist run``: ``torsh-dist train --nproc-per-node 2`` (agent, rendezvous, 2 workers);
* ``slurm (srun)``: ``srun -n 2 torsh-dist train`` on a private one-host Slurm cluster that is
  already up (as on a real cluster; its own start is not counted);
* ``mpirun``: ``mpirun -np 2 torsh-dist train`` (mpi4py rendezvous);
* ``ray`` / ``dask``: ``torsh_distributed.launch.ray`` / ``.dask`` of the trainer function,
  *including* the start of a local Ray / Dask cluster (what a user running it on a laptop pays;
  on a running cluster that part is gone).

Recovery. Three network-namespace hosts x 2 ranks, an elastic job (``--nnodes 2:3``, c10d,
``--max-restarts 3``, checkpoint every 10 steps); host 2 is SIGKILLed after step 20. Recovery
time = the first step finished at the new world size minus the moment of the kill (progress file
``progress.json``, same clock); steps lost = what the resumed run reports.

    .venv/bin/python benchmarks/bench_launchers.py [--rounds 3] [--skip ray,dask] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from launchers import mpi as mpi_bench  # noqa: E402
from launchers import ray_dask  # noqa: E402
from launchers import slurm as slurm_bench  # noqa: E402

# torch's c10d defaults, then a faster keep-alive: a dead node is dropped from the rendezvous
# after keep_alive_interval x keep_alive_max_attempt seconds without its agent's heartbeat
RECOVERY_CONFS = (
    "last_call_timeout=1",
    "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2",
)
CLI = [sys.executable, "-m", "torsh_distributed.cli.main"]
_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "GLOO_SOCKET_IFNAME", "TORCHELASTIC_ERROR_FILE")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def torsh_run(workdir: Path, *, max_steps: int = 5) -> dict:
    """``torsh-dist train --nproc-per-node 2``: start to first step."""
    workdir.mkdir(parents=True, exist_ok=True)
    summary = workdir / "run.json"
    summary.unlink(missing_ok=True)
    cmd = [*CLI, "train", "--nproc-per-node", "2", "--preset", "tiny", "--max-steps",
           str(max_steps), "--progress", "false", "--summary-json", str(summary),
           "--checkpoint-dir", str(workdir / "ck"), "--resume", "never"]
    start = time.time()
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"torsh-dist train failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    data = json.loads(summary.read_text())
    return {"launcher": "torsh-dist run", "start_to_first_step_s": data["first_step_unix_s"] - start,
            "final_loss": data["final_loss"]}


def startup(rounds: int, skip: set[str], workdir: Path) -> dict[str, list[dict]]:
    runners: dict[str, Callable[[Path], dict]] = {"torsh-dist run": torsh_run}
    if "mpirun" not in skip:
        runners["mpirun"] = lambda w: mpi_bench.time_to_first_step(w)
    for kind in ("ray", "dask"):
        if kind not in skip:
            runners[kind] = lambda w, kind=kind: ray_dask.time_to_first_step(kind, w)
    results: dict[str, list[dict]] = {name: [] for name in runners}
    cluster_cm = None
    if "slurm" not in skip:
        from torsh_distributed.testing.slurm_cluster import slurm_cluster

        cluster_cm = slurm_cluster()
        cluster = cluster_cm.__enter__()
        runners["slurm (srun)"] = lambda w: slurm_bench.time_to_first_step(cluster.env, w)
        results["slurm (srun)"] = []
    try:
        for r in range(rounds):
            for name, run in runners.items():
                row = run(workdir / f"{name.split()[0]}-{r}")
                results[name].append(row)
                print(f"round {r + 1}: {name:15s} {row['start_to_first_step_s']:6.2f} s  "
                      f"final loss {row['final_loss']:.6f}", flush=True)
    finally:
        if cluster_cm is not None:
            cluster_cm.__exit__(None, None, None)
    return results


def recovery(workdir: Path, rdzv_conf: str = "last_call_timeout=1") -> dict:
    from netlab import NetLab

    ckpt = workdir / "elastic"
    summary = workdir / "elastic.json"

    def progress() -> dict:
        try:
            return json.loads((ckpt / "progress.json").read_text())
        except (OSError, ValueError):
            return {}

    with NetLab(hosts=3, rate_mbit=0, net=47) as lab:
        argv = [*CLI, "train", "--nnodes", "2:3", "--rdzv-endpoint", f"{lab.address(0)}:29615",
                "--rdzv-conf", rdzv_conf, "--max-restarts", "3", "--nproc-per-node",
                "2", "--preset", "tiny", "--batch-size", "12", "--max-steps", "200",
                "--checkpoint-dir", str(ckpt), "--checkpoint.every", "10", "--progress", "false",
                "--summary-json", str(summary)]
        procs = [lab.popen(h, argv, env=_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL) for h in range(3)]
        deadline = time.monotonic() + 240
        while not (progress().get("world_size") == 6 and progress().get("step", 0) >= 20):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the job did not reach step 20 at 6 ranks: {progress()}")
            time.sleep(0.05)  # polling the job's progress file
        killed_at = time.time()
        step_at_kill = progress()["step"]
        lab.kill_host(2)
        while progress().get("world_size") != 4:
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs[:2]):
                raise RuntimeError(f"the job did not continue at 4 ranks: {progress()}")
            time.sleep(0.05)
        resumed = progress()
        for proc in procs[:2]:
            proc.wait(timeout=240)
    data = json.loads(summary.read_text())
    return {"rdzv_conf": rdzv_conf, "step_at_kill": step_at_kill, "recovery_s": resumed["unix_s"] - killed_at,
            "lost_steps": data["checkpoint"]["lost_steps"],
            "resumed_step": data["checkpoint"]["resumed_step"], "final_loss": data["final_loss"],
            "world_size": data["world_size"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma-separated: slurm,mpirun,ray,dask,recovery")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    with tempfile.TemporaryDirectory(prefix="bench-launchers-") as tmp:
        rows = startup(args.rounds, skip, Path(tmp))
        recs = [] if "recovery" in skip else [
            recovery(Path(tmp) / f"rec{i}", conf) for i, conf in enumerate(RECOVERY_CONFS)
        ]
    base = statistics.median(r["start_to_first_step_s"] for r in rows["torsh-dist run"])
    print(f"\nstart-up to first step, 2 ranks, median of {args.rounds} interleaved rounds:")
    print(f"{'launcher':16s} {'median s':>9s} {'min s':>7s} {'vs run':>7s}  final loss")
    table = {}
    for name, runs in rows.items():
        times = [r["start_to_first_step_s"] for r in runs]
        med = statistics.median(times)
        table[name] = {"median_s": med, "min_s": min(times), "runs_s": times,
                       "final_loss": runs[0]["final_loss"]}
        print(f"{name:16s} {med:9.2f} {min(times):7.2f} {med / base:6.2f}x  {runs[0]['final_loss']:.6f}")
    for rec in recs:
        print(f"\nrecovery after SIGKILL of 1 of 3 hosts at step {rec['step_at_kill']} "
              f"(--rdzv-conf {rec['rdzv_conf']}): {rec['recovery_s']:.1f} s to the first step at "
              f"{rec['world_size']} ranks, {rec['lost_steps']} steps lost (resumed at "
              f"{rec['resumed_step']})")
    if args.json:
        args.json.write_text(json.dumps({"startup": table, "recovery": recs}, indent=2))


if __name__ == "__main__":
    main()
