"""The sbatch script writer (launch/slurm.py, `torsh-dist slurm`) and SLURM's rendezvous."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from torsh_distributed.cli.main import main
from torsh_distributed.launch import slurm_script
from torsh_distributed.launch.slurm import SlurmJob
from torsh_distributed.runtime.env import SlurmEnvironment

pytestmark = pytest.mark.timeout(60)

TRAIN = ["torsh-dist", "train", "--preset", "tiny"]


def _sbatch_lines(text: str) -> list[str]:
    return [ln.removeprefix("#SBATCH ") for ln in text.splitlines() if ln.startswith("#SBATCH")]


def _srun_argv(text: str) -> list[str]:
    """The srun command of a script, joined across backslash continuations, as bash splits it."""
    joined = text.replace("\\\n", " ")
    (line,) = [ln for ln in joined.splitlines() if ln.startswith("srun ")]
    return shlex.split(line)


def test_tasks_mode_is_one_slurm_task_per_process() -> None:
    text = slurm_script(TRAIN, nodes=2, procs_per_node=4, time_limit="1:00:00", partition="cpu")
    assert text.startswith("#!/bin/bash\n")
    assert _sbatch_lines(text) == [
        "--job-name=torsh", "--nodes=2", "--ntasks-per-node=4", "--partition=cpu",
        "--time=1:00:00",
    ]
    assert _srun_argv(text) == ["srun", "--kill-on-bad-exit=1", *TRAIN]
    assert "export MASTER_PORT" not in text  # derived from the job id unless given
    assert "world size 8" in text


def test_agent_mode_is_one_torsh_dist_run_per_node() -> None:
    text = slurm_script(
        ["-m", "torsh_distributed.train", "--preset", "tiny"],
        mode="agent", nodes=3, procs_per_node=8, cpus_per_process=2, gpus_per_node=8,
        max_restarts=2,
    )
    assert _sbatch_lines(text) == [
        "--job-name=torsh", "--nodes=3", "--ntasks-per-node=1", "--cpus-per-task=16",
        "--gpus-per-node=8",
    ]
    assert _srun_argv(text) == [
        "srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", "--cpus-per-task=16",
        "torsh-dist", "run", "--nnodes", "3", "--nproc-per-node", "8", "--max-restarts", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "$head:$port", "--rdzv-id", "$SLURM_JOB_ID",
        "-m", "torsh_distributed.train", "--preset", "tiny",
    ]
    assert "export OMP_NUM_THREADS=2\n" in text


def test_agent_port_expression_matches_slurm_environment() -> None:
    """The shell arithmetic in agent scripts and SlurmEnvironment.job_port agree."""
    text = slurm_script(["train.py"], mode="agent")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("port=")]
    for job_id in (1, 4242, 16999, 17000, 123456):
        out = subprocess.run(
            ["bash", "-c", f"{line}; echo $port"], env={"SLURM_JOB_ID": str(job_id)},
            capture_output=True, text=True, check=True,
        ).stdout
        assert int(out) == SlurmEnvironment.job_port(job_id)
    fixed = slurm_script(["train.py"], mode="agent", port=23456)
    assert "port=23456\n" in fixed


def test_cpus_env_and_port_in_tasks_mode() -> None:
    text = slurm_script(
        TRAIN, procs_per_node=2, cpus_per_process=3, port=24000,
        env={"OMP_NUM_THREADS": "1", "NOTE": "it's $HOME"}, sbatch_options=["--exclusive"],
    )
    assert "--cpus-per-task=3" in _sbatch_lines(text)
    assert "--exclusive" in _sbatch_lines(text)
    assert _srun_argv(text)[:3] == ["srun", "--kill-on-bad-exit=1", "--cpus-per-task=3"]
    assert "export OMP_NUM_THREADS=1\n" in text  # the given value wins over cpus_per_process
    assert "export MASTER_PORT=24000\n" in text
    out = subprocess.run(
        ["bash", "-c", "\n".join(ln for ln in text.splitlines() if ln.startswith("export"))
         + "\nprintf '%s' \"$NOTE\""],
        capture_output=True, text=True, check=True,
    ).stdout
    assert out == "it's $HOME"


def test_arguments_reach_the_program_verbatim(tmp_path: Path) -> None:
    """Run the script with a stand-in srun: hostile arguments arrive as written, never expanded."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'
    )
    (fake / "srun").chmod(0o755)
    marker = tmp_path / "pwned"
    args = ["$(touch " + str(marker) + ")", "a b", "'quoted'", "semi;colon", "`id`", "new\nline"]
    script = tmp_path / "job.sbatch"
    slurm_script(["printf", "<%s>", *args], path=script)
    assert stat.S_IMODE(script.stat().st_mode) == 0o755
    out = subprocess.run(
        [str(script)], env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"},
        capture_output=True, text=True, check=True,
    ).stdout
    assert out == "".join(f"<{a}>" for a in args)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"nodes": 0}, ValueError, "nodes must be >= 1"),
        ({"nodes": True}, TypeError, "nodes must be an int"),
        ({"procs_per_node": 0}, ValueError, "procs_per_node must be >= 1"),
        ({"gpus_per_node": -1}, ValueError, "gpus_per_node must be >= 0"),
        ({"cpus_per_process": 0}, ValueError, "cpus_per_process must be >= 1"),
        ({"port": 70000}, ValueError, "port must be a TCP port"),
        ({"mode": "mpirun"}, ValueError, "mode must be one of tasks, agent"),
        ({"max_restarts": 1}, ValueError, "max_restarts=1 needs mode 'agent'"),
        ({"max_restarts": -1, "mode": "agent", "command": ["t.py"]}, ValueError,
         "max_restarts must be >= 0"),
        ({"job_name": "two words"}, ValueError, "job_name must use"),
        ({"job_name": "x\n#SBATCH --exclusive"}, ValueError, "job_name must use"),
        ({"partition": "gpu;rm"}, ValueError, "partition must be"),
        ({"time_limit": "1h"}, ValueError, "time_limit must be a Slurm time"),
        ({"job_output": "my logs/%j.out"}, ValueError, "job_output must be a path"),
        ({"env": {"1BAD": "x"}}, ValueError, "env names must be shell variable names"),
        ({"env": {"A": 1}}, ValueError, r"env\['A'\] must be a string"),
        ({"sbatch_options": ["exclusive"]}, ValueError, "sbatch_options must be single options"),
        ({"sbatch_options": ["--comment=a b"]}, ValueError, "sbatch_options must be single"),
        ({"command": []}, ValueError, "command must name the program"),
        ({"command": "torsh-dist train"}, TypeError, "command must be a sequence of strings"),
        ({"command": ["torsh-dist", "train"], "mode": "agent"}, ValueError,
         "-m torsh_distributed.train"),
    ],
)
def test_invalid_fields_are_named(kwargs: dict, error: type[Exception], match: str) -> None:
    command = kwargs.pop("command", TRAIN)
    with pytest.raises(error, match=match):
        slurm_script(command, **kwargs)


