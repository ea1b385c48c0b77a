"""``torsh-dist generate``: continue a prompt with the GPT of a training checkpoint.

Parses the flags into a :class:`~torsh_distributed.inference.jobs.GenerateJob`, checks it
(:func:`~torsh_distributed.inference.jobs.plan_generate`) and runs it here, or with ``--tp N``
on N local ranks started by the same launcher as ``torsh-dist train --nproc-per-node N``
(``python -m torsh_distributed.cli.generate --job-json ...`` on each). Rank 0 writes the report;
this process prints the prompt and its continuation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torsh_distributed.checkpoint.catalog import check_loadable_path
from torsh_distributed.inference.config import DTYPE_NAMES, SamplingConfig

__all__ = ["add_sampling_arguments", "sampling_from_args", "unescape", "register", "main"]

_EPILOG = """\
examples:
  torsh-dist train --nproc-per-node 2 --preset tiny --checkpoint-dir runs/tiny
  torsh-dist generate --checkpoint runs/tiny --prompt 'def main():\\n' --max-new-tokens 60
  torsh-dist generate --checkpoint runs/tiny/step_00000200 --prompt 'import ' --temperature 0.8 \\
      --top-k 40 --seed 1 --stop '\\n\\n' --output sample.json
  torsh-dist generate --checkpoint runs/tiny --tp 2 --prompt 'class ' --temperature 0

--prompt and --stop understand the escapes \\n, \\t, \\r and \\\\ (a backslash).
"""

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """``text`` with ``\\n``, ``\\t``, ``\\r`` and ``\\\\`` replaced (other backslashes kept)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPES:
            out.append(_ESCAPES[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """``--max-new-tokens``, ``--temperature``, ``--top-k``, ``--top-p``, ``--seed``, ``--stop``
    (defaults: :class:`SamplingConfig`'s) and ``--dtype``."""
    defaults = SamplingConfig()
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-new-tokens",
        type=int,
        default=defaults.max_new_tokens,
        metavar="N",
        help="tokens to generate at most (a stop or the model's context may end "
        f"sooner). Default: {defaults.max_new_tokens}",
    )
    group.add_argument(
        "--temperature",
        type=float,
        default=defaults.temperature,
        metavar="T",
        help="0 = greedy (deterministic); < 1 sharpens, > 1 flattens. "
        f"Default: {defaults.temperature}",
    )
    group.add_argument(
        "--top-k",
        type=int,
        default=defaults.top_k,
        metavar="K",
        help="sample among the K most likely tokens; 0 = all. Default: 0",
    )
    group.add_argument(
        "--top-p",
        type=float,
        default=defaults.top_p,
        metavar="P",
        help="nucleus sampling: the smallest set of tokens with probability >= P; "
        "1 = all. Default: 1",
    )
    group.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        metavar="S",
        help="seed of the sampling generator: the same seed gives the same text. Default: 0",
    )
    group.add_argument(
        "--stop",
        nargs="+",
        action="extend",
        default=[],
        metavar="STR",
        help="stop once the completion contains STR (cut before it); several allowed",
    )
    group.add_argument(
        "--dtype",
        default="float32",
        choices=list(DTYPE_NAMES),
        help="weights' dtype: float32 (as trained), bfloat16/float16 (half the "
        "memory), float64 (exact comparisons). Default: float32",
    )


def sampling_from_args(args: argparse.Namespace) -> SamplingConfig:
    """The :class:`SamplingConfig` of :func:`add_sampling_arguments`' flags (validated)."""
    return SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_strings=tuple(unescape(s) for s in args.stop),
    )


def _print(report: dict[str, Any]) -> None:
    print(report["prompt"] + report["completion"], flush=True)
    per_token = report["time_per_output_token_s"]
    print(
        f"torsh-dist generate: {report['num_tokens']} tokens ({report['stop_reason']}"
        + (": the model's context is full" if report["stop_reason"] == "max_length" else "")
        + f") from "
        f"{report['checkpoint']} (step {report['step']}, tp {report['tp']}, {report['dtype']}); "
        f"first token {report['time_to_first_token_s'] * 1e3:.1f} ms, "
        + (f"{per_token * 1e3:.2f} ms/token after" if per_token is not None else "one token"),
        file=sys.stderr,
        flush=True,
    )


def _handle(args: argparse.Namespace) -> int:
    sampling = sampling_from_args(args)  # refused here, before torch is imported
    if not (Path(args.checkpoint) / "config.json").is_file():  # a Hugging Face directory: at load
        check_loadable_path(args.checkpoint)  # a missing or empty directory: before torch, too
    from torsh_distributed.inference.jobs import GenerateJob, plan_generate, run_generate

    job = plan_generate(
        GenerateJob(
            checkpoint=args.checkpoint,
            prompt=unescape(args.prompt),
            sampling=sampling,
            tp=args.tp,
            dtype=args.dtype,
            output=args.output or "",
        )
    )
    if job.tp == 1:
        report = run_generate(job)
        assert report is not None
        _print(report.to_dict())
        return 0
    from torsh_distributed.elastic.launch import LaunchOptions, launch

    with tempfile.TemporaryDirectory(prefix="torsh-generate-") as tmp:
        if not job.output:
            job.output = str(Path(tmp) / "report.json")
        code = launch(
            LaunchOptions(nproc_per_node=job.tp),
            module="torsh_distributed.cli.generate",
            args=["--job-json", job.to_json()],
        )
        if code == 0:
            _print(json.loads(Path(job.output).read_text()))
    return code


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand."""
    parser = sub.add_parser(
        "generate",
        help="continue a prompt with the GPT of a training checkpoint (--tp N: N ranks)",
        description=(
            "Load the built-in GPT of a `torsh-dist train --checkpoint-dir` run (its newest valid "
            "checkpoint, or one step_XXXXXXXX directory; saved in any dp/ZeRO/tp/pp/ep layout) "
            "and print the prompt with its continuation. --tp N decodes tensor-parallel on N "
            "local ranks. --output writes the completion, its token ids and timings as JSON."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a run's --checkpoint-dir (newest valid checkpoint) or a step dir; also a "
        "Hugging Face model directory or a --model hf: run's checkpoint (--tp 1)",
    )
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks to launch on this node (must divide the "
        "model's heads). Default: 1 (this process)",
    )
    parser.add_argument(
        "--output",
        metavar="FILE",
        help="write completion, tokens, stop reason and timings (time to first "
        "token, per-token latency) as JSON, atomically",
    )
    add_sampling_arguments(parser)
    parser.set_defaults(handler=_handle)


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of ``torsh-dist generate --tp N`` (``python -m torsh_distributed.cli.generate
    --job-json JSON``, started by the launcher)."""
    parser = argparse.ArgumentParser(prog="python -m torsh_distributed.cli.generate")
    parser.add_argument("--job-json", required=True, help="a GenerateJob as JSON")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("runs on the ranks of `torsh-dist generate --tp N`; use that command")
    from torsh_distributed.inference.jobs import GenerateJob, run_generate

    run_generate(GenerateJob.from_json(args.job_json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
