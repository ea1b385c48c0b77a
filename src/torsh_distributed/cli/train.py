"""``torsh-dist train``: the built-in trainer, launched on N local ranks by itself.

Flags are generated from :class:`~torsh_distributed.train.config.TrainConfig`: every field is
``--section.field-name`` (``--model.n-layer 4``) and, where the name is unique, also
``--field-name`` (``--n-layer 4``, ``--lr 1e-3``, ``--max-steps 50``). A preset gives the
starting values; flags override them.

With ``--nproc-per-node N`` (N > 1, or several nodes) the command re-launches itself through
``torsh-dist run`` machinery as ``python -m torsh_distributed.train --config-json ...``, so what
runs on the ranks is exactly the config validated here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

from torsh_distributed.train.config import PRESETS, TrainConfig, preset

__all__ = ["register", "add_config_arguments", "config_from_args", "main"]

_EPILOG = """\
examples:
  torsh-dist train --nproc-per-node 2 --preset tiny
  torsh-dist train --nproc-per-node 4 --preset tiny --max-steps 50 --batch-size 64 --lr 2e-3
  torsh-dist train --preset small --model.n-layer 6 --summary-json runs/small.json
  torsh-dist run --nproc-per-node 2 -m torsh_distributed.train --preset tiny   # same, via run
"""


def _fields(cls: type) -> list[dataclasses.Field[Any]]:
    sections = TrainConfig.sections()
    return [f for f in dataclasses.fields(cls) if cls is not TrainConfig or f.name not in sections]


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each dataclass field (parsed from the class source)."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return docs
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _type_of(cls: type, f: dataclasses.Field[Any]) -> Any:
    hint = typing.get_type_hints(cls)[f.name]
    return {int: int, float: float, str: str, bool: _parse_bool}[hint]


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--preset`` and one flag per :class:`TrainConfig` field (default: keep the preset)."""
    group = parser.add_argument_group("training configuration (defaults come from --preset)")
    group.add_argument(
        "--preset", default="tiny", choices=sorted(PRESETS), help="starting configuration"
    )
    group.add_argument("--config-json", help=argparse.SUPPRESS)
    owners: list[tuple[str, type]] = [("", TrainConfig), *TrainConfig.sections().items()]
    counts: dict[str, int] = {}
    for _, cls in owners:
        for f in _fields(cls):
            counts[f.name] = counts.get(f.name, 0) + 1
    for section, cls in owners:
        docs = _field_docs(cls)
        for f in _fields(cls):
            dest = f"{section}.{f.name}" if section else f.name
            flags = [f"--{section}.{f.name.replace('_', '-')}"] if section else []
            if "flags" in f.metadata:
                flags.extend(f.metadata["flags"])
            elif not section or counts[f.name] == 1:
                flags.append(f"--{f.name.replace('_', '-')}")
            kind = _type_of(cls, f)
            if kind is _parse_bool and f.metadata.get("negatable"):
                group.add_argument(
                    *flags, dest=dest, default=None, action=argparse.BooleanOptionalAction,
                    help=docs.get(f.name, ""),
                )
                continue
            group.add_argument(
                *flags,
                dest=dest,
                type=kind,
                default=None,
                metavar="BOOL" if kind is _parse_bool else f.name.upper(),
                help=docs.get(f.name, ""),
            )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The preset named by ``args.preset`` with every given flag applied (validated)."""
    if getattr(args, "config_json", None):
        return TrainConfig.from_dict(json.loads(args.config_json))
    data = preset(args.preset).to_dict()
    sections = TrainConfig.sections()
    for key, value in vars(args).items():
        if value is None:
            continue
        section, _, name = key.rpartition(".")
        if section in sections:
            data[section][name] = value
        elif key in data and key not in sections:
            data[key] = value
    return TrainConfig.from_dict(data)


def _handle(args: argparse.Namespace) -> int:
    from torsh_distributed.cli.run import options_from_args

    config = config_from_args(args)
    options = options_from_args(args)
    nodes_fixed = ":" not in options.nnodes
    if nodes_fixed:
        config.check_world(options.nproc_per_node * int(options.nnodes))
    inside_launch = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if inside_launch or (options.nproc_per_node == 1 and options.nnodes in ("1", "1:1")):
        return _train_here(config)
    from torsh_distributed.elastic.launch import launch

    return launch(
        options,
        module="torsh_distributed.train",
        args=["--config-json", config.to_json()],
    )


def _train_here(config: TrainConfig) -> int:
    from torsh_distributed.train.loop import train

    train(config)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``train`` subcommand."""
    from torsh_distributed.cli.run import add_launch_arguments

    parser = sub.add_parser(
        "train",
        help="train the built-in GPT-style model on Python's own source (data parallel)",
        description=(
            "Train a small GPT-style byte-level transformer on the text of the Python standard "
            "library, with data parallelism over --nproc-per-node local ranks (Gloo on CPU, NCCL "
            "when every rank has a GPU). --batch-size is the global batch: runs at different world "
            "sizes see the same samples per step."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_arguments(parser)
    add_config_arguments(parser)
    parser.set_defaults(handler=_handle)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torsh_distributed.train`` (runs on each launched rank)."""
    parser = argparse.ArgumentParser(
        prog="python -m torsh_distributed.train",
        description="Run the built-in trainer on this rank (launch with `torsh-dist run`).",
    )
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return _train_here(config)


if __name__ == "__main__":
    sys.exit(main())
