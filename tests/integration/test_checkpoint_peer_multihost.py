"""Checkpoints without a shared file system, on network-namespace hosts (benchmarks/netlab).

Three hosts, one rank each, each with its own ``--checkpoint-dir`` and ``--checkpoint.peer-replicas
1``. After a save, host 1's worker is killed in the middle of receiving a replica of the next one and
host 2's directory is deleted (a replacement node with an empty disk); the job is started again,
resumes from the previous complete step out of the peers' copies, and must end bit-identical to
the same job run without interruption: the same loss at every step, the same final and
validation loss, the same final model and optimizer tensors (the engine re-buckets DDP before a
resumed run's first step, so its sums across the 3 ranks run in the uninterrupted run's order;
docs/fault-tolerance.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from netlab import NetLab, available  # noqa: E402

REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network lab unavailable: {REASON}")

CLI = [sys.executable, "-m", "torsh_distributed.cli.main"]
HOSTS, STEPS, EVERY = 3, 12, 4
_DROP = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GLOO_SOCKET_IFNAME",
    "TORCHELASTIC_ERROR_FILE",
    "TORSH_NODE_ADDR",
    "TORSH_NODE_ASSIGNMENT",
    "TORSH_FAULT",
)


def _env(fault: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env["OMP_NUM_THREADS"] = "1"
    if fault:
        env["TORSH_FAULT"] = fault
    return env


def _train(directory: Path, summary: Path, *extra: str) -> list[str]:
    return [
        *CLI,
        "train",
        "--preset",
        "tiny",
        "--batch-size",
        "12",
        "--max-steps",
        str(STEPS),
        "--log-every",
        "4",
        "--progress",
        "false",
        "--eval-batches",
        "1",
        "--summary-json",
        str(summary),
        "--checkpoint-dir",
        str(directory),
        "--checkpoint.every",
        str(EVERY),
        *extra,
    ]


def _wait(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        outs.append(out.decode(errors="replace"))
    return outs


def _job(lab: NetLab, base: Path, port: int, fault: str = "") -> tuple[list[int], list[str]]:
    """The 3-host job, host h with its own directory ``base/host{h}`` and one peer replica;
    waits for its end."""
    procs = []
    for host in range(HOSTS):
        launch = [
            "--nnodes",
            str(HOSTS),
            "--node-rank",
            str(host),
            "--nproc-per-node",
            "1",
            "--master-addr",
            lab.address(0),
            "--master-port",
            str(port),
        ]
        where = ["--checkpoint.peer-replicas", "1"]
        argv = _train(base / f"host{host}", base / "summary.json", *launch, *where)
        procs.append(
            lab.popen(host, argv, env=_env(fault), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outs = _wait(procs, 240)
    return [p.returncode for p in procs], outs


def _losses(step_dir: Path) -> list[float]:
    return json.loads((step_dir / "meta.json").read_text())["extra"]["losses"]


def _union(parts: Sequence[Path], into: Path) -> Path:
    """One complete checkpoint from the parts the hosts hold (verified)."""
    from torsh_distributed.checkpoint import verify

    into.mkdir(parents=True)
    for part in parts:
        for path in part.iterdir():
            if not (into / path.name).exists():
                shutil.copy(path, into / path.name)
    assert verify(into).valid, verify(into).describe()
    return into


def _state(step_dir: Path) -> dict:
    """Model and optimizer tensors of a complete checkpoint, by name (DCP, no pickle)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step_dir, step_dir.parent / f"{step_dir.name}.pt")
    return torch.load(step_dir.parent / f"{step_dir.name}.pt", weights_only=True)


def _final(base: Path, into: Path) -> dict[str, object]:
    """Every tensor and value of the job's last checkpoint, assembled from the hosts' parts."""
    last = f"step_{STEPS:08d}"
    return dict(
        _flat(_state(_union([base / f"host{h}" / last for h in range(HOSTS)], into / last)))
    )


def _flat(tree: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}/{key}")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _flat(value, f"{prefix}/{index}")
    else:
        yield prefix, tree


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_replaced_host_and_a_kill_during_replication_resume_from_peers(tmp_path: Path) -> None:
    import torch

    from torsh_distributed.checkpoint import verify

    run, straight = tmp_path / "run", tmp_path / "straight"
    last = f"step_{STEPS:08d}"
    with NetLab(hosts=HOSTS, rate_mbit=0, net=138) as lab:
        # step 4 is saved and replicated; rank 1 dies after writing the first file of rank 0's
        # replica of step 8 (the other ranks then fail in their next collective)
        codes, outs = _job(lab, run, 29742, fault="kill-in-replication:rank=1:step=8")
        assert codes[1] != 0, outs[1][-3000:]
        partial = run / "host1" / ".tmp-step_00000008"
        assert (partial / "__0_0.distcp").is_file(), sorted(os.listdir(run / "host1"))
        for host in range(HOSTS):  # no host committed step 8: the barrier never completed
            assert not (run / f"host{host}" / "step_00000008").exists()
            assert (run / f"host{host}" / "step_00000004" / "COMMITTED").is_file()
        shutil.rmtree(run / "host2")  # and host 2 is replaced: its disk is empty
        codes, outs = _job(lab, run, 29743)
        assert codes == [0] * HOSTS, "\n=====\n".join(o[-3000:] for o in outs)
        # the reference: the same job, never interrupted
        codes_ref, outs_ref = _job(lab, straight, 29744)
    assert codes_ref == [0] * HOSTS, "\n=====\n".join(o[-3000:] for o in outs_ref)
    got = json.loads((run / "summary.json").read_text())
    want = json.loads((straight / "summary.json").read_text())
    assert got["steps"] == STEPS == want["steps"] and got["world_size"] == HOSTS
    assert got["checkpoint"]["resumed_step"] == 4 and not want["checkpoint"].get("resumed_step")
    assert f"resumed from {run / 'host0'}" in outs[0], outs[0][-3000:]
    assert not partial.exists()  # the half-written replica was removed, never loaded
    assert verify(run / "host2" / "step_00000004").valid  # the replaced host got it all
    # bit for bit the uninterrupted run: every step's loss, the final and validation losses,
    # every model and optimizer tensor of the final checkpoint
    assert _losses(run / "host0" / last) == _losses(straight / "host0" / last)
    assert (got["final_loss"], got["val_loss"]) == (want["final_loss"], want["val_loss"])
    ours, theirs = _final(run, tmp_path / "assembled"), _final(straight, tmp_path / "reference")
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        same = torch.equal(ours[name], value) if torch.is_tensor(value) else ours[name] == value
        assert same, name
