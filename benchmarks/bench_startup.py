"""Start-up of ``torsh-dist``: help, a refusal, and launch to the first training step, before vs
after a change, side by side in one invocation.

Each variant is a source tree of the package: ``after`` is the installed one, ``before`` (with
``--before DIR``) the ``src`` of an older commit, put first on ``PYTHONPATH`` (the launched ranks
inherit it), for example::

    mkdir -p /tmp/before && git archive 62b532d src | tar -x -C /tmp/before
    .venv/bin/python benchmarks/bench_startup.py --before /tmp/before --rounds 10 --train-rounds 3
    .venv/bin/python benchmarks/bench_startup.py --before /tmp/before --burners 2   # beside 2 busy loops

Measured per round, the variants taking turns (before, after, then after, before in the next
round, so neither always runs on a warmer cache):

* the wall time of ``torsh-dist --help``, ``torsh-dist train --help`` and the refusal
  ``torsh-dist train --nproc-per-node 0`` (the console script, as a user types it); with
  ``--refusals`` also of bad paths (a missing script, checkpoint directory or factory file), an
  MLflow server that is not listening, a bad federated setting, and parallel degrees or a
  batch that do not fit the world size;
* launch to the first training step of ``torsh-dist train --nproc-per-node 2 --preset tiny
  --max-steps 5``: ``time.time()`` just before the launch to the trainer's ``first_step_unix_s``
  (``--summary-json``; the end of step 1 on rank 0), the whole command's wall time, and its CPU
  seconds (user + system of the launcher and every process under it, the forkserver and the
  resource tracker too: this process is their subreaper and reaps them).

``--start-methods spawn,forkserver`` instead compares the installed tree's worker start methods
(``--start-method``, see docs/launch.md) on the 2-rank run, or ``--nproc N`` ranks::

    .venv/bin/python benchmarks/bench_startup.py --start-methods spawn,forkserver --train-rounds 5
    .venv/bin/python benchmarks/bench_startup.py --start-methods spawn,forkserver --nproc 4

``--burners K`` keeps K ``python -c 'while 1: pass'`` processes running throughout (a CPU-heavy
neighbour). The 1-minute load average is printed before and after.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TORSH_DIST = str(Path(sys.executable).with_name("torsh-dist"))
CLI_CASES: dict[str, list[str]] = {
    "torsh-dist --help": ["--help"],
    "torsh-dist train --help": ["train", "--help"],
    "torsh-dist train --nproc-per-node 0": ["train", "--nproc-per-node", "0"],
}
# --refusals: bad paths and an unreachable server, refused after `import torch` before the
# twenty-second session ({port}: a closed port, drawn per invocation)
REFUSALS: dict[str, list[str]] = {
    "torsh-dist run no_such_script.py": ["run", "no_such_script.py"],
    "torsh-dist generate --checkpoint /nonexistent --prompt a": [
        "generate", "--checkpoint", "/nonexistent", "--prompt", "a"],
    "torsh-dist train --model nets.py:make --dataset nets.py:data": [
        "train", "--model", "nets.py:make", "--dataset", "nets.py:data"],
    "torsh-dist train --nproc-per-node 2 --mlflow http://127.0.0.1:CLOSED": [
        "train", "--nproc-per-node", "2", "--mlflow", "http://127.0.0.1:{port}"],
    "torsh-dist federated --clients 0": ["federated", "--clients", "0"],
    "torsh-dist train --tp 3 --nproc-per-node 2": ["train", "--tp", "3", "--nproc-per-node", "2"],
    "torsh-dist train --batch-size 33 --nproc-per-node 2": [
        "train", "--batch-size", "33", "--nproc-per-node", "2"],
}
TRAIN = ["train", "--nproc-per-node", "2", "--preset", "tiny", "--max-steps", "5"]
_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "TORCHELASTIC_ERROR_FILE")


def _env(src: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def _load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def time_cli(argv: list[str], env: dict[str, str]) -> float:
    """Wall time of one ``torsh-dist ARGV`` (exit 0 for help, 2 for the refusal)."""
    start = time.perf_counter()
    done = subprocess.run([TORSH_DIST, *argv], env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    if done.returncode not in (0, 2) or (done.returncode == 2) != ("--help" not in argv):
        raise RuntimeError(f"torsh-dist {' '.join(argv)}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return wall


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _reap_descendants(keep: set[int], timeout: float = 60.0) -> None:
    """Wait for every child but ``keep`` (orphaned descendants come here: we are their
    subreaper), so their CPU time is in ``RUSAGE_CHILDREN``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children: set[int] = set()
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                children.update(int(pid) for pid in f.read().split())
        if not children - keep:
            return
        for pid in children - keep:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.02)
    raise RuntimeError(f"descendants still running after {timeout} s")


