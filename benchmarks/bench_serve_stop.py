"""How long `torsh-dist serve --tp N` takes to start and to stop after SIGTERM.

Trains a ``tiny`` checkpoint (20 steps, one process) unless ``--checkpoint`` names one, then for
each ``--tp`` value, ``--rounds`` times: starts ``torsh-dist serve --checkpoint CKPT --tp N`` on a
free loopback port, times the launch to the ``listening on`` line, waits a second, sends SIGTERM
to the launcher and times the signal to the launcher's exit. Prints one line per run and the
medians.

Before the seventeenth session a 2-rank server took ~30 s to stop: torch's elastic agent keeps a
worker started as a function (our warm forkserver path) waiting, after it returned, for an event
that its ``close`` never sets, so every stop waited the whole 30 s shutdown timeout and then
SIGKILLed workers that had finished cleanly (``elastic/_agent.py`` releases them).

    python benchmarks/bench_serve_stop.py --tp 1 2 --rounds 3
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torsh_distributed.testing import find_free_port

CLI = [sys.executable, "-m", "torsh_distributed.cli.main"]


def _checkpoint(root: Path) -> str:
    out = root / "ckpt"
    subprocess.run([*CLI, "train", "--preset", "tiny", "--max-steps", "20", "--checkpoint-dir", str(out),
                    "--progress", "false"], check=True, capture_output=True, timeout=600)  # fmt: skip
    return str(out)


def _one(checkpoint: str, tp: int) -> tuple[float, float]:
    """(launch to listening, SIGTERM to exit) in seconds."""
    port = find_free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([*CLI, "serve", "--checkpoint", checkpoint, "--tp", str(tp), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    assert proc.stdout is not None
    ready = None
    for line in proc.stdout:
        if "listening on" in line:
            ready = time.monotonic() - t0
            break
    if ready is None:
        proc.wait(timeout=60)
        raise RuntimeError(f"tp {tp}: the server exited ({proc.returncode}) before it listened")
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    return ready, time.monotonic() - sent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel degrees (default 1 2)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per degree (default 3)")
    parser.add_argument("--checkpoint", default="", help="a run's checkpoint directory (default: train one)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or any(t < 1 for t in args.tp):
        parser.error("--rounds and every --tp must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or _checkpoint(Path(tmp))
        results: dict[int, list[tuple[float, float]]] = {t: [] for t in args.tp}
        for r in range(args.rounds):
            for tp in args.tp:
                ready, stop = _one(checkpoint, tp)
                results[tp].append((ready, stop))
                print(f"round {r} tp {tp}: listening after {ready:.2f} s, exited {stop:.2f} s after SIGTERM",
                      flush=True)  # fmt: skip
    for tp, runs in results.items():
        print(f"tp {tp}: median start {statistics.median(r[0] for r in runs):.2f} s, "
              f"median stop {statistics.median(r[1] for r in runs):.2f} s ({len(runs)} runs)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
