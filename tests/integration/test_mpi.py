"""Open MPI's ``mpirun -np 2`` runs scripts and the trainer with no hand-set rendezvous variables.

Every run gets the caller's environment minus ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
``WORLD_SIZE`` (and SLURM's variables, which would win detection), so the rendezvous must come
from :mod:`torsh_distributed.runtime._mpi`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="mpirun not installed (apt-get install openmpi-bin)"
)

BIN = Path(sys.executable).parent
HAS_MPI4PY = importlib.util.find_spec("mpi4py") is not None
_STRIPPED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "GLOO_SOCKET_IFNAME", "TORSH_MPI_RENDEZVOUS")

SCRIPT = """
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from torsh_distributed.runtime import MPIEnvironment, init

with init(backend="gloo", timeout=60) as rt:
    value = torch.tensor([float(rt.rank + 1)])
    dist.all_reduce(value)
    # one file per rank: mpirun merges the ranks' stdout and lines can interleave
    Path(sys.argv[1], f"{rt.rank}.json").write_text(json.dumps({
        "rank": rt.rank, "world_size": rt.world_size, "sum": value.item(),
        "master": [rt.info.master_addr, rt.info.master_port],
        "job_port": MPIEnvironment.job_port(os.environ),
        "mpi4py": "mpi4py.MPI" in sys.modules,
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    }))
"""


# Seconds one mpirun of two fresh interpreters may take: 4-9 s quiet, up to 31 s measured beside
# the CPU neighbour loop (ci77, load up to 13.8); the bound is a hang guard, not a speed check.
START_S = 150


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _STRIPPED and not k.startswith(("SLURM_", "OMPI_", "PMIX_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _mpirun(
    args: list[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    cmd = ["mpirun", "-np", "2", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    for name in ("OMP_NUM_THREADS", "PYTHONPATH", "MASTER_PORT"):  # to ranks on any node
        if name in env:
            cmd += ["-x", name]
    return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _script(tmp_path: Path) -> list[str]:
    """The command running SCRIPT, which writes one ``<rank>.json`` per rank into ``tmp_path/out``."""
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    return [str(BIN / "python"), str(script), str(tmp_path / "out")]


def _results(proc: subprocess.CompletedProcess[str], tmp_path: Path) -> list[dict]:
    assert proc.returncode == 0, f"mpirun failed:\n{proc.stdout}\n{proc.stderr}"
    files = sorted((tmp_path / "out").glob("*.json"))
    results = sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], proc.stdout
    return results


@pytest.mark.timeout(START_S + 30)
def test_script_rendezvous_without_master_variables(tmp_path: Path) -> None:
    results = _results(_mpirun(_script(tmp_path), _env(), timeout=START_S), tmp_path)
    assert all(r["world_size"] == 2 and r["sum"] == 3.0 for r in results)
    assert results[0]["master"] == results[1]["master"]
    assert results[0]["master"][0] == "127.0.0.1"
    assert all(r["gloo_ifname"] == "lo" for r in results)
    # With mpi4py rank 0 binds a kernel-chosen port (ephemeral: >= 32768), never the derived one.
    assert all(r["mpi4py"] is HAS_MPI4PY for r in results)
    if HAS_MPI4PY:
        assert results[0]["master"][1] != results[0]["job_port"]
    else:
        assert results[0]["master"][1] == results[0]["job_port"]


@pytest.mark.timeout(START_S + 30)
def test_without_mpi4py_single_node_port_is_derived(tmp_path: Path) -> None:
    # An mpi4py that fails to import exactly as a missing one does, first on the path.
    fake = tmp_path / "no_mpi4py" / "mpi4py"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'mpi4py'\", name='mpi4py')\n"
    )
    env = _env(PYTHONPATH=str(fake.parent))
    proc = _mpirun(_script(tmp_path), env, timeout=START_S)
    results = _results(proc, tmp_path)
    assert all(r["sum"] == 3.0 and not r["mpi4py"] for r in results)
    port = results[0]["job_port"]
    assert port is not None and 20000 <= port < 32000
    assert [r["master"] for r in results] == [["127.0.0.1", port]] * 2
    assert "RuntimeWarning" not in proc.stderr  # "not installed" is a normal case, not a warning


@pytest.mark.timeout(START_S + 30)
@pytest.mark.skipif(not HAS_MPI4PY, reason="mpi4py not installed ('torsh-distributed[mpi]')")
def test_taken_master_port_fails_naming_the_port(tmp_path: Path) -> None:
    command = _script(tmp_path)
    with socket.socket() as taken:  # the port rank 0 is told to use is held here
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = _mpirun(command, _env(MASTER_PORT=str(port)), timeout=START_S)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert f"cannot listen on 127.0.0.1:{port} for the rendezvous store" in output, output
    assert not list((tmp_path / "out").glob("*.json"))


@pytest.mark.slow
@pytest.mark.timeout(2 * START_S + 60)
def test_mpirun_trainer_matches_torsh_dist_run(tmp_path: Path) -> None:
    # the reference is `torsh-dist train --nproc-per-node 2 FLAGS`, run once per session
    from _launch_common import FLAGS, TOLERANCE, reference_summary

    summary = tmp_path / "mpirun.json"
    flags = [*FLAGS, "--resume", "never", "--summary-json", str(summary),
             "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = _mpirun([str(BIN / "torsh-dist"), "train", *flags], _env(), timeout=2 * START_S)
    assert proc.returncode == 0, f"mpirun failed:\n{proc.stdout}\n{proc.stderr}"
    result, reference = json.loads(summary.read_text()), reference_summary()
    assert result["world_size"] == 2 and result["steps"] == reference["steps"]
    for key in ("initial_loss", "final_loss"):
        assert result[key] == pytest.approx(reference[key], abs=TOLERANCE), key
