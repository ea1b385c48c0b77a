"""Carbon-aware scaling over whole nodes: `torsh-dist train --nnodes 1:2 --carbon.scale` on two
network-namespace hosts (one worker each) and a series that is dirty when the job starts and is
replaced, once node 0 trains, by one clean from then on (a refreshed forecast: --carbon.refresh).
Node 0 runs the first segment alone while node 1 waits; at its first check after the change the
job checkpoints, and both nodes run the second segment from that checkpoint. The world size
follows the series and the job ends at the loss of an uninterrupted run (the elastic tests'
tolerance).

The change is made when node 0 says it trained its first step, so no slot has to be placed
against a start-up time guessed in advance: nothing here races the wall clock, and the test runs
beside the rest of the suite. Rank 0 is paced (``TORSH_FAULT=slow``, 20 ms a step) so that the
first segment cannot end before the job looks at the new series (every 0.5 s of steps)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from netlab import NetLab, available  # noqa: E402

REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network lab unavailable: {REASON}")

STEPS = 200
QUICK = ["--preset", "tiny", "--data.max-bytes", "200000", "--max-steps", str(STEPS), "--batch-size", "8",
         "--eval-batches", "1", "--progress", "false", "--threads", "1"]
CLI = [sys.executable, "-m", "torsh_distributed.cli.main", "train"]
CLEAN, DIRTY = 100, 400
REFRESH_S = 0.5  # --carbon.refresh: the job looks at the series file at least this often
FIRST_STEP = "memory per rank after step 1"  # rank 0's line once the first step ran
_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "GLOO_SOCKET_IFNAME", "TORCHELASTIC_ERROR_FILE", "TORSH_NODE_ADDR")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_nodes_follow_the_series_and_the_loss_is_the_uninterrupted_runs(tmp_path: Path) -> None:
    ref_run = subprocess.run([*CLI, *QUICK, "--energy.meter", "off", "--summary-json", str(tmp_path / "ref.json")],
                             env=_env(), capture_output=True, text=True, timeout=200)
    assert ref_run.returncode == 0, ref_run.stderr[-3000:]
    ref = json.loads((tmp_path / "ref.json").read_text())
    series = tmp_path / "s.csv"
    _write_series(series, round(time.time(), 3) - 1.0, [DIRTY] * 900 + [CLEAN])  # dirty for 15 minutes
    with NetLab(hosts=2, rate_mbit=0, net=73) as lab:
        procs = []
        for host in range(2):
            argv = [*CLI, *QUICK, "--nnodes", "1:2", "--node-rank", str(host), "--master-addr", lab.address(0),
                    "--master-port", "29731", "--carbon.scale", "--carbon.series", str(series),
                    "--carbon.refresh", str(REFRESH_S), "--checkpoint.dir", str(tmp_path / "ckpt"),
                    "--summary-json", str(tmp_path / "scaled.json")]
            env = {**_env(), "TORSH_FAULT": "slow:rank=0:ms=20"}
            procs.append(lab.popen(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        pool = ThreadPoolExecutor(2)
        node1 = pool.submit(procs[1].communicate, timeout=None)
        lines: list[str] = []
        changed: list[float] = []

        def follow_node0() -> None:  # the series changes once node 0 trained its first step
            assert procs[0].stdout is not None
            for raw in procs[0].stdout:
                lines.append(raw.decode(errors="replace"))
                if not changed and FIRST_STEP in lines[-1]:
                    changed.append(round(time.time(), 3))
                    _write_series(series, changed[0] - 1.0, [DIRTY] + [CLEAN] * 900)  # clean from now on

        reader = pool.submit(follow_node0)
        try:
            reader.result(timeout=240)
            procs[0].wait(timeout=60)
            out1 = node1.result(timeout=60)[0]
        except (subprocess.TimeoutExpired, TimeoutError):
            for proc in procs:
                proc.kill()
            lab.kill_host(0)
            lab.kill_host(1)
            out1 = node1.result(timeout=30)[0]
            pytest.fail("a node did not end within 240 s; node 0's output, then node 1's:\n"
                        + "".join(lines)[-4000:] + "\n=====\n" + out1.decode(errors="replace")[-4000:])
        finally:
            pool.shutdown(wait=False)
        clean_at = changed[0] if changed else math.nan
        outs = ["".join(lines), out1.decode(errors="replace")]
    assert [p.returncode for p in procs] == [0, 0], "\n=====\n".join(o[-3000:] for o in outs)
    data = json.loads((tmp_path / "scaled.json").read_text())
    scaling = data["carbon"]["scaling"]
    segments = scaling["segments"]
    assert scaling["world_sizes"] == [1, 2], (scaling["decisions"], outs[0][-3000:])
    assert [(d["intensity"], d["world_size"]) for d in scaling["decisions"]] == [(DIRTY, 1), (CLEAN, 2)]
    stop = segments[0]["stop"]
    assert (stop["intensity"], stop["world_size"]) == (CLEAN, 2) and stop["unix_s"] >= clean_at
    assert [(s["start_step"], s["end_step"]) for s in segments] == [(0, stop["step"]), (stop["step"], STEPS)]
    assert "torsh-dist: segment 0: 1 node(s) x 1 worker(s)" in outs[0]
    assert f"carbon: {series} changed: following the new series" in outs[0]
    assert "torsh-dist: node 1: segment 0: waits (1 node(s) run it)" in outs[1]
    assert "torsh-dist: node 1: segment 1: joins 2 node(s)" in outs[1]
    assert data["steps"] == STEPS and data["world_size"] == 2
    assert data["initial_loss"] == pytest.approx(ref["initial_loss"], abs=1e-6)
    for key in ("final_loss", "val_loss"):
        assert data[key] == pytest.approx(ref[key], abs=2e-3), key


def _write_series(path: Path, start: float, values: list[int]) -> None:
    """1 s slots from ``start``; written beside and renamed over ``path`` (a reader never sees
    half of it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("timestamp,gCO2/kWh\n" + "".join(f"{start + i:.3f},{v}\n" for i, v in enumerate(values)))
    os.replace(tmp, path)
