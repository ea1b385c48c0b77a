"""``torsh-dist infer``: data- and tensor-parallel batch inference over a JSONL file, resumable.

Parses the flags into an :class:`~torsh_distributed.inference.batch.InferJob`, checks the
checkpoint, the ``--tp`` layout and every input line here
(:func:`~torsh_distributed.inference.batch.plan_infer`), then runs
:func:`~torsh_distributed.inference.batch.run_infer` in this process or on ``--nproc-per-node``
ranks started by the same launcher as ``torsh-dist train`` (``python -m
torsh_distributed.cli.infer --job-json ...`` on each): ``nproc-per-node / tp`` model replicas
per node, each sharded over ``--tp`` ranks. Rank 0 shows the progress bar and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torsh_distributed.checkpoint.catalog import check_loadable_path
from torsh_distributed.cli.generate import add_sampling_arguments, sampling_from_args

if TYPE_CHECKING:  # torch: imported when the command runs, not for --help
    from torsh_distributed.inference.batch import InferJob, InferSummary

__all__ = ["register", "main"]

_EPILOG = """\
examples:
  torsh-dist infer --checkpoint runs/tiny --input prompts.jsonl --output out.jsonl \\
      --nproc-per-node 2 --max-new-tokens 64 --temperature 0.8 --seed 1
  # a model sharded over 2 ranks (tensor parallel); --nproc-per-node defaults to --tp
  torsh-dist infer --checkpoint runs/big --input prompts.jsonl --output out.jsonl --tp 2
  # 4 ranks: 2 replicas (data parallel), each sharded over 2 ranks
  torsh-dist infer --checkpoint runs/big --input prompts.jsonl --output out.jsonl \\
      --nproc-per-node 4 --tp 2
  # prompts.jsonl: one object per line, "prompt" required, the rest optional
  {"id": "a", "prompt": "def main():\\n"}
  {"id": "b", "prompt": "import os\\n", "max_new_tokens": 20, "temperature": 0, "stop": ["\\n\\n"]}

out.jsonl lines, in input order: {"index", "id", "prompt", "completion", "tokens", "stop_reason",
"seed"}. A line without "seed" samples with one derived from --seed and its index, so the
output does not depend on --nproc-per-node or --batch-size (nor on --tp, up to floating-point
rounding: greedy ties within rounding can break differently).

Resumable: each replica appends finished batches to OUTPUT.parts/rank_R.jsonl; run the same
command again after a crash and only the prompts without a result are computed (on any number
of ranks). OUTPUT is written, whole and atomically, only when every prompt is done.
"""


def _run(job: InferJob) -> InferSummary | None:
    from torsh_distributed.engine.progress import Progress
    from torsh_distributed.inference.batch import run_infer

    bar: list[Progress] = []

    def progress(done: int, total: int) -> None:
        if not bar:
            bar.append(Progress(total=total, enabled=True, desc="infer", unit="prompt"))
        bar[0].update_to(done)

    try:
        summary = run_infer(job, progress=progress)
    finally:
        if bar:
            bar[0].close()
    if summary is not None:
        print(
            f"torsh-dist infer: {summary.prompts} prompts, {summary.skipped} done earlier, "
            f"{summary.computed} computed on {summary.world_size} rank(s)"
            + (
                f" (dp {summary.world_size // summary.tp} x tp {summary.tp})"
                if summary.tp > 1
                else ""
            )
            + ", "
            f"{summary.generated_tokens} tokens in {summary.wall_time_s:.2f} s "
            f"({summary.tokens_per_s:,.0f} tokens/s) -> {summary.output}",
            flush=True,
        )
        print("summary " + json.dumps(summary.to_dict()), flush=True)
    return summary


def _handle(args: argparse.Namespace) -> int:
    from torsh_distributed.cli.run import options_from_args

    sampling = sampling_from_args(args)  # refused here, before torch is imported
    check_loadable_path(args.checkpoint)  # a missing or empty directory: before torch, too
    from torsh_distributed.inference.batch import InferJob, plan_infer

    job = InferJob(
        checkpoint=args.checkpoint,
        input=args.input,
        output=args.output,
        sampling=sampling,
        batch_size=args.batch_size,
        dtype=args.dtype,
        tp=args.tp,
        summary_json=args.summary_json or "",
    )
    options = options_from_args(args)
    if job.tp > 1 and options.nproc_per_node == 1:
        options.nproc_per_node = job.tp  # one replica per node
    if options.nproc_per_node % job.tp:
        raise ValueError(
            f"--nproc-per-node {options.nproc_per_node} must be a multiple of --tp {job.tp} "
            "(each node runs whole tensor-parallel groups)"
        )
    job, _ = plan_infer(job)  # every input error here, before any rank starts
    if options.nproc_per_node == 1 and options.nnodes in ("1", "1:1"):
        _run(job)
        return 0
    from torsh_distributed.elastic.launch import launch

    return launch(options, module="torsh_distributed.cli.infer", args=["--job-json", job.to_json()])


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``infer`` subcommand."""
    from torsh_distributed.cli.run import add_launch_arguments

    parser = sub.add_parser(
        "infer",
        help="complete a JSONL file of prompts on N data-parallel ranks, --tp M: each "
        "replica sharded over M ranks (resumable)",
        description=(
            "Batch inference with the built-in GPT of a `torsh-dist train --checkpoint-dir` run: "
            "the ranks form --nproc-per-node / --tp replicas of the model (each sharded over "
            "--tp ranks, tensor parallel), and every replica completes its share of the prompts "
            "of --input in batches of --batch-size; --output gets one line per prompt, in "
            "input order. An interrupted run resumes where it stopped."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_arguments(parser)
    group = parser.add_argument_group("inference")
    group.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a run's --checkpoint-dir (newest valid checkpoint) or a step dir",
    )
    group.add_argument(
        "--input",
        required=True,
        metavar="FILE",
        help="JSONL, one object per line: prompt (required), id, max_new_tokens, "
        "temperature, top_k, top_p, seed, stop",
    )
    group.add_argument(
        "--output",
        required=True,
        metavar="FILE",
        help="JSONL written atomically when every prompt is done",
    )
    group.add_argument(
        "--batch-size",
        type=int,
        default=16,
        metavar="B",
        help="prompts a rank decodes together (also the most work a crash loses "
        "per rank). Default: 16",
    )
    group.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks per model replica, for a model that does not fit one "
        "rank (must divide the model's heads and --nproc-per-node, which defaults to N). "
        "A model that fits one rank completes a file faster as N data-parallel replicas "
        "(--nproc-per-node N). Default: 1",
    )
    group.add_argument(
        "--summary-json",
        metavar="FILE",
        help="also write the run's summary (prompts computed and skipped, tokens/s) as JSON",
    )
    add_sampling_arguments(parser)
    parser.set_defaults(handler=_handle)


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of ``torsh-dist infer`` (``python -m torsh_distributed.cli.infer --job-json
    JSON``, started by the launcher)."""
    parser = argparse.ArgumentParser(prog="python -m torsh_distributed.cli.infer")
    parser.add_argument("--job-json", required=True, help="an InferJob as JSON")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("runs on the ranks of `torsh-dist infer`; use that command")
    from torsh_distributed.inference.batch import InferJob

    _run(InferJob.from_json(args.job_json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