@pytest.mark.parametrize(
    "limit", ["30", "30:00", "2:00:00", "1-12", "1-12:30", "1-12:30:00", "UNLIMITED"]
)
def test_time_limit_formats_accepted(limit: str) -> None:
    assert f"#SBATCH --time={limit}\n" in SlurmJob(command=("x",), time_limit=limit).script()


def test_scripts_are_valid_bash() -> None:
    for mode, command in (("tasks", TRAIN), ("agent", ["train.py", "--lr", "1e-3"])):
        text = slurm_script(command, mode=mode, nodes=2, procs_per_node=2, cpus_per_process=1)
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_cli_prints_and_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["slurm", "--nodes", "2", "--nproc-per-node", "4", "--time", "10", "--env", "A=b=c"]
    assert main([*argv, "--", *TRAIN, "--max-steps", "5"]) == 0
    printed = capsys.readouterr().out
    assert printed == slurm_script(
        [*TRAIN, "--max-steps", "5"], nodes=2, procs_per_node=4, time_limit="10", env={"A": "b=c"}
    )
    target = tmp_path / "job.sbatch"
    assert main([*argv, "--output", str(target), "--", *TRAIN, "--max-steps", "5"]) == 0
    assert target.read_text() == printed
    assert "wrote" in capsys.readouterr().out


def test_cli_rejects_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slurm", "--nodes", "0", "--", *TRAIN]) == 2
    assert "nodes must be >= 1" in capsys.readouterr().err
    assert main(["slurm", "--nodes", "1"]) == 2
    assert "command must name the program" in capsys.readouterr().err


def test_slurm_port_is_per_job_and_step_and_below_ephemeral_range() -> None:
    assert SlurmEnvironment.job_port(4242) == 15000 + 4242
    assert SlurmEnvironment.job_port(4242, 1) == 15000 + 5242
    ports = {SlurmEnvironment.job_port(j) for j in range(100, 100 + 17000)}
    assert len(ports) == 17000  # any two jobs < 17,000 ids apart differ
    assert max(ports) < 32768 and min(ports) >= 15000
    steps = {SlurmEnvironment.job_port(987654, s) for s in range(17)}
    assert len(steps) == 17


def test_slurm_master_is_first_host_of_the_step() -> None:
    env = {
        "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3",
        "SLURM_JOB_NODELIST": "n[01-04]", "SLURM_NODELIST": "n[03-04]",
        "SLURM_STEP_NODELIST": "n[03-04]", "SLURM_TASKS_PER_NODE": "1(x2)",
    }
    info = SlurmEnvironment().world_info(env)
    assert info.master_addr == "n03"  # rank 0 of a step on nodes 3-4 runs on n03, not n01
    assert info.master_port == SlurmEnvironment.job_port(77, 3)
    del env["SLURM_STEP_NODELIST"], env["SLURM_NODELIST"]
    assert SlurmEnvironment().world_info(env).master_addr == "n01"
    env["SLURM_STEP_ID"] = "batch"  # not a number: the job's port
    assert SlurmEnvironment().world_info(env).master_port == SlurmEnvironment.job_port(77)


def test_docs_template_is_what_the_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/slurm.md shows a `torsh-dist slurm` command and its script: they must agree."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "slurm.md").read_text()
    block = doc.split("```console\n", 1)[1].split("```", 1)[0]
    command_text, _, script = block.partition("\n#!/bin/bash\n")
    argv = shlex.split(command_text.removeprefix("$ ").replace("\\\n", " "))
    assert argv[0] == "torsh-dist"
    assert main(argv[1:]) == 0
    assert capsys.readouterr().out == "#!/bin/bash\n" + script