def time_train(env: dict[str, str], workdir: Path, extra: list[str],
               keep: set[int]) -> tuple[float, float, float]:
    """(launch to the end of the first step, the whole command, its CPU) in seconds."""
    summary = workdir / "summary.json"
    summary.unlink(missing_ok=True)
    cpu = _children_cpu()
    start = time.time()
    done = subprocess.run([TORSH_DIST, *TRAIN, *extra, "--summary-json", str(summary)], env=env,
                          cwd=workdir, capture_output=True, text=True, timeout=900)
    wall = time.time() - start
    _reap_descendants(keep)
    cpu = _children_cpu() - cpu
    if done.returncode != 0:
        raise RuntimeError(f"torsh-dist train failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(summary.read_text())["first_step_unix_s"] - start, wall, cpu


def _row(name: str, times: dict[str, list[float]]) -> str:
    cells = []
    first = next(iter(times))
    for i, values in enumerate(times.values()):
        cells.append(f"{statistics.median(values):.2f} (min {min(values):.2f})")
        if i == 1:
            ratio = statistics.median(times[first]) / statistics.median(values)
            cells.append(f"{ratio:.2f}x")
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", metavar="DIR", help="a tree holding the older src/ to compare")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the help/refusal runs")
    parser.add_argument("--train-rounds", type=int, default=3, help="rounds of the 2-rank run (0: skip)")
    parser.add_argument("--burners", type=int, default=0, help="busy-loop processes beside the runs")
    parser.add_argument("--start-methods", metavar="M,M",
                        help="compare worker start methods (e.g. spawn,forkserver) instead of trees")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the training run")
    parser.add_argument("--refusals", action="store_true",
                        help="also time refusals of bad paths and of an unreachable MLflow server")
    args = parser.parse_args()
    if args.refusals:
        from torsh_distributed.testing import find_free_port

        port = str(find_free_port())
        CLI_CASES.update({k: [a.replace("{port}", port) for a in v] for k, v in REFUSALS.items()})
    TRAIN[TRAIN.index("--nproc-per-node") + 1] = str(args.nproc)
    variants = {"after": _env(None)}
    extra: dict[str, list[str]] = {"after": []}
    if args.before:
        variants = {"before": _env(str(Path(args.before, "src").resolve())), **variants}
        extra["before"] = []
    if args.start_methods:
        methods = args.start_methods.split(",")
        variants = {m: _env(None) for m in methods}
        extra = {m: ["--start-method", m] for m in methods}
        args.rounds = 0  # help and refusals do not start workers
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: see time_train
    burners = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.burners)]
    try:
        time.sleep(1.0 if burners else 0.0)
        print(f"load before: {_load()} ({args.burners} burners, {os.cpu_count()} CPUs)", flush=True)
        cli: dict[str, dict[str, list[float]]] = {name: {v: [] for v in variants} for name in CLI_CASES}
        order = list(variants)
        for r in range(args.rounds):
            for variant in order if r % 2 == 0 else order[::-1]:
                for name, argv in CLI_CASES.items():
                    cli[name][variant].append(time_cli(argv, variants[variant]))
        first: dict[str, list[float]] = {v: [] for v in variants}
        whole: dict[str, list[float]] = {v: [] for v in variants}
        cpu: dict[str, list[float]] = {v: [] for v in variants}
        with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
            for r in range(args.train_rounds):
                for variant in order if r % 2 == 0 else order[::-1]:
                    to_first, wall, used = time_train(variants[variant], Path(tmp), extra[variant],
                                                      {p.pid for p in burners})
                    first[variant].append(to_first)
                    whole[variant].append(wall)
                    cpu[variant].append(used)
                    print(f"round {r + 1} {variant}: first step {to_first:.2f} s, whole {wall:.2f} s, "
                          f"CPU {used:.2f} s (load {_load()})", flush=True)
        print(f"load after: {_load()}")
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()
    names = list(variants)
    head = " | ".join(f"{v} median s" + (f" | {names[0]} / {v}" if i == 1 else "")
                      for i, v in enumerate(names))
    print(f"\n| command | {head} |\n|---|" + "---|" * (len(names) + (1 if len(names) > 1 else 0)))
    for name in CLI_CASES if args.rounds else ():
        print(_row(f"`{name}`", cli[name]))
    if args.train_rounds:
        print(_row(f"`torsh-dist {' '.join(TRAIN)}`: launch to first step", first))
        print(_row("the same: whole command", whole))
        print(_row("the same: CPU seconds, every process", cpu))
    print("\nruns (s):", json.dumps({"cli": cli, "first_step": first, "whole": whole, "cpu": cpu}))


if __name__ == "__main__":
    main()
