"""The network lab: namespaces joined by a rate-limited switch, ranks inside them, clean-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from netlab import NetLab, available  # noqa: E402

REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network lab unavailable: {REASON}")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_lab_is_removed_even_when_the_body_fails():
    with pytest.raises(RuntimeError, match="boom"), NetLab(hosts=2, rate_mbit=50) as lab:
        names = set(lab.namespaces) | {lab.switch}
        assert names <= _namespaces()
        raise RuntimeError("boom")
    assert not names & _namespaces()


@pytest.mark.slow
def test_two_hosts_of_two_ranks_run_hierarchical_all_reduce(tmp_path):
    out = tmp_path / "rows.json"
    with NetLab(hosts=2, rate_mbit=100) as lab:
        names = set(lab.namespaces) | {lab.switch}
        procs = []
        for rank in range(4):
            cmd = [
                sys.executable,
                "-m",
                "torsh_distributed.cli.bench",
                "--ops",
                "all_reduce",
                "--sizes",
                "256K",
                "--impl",
                "ring,hierarchical",
                "--iters",
                "2",
                "--warmup",
                "1",
                "--rounds",
                "1",
                "--json",
                str(out),
            ]
            env = lab.rank_env(rank=rank, world_size=4, ranks_per_host=2, master_port=29621)
            procs.append(
                lab.popen(
                    rank // 2, cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
                )
            )
        codes = [p.wait(timeout=120) for p in procs]
        assert codes == [0, 0, 0, 0], [p.stderr.read().decode()[-2000:] for p in procs]
    assert not names & _namespaces()
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["ring"]["nodes"] == 2 and rows["ring"]["ranks"] == 4
    # Theory: ring moves 1.5 x 256 KiB over the 100 Mbit host link, ~31 ms (tbf's burst lets the
    # first few KiB through at line rate). Over loopback it takes ~1-3 ms, so > 10 ms shows the
    # traffic really crossed the throttled link, without depending on tbf's exact burst.
    assert rows["ring"]["time_us"] > 10_000
