"""``torsh-dist checkpoint verify|list DIR`` and ``export``: inspect checkpoints, export them.

``verify DIR`` re-hashes every file against the SHA-256 manifest. ``DIR`` is one checkpoint
(``.../step_00000020``) or a checkpoint root; for a root every checkpoint is checked and the one a
resume would load is named. Exit status: 0 when everything checked is valid, 1 when something is
invalid (each problem on one line: directory, file, reason), 2 when there is nothing to check.
``list DIR`` prints step, size and validity of every checkpoint under a root (``--quick`` checks
sizes only, without hashing). ``export --format hf CKPT OUT`` writes the model of a ``--model hf:``
run as a Hugging Face directory (sharded safetensors, config, tokenizer) from a checkpoint saved
at any world size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torsh_distributed.checkpoint.catalog import scan  # no torch: verify and list run without it
from torsh_distributed.checkpoint.manifest import MARKER, verify

__all__ = ["register"]

_EPILOG = """\
examples:
  torsh-dist checkpoint verify runs/ckpt                  # every checkpoint under the root
  torsh-dist checkpoint verify runs/ckpt/step_00000200    # one checkpoint
  torsh-dist checkpoint list runs/ckpt --json
  torsh-dist checkpoint export --format hf runs/ckpt runs/hf   # then from_pretrained("runs/hf")
"""


def _is_checkpoint(path: Path) -> bool:
    return (
        (path / MARKER).exists() or (path / ".metadata").exists() or path.name.startswith("step_")
    )


def _human(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _verify(args: argparse.Namespace) -> int:
    path = Path(args.dir)
    if not path.exists():
        print(f"torsh-dist checkpoint verify: {path} does not exist", file=sys.stderr)
        return 2
    if _is_checkpoint(path):
        verdict = verify(path)
        print(verdict.describe())
        return 0 if verdict.valid else 1
    infos = scan(path)
    if not infos:
        print(f"torsh-dist checkpoint verify: no checkpoints (step_*) in {path}", file=sys.stderr)
        return 2
    for info in infos:
        where = f" ({info.file})" if info.file else ""
        print(
            f"{info.path}: valid" if info.valid else f"{info.path}: INVALID{where}: {info.reason}"
        )
    newest = next((i for i in infos if i.valid), None)
    if newest is None:
        print("no valid checkpoint: a resume would start from scratch")
    else:
        print(f"a resume would load {newest.path} (step {newest.step})")
    return 0 if all(i.valid for i in infos) else 1


def _list(args: argparse.Namespace) -> int:
    path = Path(args.dir)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        print(f"torsh-dist checkpoint list: {path} {what}", file=sys.stderr)
        return 2
    infos = scan(path, deep=not args.quick)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "path": str(i.path),
                        "step": i.step,
                        "size_bytes": i.size_bytes,
                        "valid": i.valid,
                        "reason": i.reason,
                        "file": i.file,
                        "metric": (i.meta or {}).get("metric"),
                        "world_size": (i.meta or {}).get("world_size"),
                    }
                    for i in infos
                ],
                indent=1,
            )
        )
        return 0
    if not infos:
        print(f"no checkpoints (step_*) in {path}")
        return 0
    print(f"{'step':>10}  {'size':>10}  {'world':>5}  status")
    for info in infos:
        status = "valid" if info.valid else f"INVALID ({info.file}): {info.reason}"
        world = (info.meta or {}).get("world_size", "?")
        print(f"{info.step:>10}  {_human(info.size_bytes):>10}  {world!s:>5}  {status}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from torsh_distributed.hf.export import export_hf  # transformers: not for --help

    try:
        result = export_hf(
            args.checkpoint, args.out, max_shard_size=args.max_shard_size, dtype=args.dtype
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"torsh-dist checkpoint export: {exc}", file=sys.stderr)
        return 2
    print(result.describe())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``checkpoint`` subcommand with ``verify``, ``list`` and ``export``."""
    parser = sub.add_parser(
        "checkpoint",
        help="verify, list or export checkpoints (SHA-256 manifest, commit marker)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    actions.required = True
    verify_parser = actions.add_parser(
        "verify", help="re-hash and check checkpoints; exit 1 if invalid"
    )
    verify_parser.add_argument("dir", metavar="DIR", help="a checkpoint or a checkpoint root")
    verify_parser.set_defaults(handler=_verify)
    list_parser = actions.add_parser("list", help="steps, sizes and validity under a root")
    list_parser.add_argument("dir", metavar="DIR", help="checkpoint root")
    list_parser.add_argument("--quick", action="store_true", help="check sizes only, do not hash")
    list_parser.add_argument("--json", action="store_true", help="machine-readable output")
    list_parser.set_defaults(handler=_list)
    export_parser = actions.add_parser(
        "export", help="write a --model hf: run's checkpoint as a Hugging Face model directory"
    )
    export_parser.add_argument("checkpoint", metavar="CKPT",
                               help="a checkpoint root (its newest valid step) or one step_* directory")
    export_parser.add_argument("out", metavar="OUT", help="new (or empty) directory to write")
    export_parser.add_argument("--format", choices=["hf"], required=True,
                               help="hf: safetensors + config.json + tokenizer (from_pretrained loads it)")
    export_parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                               help="largest safetensors file, e.g. 5GB, 200MB (default 5GB)")
    export_parser.add_argument("--dtype", default="float32",
                               choices=["float32", "bfloat16", "float16"],
                               help="dtype of the written weights (default float32, as trained)")
    export_parser.set_defaults(handler=_export)
