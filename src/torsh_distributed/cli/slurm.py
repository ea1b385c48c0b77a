"""``torsh-dist slurm``: write (and optionally submit) an ``sbatch`` script, N nodes x G processes.

Parses flags into :class:`~torsh_distributed.launch.slurm.SlurmJob` (which validates them), prints
the script or writes it with ``--output``, and with ``--submit`` hands it to ``sbatch``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

__all__ = ["register"]

_EPILOG = """\
examples:
  # print a script: 2 nodes x 4 processes, each process one Slurm task running torsh-dist train
  torsh-dist slurm --nodes 2 --procs-per-node 4 --gpus-per-node 4 --time 2:00:00 \\
      -- torsh-dist train --preset small --max-steps 1000 --checkpoint-dir runs/small

  # write it, then submit it yourself (or add --submit)
  torsh-dist slurm --nodes 1 --procs-per-node 2 --cpus-per-process 4 --partition cpu \\
      --output train.sbatch -- torsh-dist train --preset tiny
  sbatch train.sbatch

  # one `torsh-dist run` agent per node (rank-prefixed output, one failure report, restarts);
  # the command is then what torsh-dist run starts: a Python file or -m MODULE
  torsh-dist slurm --mode agent --nodes 2 --procs-per-node 8 --max-restarts 2 \\
      -- -m torsh_distributed.train --preset small --checkpoint-dir runs/small

  # your own script; it calls torsh_distributed.init(), which reads SLURM_PROCID/SLURM_NTASKS
  torsh-dist slurm --nodes 4 --procs-per-node 8 --submit -- python train.py --lr 1e-3

Rendezvous: in tasks mode (the default) every process reads its rank and the world size from
srun's SLURM_* variables; rank 0's TCP store listens on the first host of the step's node list,
on MASTER_PORT if exported, else on 15000 + (job id % 17000). In agent mode the agents meet at a
c10d rendezvous on the allocation's first node, on the same derived port (or --port).

The job inherits the environment sbatch runs in (activate the virtual environment before
submitting, or give absolute paths). Security: the store and Gloo are unauthenticated; run jobs
only inside the cluster's private network. See docs/slurm.md.
"""


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _handle(args: argparse.Namespace) -> int:
    from torsh_distributed.launch.slurm import SlurmJob

    command = list(args.job_command)
    if command and command[0] == "--":
        command = command[1:]
    job = SlurmJob(
        command=tuple(command),
        nodes=args.nodes,
        procs_per_node=args.procs_per_node,
        mode=args.mode,
        job_name=args.job_name,
        partition=args.partition,
        time_limit=args.time,
        cpus_per_process=args.cpus_per_process,
        gpus_per_node=args.gpus_per_node,
        job_output=args.job_output,
        port=args.port,
        max_restarts=args.max_restarts,
        env=dict(args.env),
        sbatch_options=tuple(args.sbatch_option),
    )
    text = job.script()
    if args.output:
        with open(args.output, "w") as out:
            out.write(text)
        print(f"wrote {args.output} ({job.nodes} node(s) x {job.procs_per_node} process(es))")
    elif not args.submit:
        sys.stdout.write(text)
    if not args.submit:
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise FileNotFoundError("sbatch not found on PATH: --submit needs Slurm's client commands")
    argv = [sbatch, "--parsable"]
    proc = subprocess.run(
        [*argv, args.output] if args.output else argv,
        input=None if args.output else text,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        print(f"torsh-dist slurm: sbatch failed: {proc.stderr.strip()}", file=sys.stderr)
        return proc.returncode
    job_id = proc.stdout.strip().split(";")[0]  # --parsable prints "ID" or "ID;CLUSTER"
    print(f"Submitted batch job {job_id}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``slurm`` subcommand."""
    parser = sub.add_parser(
        "slurm",
        help="write (and optionally submit) an sbatch script for N nodes x G processes",
        description=(
            "Write an sbatch script that runs COMMAND on --nodes x --procs-per-node processes "
            "and print it (or write it with --output; --submit hands it to sbatch). In tasks "
            "mode (default) srun starts every process as one Slurm task and each reads its rank "
            "from SLURM_* variables; in agent mode srun starts one `torsh-dist run` per node."
        ),
        usage="torsh-dist slurm [options] -- COMMAND [ARGS ...]",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    shape = parser.add_argument_group("job shape")
    shape.add_argument("--nodes", "--nnodes", dest="nodes", type=int, default=1, metavar="N",
                       help="nodes to allocate. Default: 1")
    shape.add_argument("--procs-per-node", "--nproc-per-node", "--ntasks-per-node",
                       dest="procs_per_node", type=int, default=1, metavar="G",
                       help="training processes per node (one per GPU on GPU nodes). Default: 1")
    shape.add_argument("--mode", choices=("tasks", "agent"), default="tasks",
                       help="tasks: one Slurm task per process (srun COMMAND); agent: one "
                       "`torsh-dist run` per node (srun --ntasks-per-node=1 torsh-dist run ... "
                       "COMMAND, COMMAND being a Python file or -m MODULE). Default: tasks")
    shape.add_argument("--cpus-per-process", "--cpus-per-task", dest="cpus_per_process",
                       type=int, default=None, metavar="C",
                       help="cores per process; also exported as OMP_NUM_THREADS. "
                       "Default: Slurm's (one per task)")
    shape.add_argument("--gpus-per-node", type=int, default=0, metavar="N",
                       help="#SBATCH --gpus-per-node. Default: 0 (CPU nodes)")
    shape.add_argument("--port", type=int, default=None, metavar="PORT",
                       help="rendezvous port on the first node. Default: 15000 + job id %% 17000")
    shape.add_argument("--max-restarts", type=int, default=0, metavar="K",
                       help="agent mode: restart all workers up to K times after a failure "
                       "(they resume from their last checkpoint). Default: 0")
    sbatch = parser.add_argument_group("sbatch options")
    sbatch.add_argument("--job-name", default="torsh", metavar="NAME",
                        help="#SBATCH --job-name. Default: torsh")
    sbatch.add_argument("--partition", default=None, metavar="NAME",
                        help="#SBATCH --partition. Default: the cluster's default partition")
    sbatch.add_argument("--time", default=None, metavar="LIMIT",
                        help="#SBATCH --time (MINUTES, H:MM:SS, D-HH:MM:SS). "
                        "Default: the partition's")
    sbatch.add_argument("--job-output", default=None, metavar="PATTERN",
                        help="#SBATCH --output: the job's log (%%j = job id, %%x = job name). "
                        "Default: slurm-%%j.out in the submission directory")
    sbatch.add_argument("--env", action="append", type=_env_pair, default=[], metavar="KEY=VALUE",
                        help="export KEY=VALUE in the script before srun (repeatable)")
    sbatch.add_argument("--sbatch-option", action="append", default=[], metavar="OPTION",
                        help="one more #SBATCH line, e.g. --sbatch-option=--account=proj "
                        "(repeatable)")
    out = parser.add_argument_group("output")
    out.add_argument("-o", "--output", default=None, metavar="FILE",
                     help="write the script to FILE instead of printing it")
    out.add_argument("--submit", action="store_true",
                     help="submit the script with sbatch and print its job id")
    parser.add_argument("job_command", nargs=argparse.REMAINDER, metavar="COMMAND",
                        help="what runs, after `--`: in tasks mode the program every process "
                        "runs (torsh-dist train ..., python train.py ...); in agent mode a "
                        "Python file or -m MODULE for torsh-dist run")
    parser.set_defaults(handler=_handle)
