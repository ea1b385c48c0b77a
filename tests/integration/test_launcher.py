"""``torsh-dist run`` end to end: the real CLI in a subprocess, real workers, Gloo on CPU
(options refused before anything starts: the CLI's ``main`` in this process)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from torsh_distributed.testing.cli import run_cli as warm_cli
from torsh_distributed.testing.cli import start_cli

TIMEOUT_S = 120
# Variables of an enclosing launcher would leak into the one under test.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    return env


def _cmd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "torsh_distributed.cli.main", "run", *argv]


def run_cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``torsh-dist run ARGV`` in a warm process (torsh_distributed.testing.cli); the start
    methods' own test below starts it cold, as a user's shell does."""
    return warm_cli(["run", *argv], cwd=cwd, env=_env(), timeout=TIMEOUT_S)


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def records(stdout: str, tag: str) -> dict[int, dict]:
    """``[rankN]: TAG {json}`` lines, keyed by the rank in the prefix."""
    found = {}
    for match in re.finditer(rf"^\[rank(\d+)\]: {tag} (\{{.*\}})$", stdout, re.MULTILINE):
        found[int(match.group(1))] = json.loads(match.group(2))
    return found


def test_two_ranks_get_torchrun_env_and_all_reduce(tmp_path: Path) -> None:
    write(
        tmp_path / "worker.py",
        """
        import json, os, socket, sys
        import torch, torch.distributed as dist

        def store_reachable_from_outside():
            # The single-node store must listen on loopback only: try it from a LAN address.
            try:
                probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                probe.connect(("10.255.255.255", 1))
                lan = probe.getsockname()[0]
            except OSError:
                return "skip"
            if lan.startswith("127."):
                return "skip"
            try:
                socket.create_connection((lan, int(os.environ["MASTER_PORT"])), timeout=2).close()
                return "connected"
            except OSError:
                return "refused"

        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
        info = {k: os.environ.get(k) for k in keys}
        info.update(sum=t.item(), argv=sys.argv[1:], name=__name__,
                    external=store_reachable_from_outside() if dist.get_rank() == 0 else None)
        print("INFO", json.dumps(info))
        print("to stderr", file=sys.stderr)
        dist.destroy_process_group()
        """,
    )
    result = run_cli("--nproc-per-node", "2", "worker.py", "--lr", "1e-3", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = records(result.stdout, "INFO")
    assert sorted(seen) == [0, 1], result.stdout
    for rank, info in seen.items():
        assert info["RANK"] == str(rank)  # the prefix names the rank that printed the line
        assert info["LOCAL_RANK"] == str(rank)
        assert info["WORLD_SIZE"] == info["LOCAL_WORLD_SIZE"] == "2"
        assert info["GROUP_RANK"] == "0"
        assert info["MASTER_ADDR"] == "127.0.0.1"
        assert info["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert info["sum"] == 3.0
        assert info["argv"] == ["--lr", "1e-3"]
        assert info["name"] == "__main__"
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"]
    assert seen[0]["external"] in ("refused", "skip")
    assert "[rank0]: to stderr" in result.stderr and "[rank1]: to stderr" in result.stderr


def test_module_form_passes_arguments_through(tmp_path: Path) -> None:
    write(tmp_path / "torsh_launch_probe" / "__init__.py", "")
    write(
        tmp_path / "torsh_launch_probe" / "job.py",
        """
        import json, os, sys
        print("ARGS", json.dumps({"argv": sys.argv[1:], "name": __name__,
                                  "file": os.path.basename(sys.argv[0])}))
        """,
    )
    result = run_cli(
        "--nproc-per-node", "2", "-m", "torsh_launch_probe.job", "--flag", "v", "-m", "x",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    seen = records(result.stdout, "ARGS")
    assert sorted(seen) == [0, 1], result.stdout
    for info in seen.values():
        assert info == {"argv": ["--flag", "v", "-m", "x"], "name": "__main__", "file": "job.py"}


def test_forkserver_workers_see_what_spawned_ones_see(tmp_path: Path) -> None:
    """The warm start (the default) forks workers from a process that imported torch before the
    launcher set their environment: each must still get the launcher's environment at launch
    (OMP_NUM_THREADS, OpenMP's wait policy, the job id, GLOO_SOCKET_IFNAME), its own rank variables, the working
    directory, ``sys.path[0]``, ``sys.argv`` and a command line naming its module, exactly as
    a freshly spawned worker does, and run the script's ``atexit`` handlers when it ends. Fails
    if any of these leaks from the forkserver."""
    write(tmp_path / "torsh_warm_probe" / "__init__.py", "")
    write(
        tmp_path / "torsh_warm_probe" / "job.py",
        """
        import atexit, json, os, sys
        warm = "torch" in sys.modules  # imported before this module ran: forked warm
        atexit.register(lambda: open(f"atexit.{os.environ['TORSH_PROBE']}.{os.environ['RANK']}",
                                     "w").close())
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
                "TORSH_PROBE", "OMP_WAIT_POLICY", "TORSH_OMP_WAIT")
        env = {k: os.environ.get(k) for k in keys}
        env["job"] = bool(os.environ.get("TORSH_JOB_ID"))
        with open("/proc/self/cmdline", "rb") as f:
            cmdline = f.read().replace(bytes([0]), b" ").decode()
        print("SEEN", json.dumps({"warm": warm, "env": env, "cwd": os.getcwd(),
                                  "path0": sys.path[0], "argv": sys.argv[1:],
                                  "named": "torsh_warm_probe.job --x 1" in cmdline}))
        """,
    )
    seen = {}
    for method in ("spawn", "forkserver"):
        env = {**_env(), "TORSH_PROBE": method}
        env.pop("OMP_NUM_THREADS", None)
        env.pop("OMP_WAIT_POLICY", None)
        env.pop("GOMP_SPINCOUNT", None)
        env.pop("TORSH_OMP_WAIT", None)
        result = subprocess.run(
            _cmd("--nproc-per-node", "2", "--start-method", method, "-m", "torsh_warm_probe.job",
                 "--x", "1"),
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        seen[method] = records(result.stdout, "SEEN")
        assert sorted(seen[method]) == [0, 1], result.stdout
        assert sorted(p.name for p in tmp_path.glob(f"atexit.{method}.*")) == [
            f"atexit.{method}.0", f"atexit.{method}.1"
        ]  # every worker ran its atexit handlers
    for rank in (0, 1):
        spawn, warm = seen["spawn"][rank], seen["forkserver"][rank]
        assert (spawn.pop("warm"), warm.pop("warm")) == (False, True)
        assert spawn["env"].pop("TORSH_PROBE") == "spawn"
        assert warm["env"].pop("TORSH_PROBE") == "forkserver"
        # each command decided how OpenMP waits from the host's load (runtime/_omp_wait.py); its
        # workers inherit its decision, whichever way they start
        for worker in (spawn, warm):
            decision, policy = worker["env"].pop("TORSH_OMP_WAIT"), worker["env"].pop("OMP_WAIT_POLICY")
            assert decision.startswith(("PASSIVE (busy): ", "spin (quiet): ")), decision
            assert policy == ("PASSIVE" if decision.startswith("PASSIVE") else None), (decision, policy)
        assert warm == spawn
        assert warm["env"]["RANK"] == str(rank) and warm["env"]["OMP_NUM_THREADS"] == "1"
        assert warm["env"]["job"] and warm["named"]
        assert warm["path0"] == warm["cwd"] == str(tmp_path)


def test_failing_rank_is_reported_once_with_its_traceback(tmp_path: Path) -> None:
    write(
        tmp_path / "fail.py",
        """
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise ValueError("deliberate failure")
        dist.barrier()  # rank 0 waits for a peer that is gone
        """,
    )
    result = run_cli("--nproc-per-node", "2", "fail.py", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "torsh-dist: rank 1 failed (local rank 1, node 0" in result.stderr, output
    assert output.count("ValueError: deliberate failure") == 1, output
    assert output.count('raise ValueError("deliberate failure")') == 1, output
    assert output.count("Traceback (most recent call last)") == 1, output
    assert "_bootstrap.py" not in output and "runpy" not in output, output  # wrapper frames hidden
    # torch's agent noise stays hidden without --verbose
    assert "closing signal" not in output and "ChildFailedError" not in output, output


def test_max_restarts_recovers_from_a_first_attempt_failure(tmp_path: Path) -> None:
    write(
        tmp_path / "flaky.py",
        """
        import os
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        if attempt == "0" and os.environ["RANK"] == "1":
            raise RuntimeError("first attempt fails")
        print("DONE", '{"attempt": %s}' % attempt)
        """,
    )
    result = run_cli("--nproc-per-node", "2", "--max-restarts", "1", "flaky.py", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    done = [m for m in re.findall(r"^\[rank(\d)\]: DONE (.*)$", result.stdout, re.MULTILINE)]
    assert ("0", '{"attempt": 1}') in done and ("1", '{"attempt": 1}') in done, result.stdout
    assert "[rank1]: RuntimeError: first attempt fails (attempt 1 of 2 failed" in result.stderr
    # the launcher says which rank failed, how, and that it restarts, without --verbose
    assert re.search(
        r"^torsh-dist: rank 1 failed \(local rank 1, node 0, host [^;]+; exit code 1\): "
        r"RuntimeError: first attempt fails\n"
        r"torsh-dist: restart 1 of 1 \(--max-restarts 1\): all 2 worker\(s\) of this node start again$",
        result.stderr,
        re.MULTILINE,
    ), result.stderr
    assert "rank 0 failed" not in result.stderr, result.stderr  # stopped by the agent, not failed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc-per-node", "0", "x.py"], "nproc_per_node must be >= 1"),
        (["--nnodes", "a:b", "x.py"], "nnodes must be 'N' or 'MIN:MAX'"),
        (["--nnodes", "1:2", "x.py"], "needs rdzv_endpoint"),
        (["--nproc-per-node", "2"], "name a SCRIPT to run, or -m MODULE"),
        (["missing.py"], "'missing.py' is not a file"),
    ],
)
def test_invalid_options_exit_with_a_message(
    tmp_path: Path, argv: list[str], message: str, capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Refused before anything starts: the command's own code in this process, capturing file
    # descriptors so a worker that started would show (an interpreter start per case is ~2.5 s).
    from torsh_distributed.cli.main import main

    write(tmp_path / "x.py", "print('must not run')\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", *argv]) == 2
    out, err = capfd.readouterr()
    assert message in err, out + err
    assert "must not run" not in out


def test_sigterm_stops_every_worker(tmp_path: Path) -> None:
    write(
        tmp_path / "sleeper.py",
        """
        import os, time
        print("PID", '{"pid": %d}' % os.getpid(), flush=True)
        time.sleep(60)
        """,
    )
    out = tmp_path / "out.txt"
    proc = start_cli(["run", "--nproc-per-node", "2", "sleeper.py"], output=out, cwd=tmp_path, env=_env())
    try:
        deadline = time.monotonic() + 30
        while len(records(out.read_text(), "PID")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [info["pid"] for info in records(out.read_text(), "PID").values()]
        assert len(pids) == 2, out.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "received SIGTERM; all workers were stopped" in out.read_text()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone (reaped by the launcher)
