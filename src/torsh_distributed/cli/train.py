"""``torsh-dist train``: the engine on the built-in GPT, or on the user's own model, launched on
N local ranks by itself.

``--model MODULE:FUNCTION --dataset MODULE:FUNCTION [--loss ...] [--val-dataset ...]
[--tp-plan ...]`` trains the user's model (see :mod:`torsh_distributed.engine.user`); without
``--model`` the built-in GPT trains on Python's own source. Every other flag applies to both.

Flags are generated from :class:`~torsh_distributed.train.config.TrainConfig`: every field is
``--section.field-name`` (``--model.n-layer 4``) and, where the name is unique, also
``--field-name`` (``--n-layer 4``, ``--lr 1e-3``, ``--max-steps 50``). A name that several
sections share has no bare flag, and spelling it bare is refused with the choices named
(``--warmup-steps``: ``--optim.warmup-steps`` or ``--compression.warmup-steps``). A preset gives
the starting values; flags override them.

With ``--nproc-per-node N`` (N > 1, or several nodes) the command re-launches itself through
``torsh-dist run`` machinery as ``python -m torsh_distributed.train --config-json ...``, so what
runs on the ranks is exactly the config validated here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import typing
import warnings
from collections.abc import Sequence
from typing import Any

from torsh_distributed.cli._train_checks import (
    check_checkpoint_paths,
    check_meter,
    check_world,
    launch_world,
    precheck_world,
)
from torsh_distributed.cli._train_scale import Scaled, launch_scaled, scale_range
from torsh_distributed.train.config import PRESETS, TrainConfig, preset

if typing.TYPE_CHECKING:
    from torsh_distributed.elastic._options import LaunchOptions
    from torsh_distributed.engine.user import UserFactories

__all__ = ["register", "add_config_arguments", "config_from_args", "main"]

_EPILOG = """\
examples:
  torsh-dist train --nproc-per-node 2 --preset tiny
  # a Hugging Face model, tokenizer and local data (docs/huggingface.md); --tp 2 uses its own plan
  torsh-dist train --nproc-per-node 2 --model hf:models/llama \\
      --dataset hf:corpus.jsonl,seq_len=128 --zero-stage 3 --checkpoint-dir runs/llama
  # your own model: factories named MODULE:FUNCTION (a module name or a .py file)
  torsh-dist train --nproc-per-node 2 --model examples/factories.py:make_model \\
      --dataset examples/factories.py:make_dataset --zero-stage 3 --max-steps 100
  torsh-dist train --nproc-per-node 4 --model mypkg.nets:transformer \\
      --dataset mypkg.data:tokens --pp 2 --pp-split layers.4 --loss mypkg.nets:loss
  torsh-dist train --nproc-per-node 4 --preset tiny --max-steps 50 --batch-size 64 --lr 2e-3
  # lr and warm-up tuned at batch 32, run at 128: the engine scales them (sqrt for AdamW)
  torsh-dist train --nproc-per-node 2 --preset tiny --batch-size 128 --lr-ref-batch 32
  torsh-dist train --preset small --model.n-layer 6 --summary-json runs/small.json
  torsh-dist run --nproc-per-node 2 -m torsh_distributed.train --preset tiny   # same, via run
  # a setting two sections share is named with its section (a bare --warmup-steps is refused)
  torsh-dist train --nproc-per-node 2 --optim.warmup-steps 20 \\
      --compression topk:0.01 --compression.warmup-steps 5
  # a DeepSpeed JSON config: every key reported as applied / mapped / unsupported
  torsh-dist train --nproc-per-node 2 --deepspeed ds_config.json [--strict]
  # energy per rank and step, carbon at a region's average (or --carbon.intensity G,
  # --carbon.series FILE); then: torsh-dist energy report runs/a
  torsh-dist train --nproc-per-node 2 --carbon.region DEU --summary-json runs/a/summary.json
  # time shifting: checkpoint and pause while the series is above 300 gCO2/kWh, end by 18:00Z
  torsh-dist train --nproc-per-node 2 --carbon.series grid.csv --carbon.max-intensity 300 \\
      --carbon.deadline 2026-11-26T18:00:00Z --checkpoint.dir runs/a/ckpt
  # scaling: 1 to 4 workers, more while the series is clean (restarts from checkpoints)
  torsh-dist train --nproc-per-node 1:4 --carbon.series grid.csv --carbon.scale \\
      --checkpoint.dir runs/b/ckpt --summary-json runs/b/summary.json
  # parameter server: rank 0 serves, ranks 1-2 train with bounded staleness 2
  torsh-dist train --nproc-per-node 3 --ps-servers 1 --staleness 2 --max-steps 50
  # settings in a TOML file (flags override it); --print-config writes the resolved file
  torsh-dist train --nproc-per-node 2 --max-steps 50 --lr 1e-3 --print-config > run.toml
  torsh-dist train --config run.toml --max-steps 100
"""


def _fields(cls: type) -> list[dataclasses.Field[Any]]:
    sections = TrainConfig.sections()
    return [f for f in dataclasses.fields(cls) if cls is not TrainConfig or f.name not in sections]


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each dataclass field (parsed from the class source), inherited
    fields included (TrainConfig's top-level fields are EngineConfig's)."""
    return dict(_field_docs_cached(cls))


@functools.cache
def _field_docs_cached(cls: type) -> dict[str, str]:
    import ast

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):  # a subclass's docstring wins
        node = _class_node(klass)
        if node is None:
            continue
        body = node.body
        for field, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[field.target.id] = " ".join(nxt.value.value.split())
    return docs


def _class_node(klass: type) -> Any:
    """``klass``'s ``ast.ClassDef``, from its module's source parsed once per process (every
    parser build reads ~40 config classes: ``inspect.getsource`` parsed the module for each)."""
    import ast
    import inspect

    module = sys.modules.get(klass.__module__)
    filename = getattr(module, "__file__", None)
    if filename and filename.endswith(".py"):
        node = _module_classes(filename).get(klass.__qualname__)
        if node is not None:
            return node
    try:  # not a plain source file (or redefined since): the slow, general way
        return ast.parse(inspect.getsource(klass)).body[0]
    except (OSError, TypeError, SyntaxError):
        return None


@functools.cache
def _module_classes(filename: str) -> dict[str, Any]:
    """Every class of a source file by qualified name -> its ``ast.ClassDef``."""
    import ast

    try:
        with open(filename, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return {}
    found: dict[str, Any] = {}

    def walk(body: list[Any], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                found[prefix + node.name] = node
                walk(node.body, f"{prefix}{node.name}.")

    walk(tree.body, "")
    return found


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, once per class (it compiles every annotation string)."""
    return typing.get_type_hints(cls)


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _type_of(cls: type, f: dataclasses.Field[Any]) -> Any:
    hint = type_hints(cls)[f.name]
    return {int: int, float: float, str: str, bool: _parse_bool}[hint]


class _Ambiguous(argparse.Action):
    """A bare ``--field-name`` that several sections share: refused, naming each section's flag."""

    def __init__(
        self, option_strings: list[str], dest: str, *, spellings: list[str], **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.spellings = spellings

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.error(
            f"{option_string} is ambiguous: {len(self.spellings)} sections have this setting; "
            f"use {' or '.join(self.spellings)}"
        )


def _gist(doc: str) -> str:
    """The first clause of a field's docstring, for an error message."""
    text = doc.replace("``", "")
    for stop in (". ", " (", "; "):
        if stop in text:
            text = text[: text.index(stop)]
    text = text.rstrip(".")
    return text[:1].lower() + text[1:]


def _add_ambiguous(
    group: argparse._ArgumentGroup,
    owners: list[tuple[str, type]],
    counts: dict[str, int],
) -> None:
    """Refuse ``--name`` for each field name shared by sections when no field claims it."""
    claimed = {
        flag for _, cls in owners for f in _fields(cls) for flag in f.metadata.get("flags", ())
    }
    for name in sorted(n for n, c in counts.items() if c > 1):
        bare = f"--{name.replace('_', '-')}"
        if bare in claimed:
            continue
        spellings = []
        for section, cls in owners:
            docs = _field_docs(cls)
            for f in _fields(cls):
                if f.name == name:
                    flags = [f"--{section}.{bare[2:]}", *f.metadata.get("flags", ())]
                    what = _gist(docs.get(name, ""))
                    spellings.append(" / ".join(flags) + (f" ({what})" if what else ""))
        group.add_argument(bare, dest=argparse.SUPPRESS, action=_Ambiguous, spellings=spellings)


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
    _add_ambiguous(group, owners, counts)
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


def add_user_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--dataset``, ``--val-dataset``, ``--loss``, ``--tp-plan`` (user models)."""
    group = parser.add_argument_group(
        "your own model (MODULE is a module name or a .py file; without --model the built-in "
        "GPT trains, and the model.* / data.* flags shape it)"
    )
    group.add_argument("--model", dest="user_model", metavar="MODULE:FUNCTION",
                       help="function returning the torch.nn.Module to train (called on every "
                       "rank under --seed), or hf:DIR: a Hugging Face causal LM (a save_pretrained "
                       "directory or config.json; docs/huggingface.md)")
    group.add_argument("--dataset", dest="user_dataset", metavar="MODULE:FUNCTION",
                       help="function returning a map-style dataset of (input, target) pairs, or "
                       "hf:FILE[,seq_len=N][,field=NAME] (jsonl/json/parquet/csv/txt, tokenized "
                       "with the hf: model's tokenizer and packed)")
    group.add_argument("--val-dataset", dest="user_val_dataset", metavar="MODULE:FUNCTION",
                       help="function returning the validation dataset (default: none)")
    group.add_argument("--loss", dest="user_loss", metavar="MODULE:FUNCTION",
                       help="function (output, target) -> scalar loss (default: cross-entropy; "
                       "hf: the Hugging Face model's own loss)")
    group.add_argument("--tp-plan", dest="user_tp_plan", metavar="MODULE:FUNCTION",
                       help="function returning a TPPlan (or {module pattern: style}) for --tp")


def user_factories(args: argparse.Namespace) -> UserFactories | None:
    """The user-model spec of ``args``; ``None`` for the built-in GPT.

    Raises:
        ValueError: ``--dataset`` and friends without ``--model``, or ``--model`` without
            ``--dataset``.
    """
    model = getattr(args, "user_model", None)
    given = {
        flag: getattr(args, dest, None)
        for flag, dest in (
            ("--dataset", "user_dataset"),
            ("--val-dataset", "user_val_dataset"),
            ("--loss", "user_loss"),
            ("--tp-plan", "user_tp_plan"),
        )
    }
    if not model:
        extra = [flag for flag, value in given.items() if value]
        if extra:
            raise ValueError(f"{', '.join(extra)} need --model MODULE:FUNCTION (your model)")
        return None
    if not given["--dataset"]:
        raise ValueError("--model needs --dataset MODULE:FUNCTION (a dataset of (input, target) pairs)")
    ignored = sorted(
        k for k, v in vars(args).items() if v is not None and k.startswith(("model.", "data."))
    )
    if ignored:
        warnings.warn(
            f"{', '.join('--' + k.replace('_', '-') for k in ignored)} shape the built-in GPT "
            "and corpus: ignored with --model",
            stacklevel=2,
        )
    from torsh_distributed._checks import factory_spec
    from torsh_distributed.hf import is_hf, model_files

    if is_hf(model):
        model_files(model)  # a missing directory: refused before torch is imported
    for flag, spec in (("--model", model), *given.items()):
        if spec and not is_hf(spec) and not (flag == "--loss" and spec == "hf"):
            factory_spec(spec, what=flag[2:])  # a typo: refused before torch is imported
    from torsh_distributed.engine.user import UserFactories

    return UserFactories(
        model=model,
        dataset=given["--dataset"] or "",
        val_dataset=given["--val-dataset"] or "",
        loss=given["--loss"] or "",
        tp_plan=given["--tp-plan"] or "",
    )


def add_deepspeed_arguments(parser: argparse.ArgumentParser) -> None:
    """``--deepspeed FILE``, ``--fairscale FILE`` and ``--strict``."""
    group = parser.add_argument_group(
        "DeepSpeed / FairScale configs (see docs/deepspeed.md; explicit flags must not "
        "contradict a DeepSpeed config)"
    )
    group.add_argument(
        "--deepspeed", metavar="FILE",
        help="a DeepSpeed JSON config mapped onto these settings; every key is reported as "
        "applied, mapped or unsupported (\"auto\" resolves from the flags, as Hugging Face does)",
    )
    group.add_argument(
        "--fairscale", metavar="FILE",
        help="a FairScale set-up as JSON ({\"FullyShardedDataParallel\": {...}}, OSS, "
        "ShardedDataParallel, or fairseq's distributed_training section) mapped onto the ZeRO "
        "stages, with the same report (docs/deepspeed.md#fairscale)",
    )
    group.add_argument(
        "--strict", action="store_true",
        help="refuse a DeepSpeed or FairScale config with unsupported keys",
    )


def _apply_deepspeed(
    args: argparse.Namespace, config: TrainConfig, world_size: int, user: UserFactories | None
) -> TrainConfig:
    from torsh_distributed.compat.deepspeed import import_deepspeed

    sections = TrainConfig.sections()
    explicit = {
        k: v
        for k, v in vars(args).items()
        if v is not None and (k.rpartition(".")[0] in sections or k in TrainConfig.__dataclass_fields__)
    }
    config, report = import_deepspeed(
        args.deepspeed,
        config,
        world_size=world_size,
        explicit=explicit,
        hidden_size=config.model.d_model if user is None else None,
        strict=args.strict,
    )
    print(report.format(), flush=True)
    return config


def _configure(args: argparse.Namespace) -> tuple[TrainConfig, UserFactories | None, Scaled | None, Any]:
    """The run's config (preset, file, flags, then a DeepSpeed/FairScale config), the user's
    factories, the carbon scaling range and the launch options. Sets ``args``'s launch size to
    a range's maximum."""
    from torsh_distributed.cli.run import options_from_args

    config = config_from_args(args)
    user = user_factories(args)
    scaled = scale_range(args, config)
    options = options_from_args(args)
    if getattr(args, "deepspeed", None) and getattr(args, "fairscale", None):
        raise ValueError("give --deepspeed or --fairscale, not both")
    if getattr(args, "deepspeed", None):
        nodes = int(options.nnodes.split(":")[0])  # an elastic range: its minimum
        config = _apply_deepspeed(args, config, options.nproc_per_node * nodes, user)
    elif getattr(args, "fairscale", None):
        from torsh_distributed.compat.fairscale import import_fairscale

        config, report = import_fairscale(args.fairscale, config, strict=args.strict)
        print(report.format(), flush=True)
    elif getattr(args, "strict", False):
        raise ValueError("--strict applies to --deepspeed FILE or --fairscale FILE")
    return config, user, scaled, options


def resolved_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``--print-config``: the command line's settings with every field of the resolved
    :class:`TrainConfig` (a DeepSpeed/FairScale config applied: its report goes to stderr).
    The built-in GPT's ``model``/``data`` sections are left out with ``--model``."""
    import contextlib
    import copy

    from torsh_distributed.cli._config_file import settings_of

    shown = settings_of(args)  # before _configure sets a range's maximum
    with contextlib.redirect_stdout(sys.stderr):
        config, user, _, _ = _configure(copy.copy(args))
    sections = TrainConfig.sections()
    for key in list(shown):
        if key in ("deepspeed", "fairscale", "strict") or key.partition(".")[0] in sections \
                or key in TrainConfig.__dataclass_fields__:
            del shown[key]
    for key, value in config.to_dict().items():
        if key not in sections:
            shown[key] = value
        elif user is None or key not in ("model", "data"):
            shown.update({f"{key}.{name}": inner for name, inner in value.items()})
    return shown


def _handle(args: argparse.Namespace) -> int:
    config, user, scaled, options = _configure(args)
    if getattr(args, "ps_servers", 0):  # the parameter server's loop instead of the engine's
        from torsh_distributed.cli.ps_train import handle_ps

        return handle_ps(args, config, user, options)
    # Already one rank of a job (torchrun / `torsh-dist run`, srun, mpirun): train here, on the
    # world that launcher describes, instead of launching again.
    from torsh_distributed.runtime.env import detect_environment

    world = detect_environment(os.environ)
    inside_launch = world is not None
    if not inside_launch:  # before torch loads
        check_checkpoint_paths(config, one_node=options.nnodes in ("1", "1:1"))
    tracking = (config.monitor.tensorboard or config.monitor.mlflow) and not inside_launch
    if tracking:
        from torsh_distributed.monitor.tracking import precheck_tracking

        precheck_tracking(config.monitor)  # an unreachable server: refused before torch loads
    if config.ft.enabled and not inside_launch and options.nnodes not in ("1", "1:1"):
        raise ValueError("--ft.replica-groups runs on one node (--nnodes 1) for now")
    fixed = not inside_launch and scaled is None and (config.ft.enabled or ":" not in options.nnodes)
    nodes = 1 if config.ft.enabled or not fixed else int(options.nnodes)
    if fixed:  # before torch; with replica groups, the degrees split one group's ranks
        precheck_world(config, launch_world(config, options.nproc_per_node * nodes))
    if not inside_launch and _launches(options, ft=config.ft.enabled):
        from torsh_distributed.elastic import _warm

        # the workers' forkserver, forked from here after `import torch` (docs/multihost.md)
        _warm.prestart(_warm.preload_for("torsh_distributed.train", ft=config.ft.enabled), fork=True)
    if user is not None and not inside_launch:
        user.check(config)  # imports and calls the factories: errors before any rank starts
    if tracking:
        from torsh_distributed.monitor.tracking import check_tracking

        check_tracking(config.monitor)  # a bad store or experiment: refused before any rank starts
    if config.carbon.max_intensity and not inside_launch:
        config.carbon.shift_policy().check(time.time())  # a series or deadline already past
    if world is not None:
        check_world(config, world.world_size, user)
    if not inside_launch and config.energy.meter in ("rapl", "nvml") and options.nnodes in ("1", "1:1"):
        check_meter(config)
    elif fixed:  # a fixed world: check what depends on its size
        check_world(config, launch_world(config, options.nproc_per_node * nodes), user)
    if scaled is not None and not inside_launch:
        return launch_scaled(config, user, options, scaled, check_world=check_world)
    alone = options.nproc_per_node == 1 and options.nnodes in ("1", "1:1") and not config.ft.enabled
    if inside_launch or alone:
        return _train_here(config, user)
    if config.ft.enabled:  # replica groups: only a dead rank's group restarts
        from torsh_distributed.ft.launch import launch_groups

        return launch_groups(
            [sys.executable, "-m", "torsh_distributed.train", "--config-json", config.to_json(),
             *(user.to_args() if user else [])],
            nproc=options.nproc_per_node, section=config.ft, start_method=options.start_method,
        )
    from torsh_distributed.elastic.launch import launch

    return launch(
        options,
        module="torsh_distributed.train",
        args=["--config-json", config.to_json(), *(user.to_args() if user else [])],
    )


def _launches(options: LaunchOptions, *, ft: bool) -> bool:
    """Whether this command starts workers that fork from a warm forkserver (``ft``: replica
    groups, each started by the launcher even when it has one rank)."""
    several = ft or options.nproc_per_node > 1 or options.nnodes not in ("1", "1:1")
    return several and options.start_method == "forkserver" and "PYTHON_EXEC" not in os.environ


def _train_here(config: TrainConfig, user: UserFactories | None = None) -> int:
    if user is not None:
        user.engine(config).fit()
        return 0
    from torsh_distributed.train.trainer import train

    train(config)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``train`` subcommand."""
    from torsh_distributed.cli.run import add_launch_arguments

    parser = sub.add_parser(
        "train",
        help="train your model (--model/--dataset) or the built-in GPT on Python's own source",
        description=(
            "Train with the engine on --nproc-per-node local ranks (Gloo on CPU, NCCL when every "
            "rank has a GPU): your own model and dataset (--model MODULE:FUNCTION --dataset "
            "MODULE:FUNCTION), or by default a small GPT-style byte-level transformer on the text "
            "of the Python standard library. DDP, ZeRO-1/2/3, --tp, --pp, compression, "
            "checkpoints and monitoring apply to both. --batch-size is the global batch: runs at "
            "different world sizes see the same samples per step."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_arguments(parser)
    for action in parser._actions:  # noqa: SLF001 - train alone takes a range (carbon scaling)
        if action.dest == "nproc_per_node":
            action.metavar = "N|MIN:MAX"
            action.help = f"{action.help}. MIN:MAX with --carbon.scale: carbon-aware scaling"
    add_user_model_arguments(parser)
    add_config_arguments(parser)
    add_deepspeed_arguments(parser)
    from torsh_distributed.cli._config_file import add_config_file_arguments
    from torsh_distributed.cli.ps_train import add_ps_arguments

    add_ps_arguments(parser)
    add_config_file_arguments(parser, tables=("user",), resolver=resolved_settings)
    parser.set_defaults(handler=_handle)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torsh_distributed.train`` (runs on each launched rank)."""
    parser = argparse.ArgumentParser(
        prog="python -m torsh_distributed.train",
        description="Run the built-in trainer on this rank (launch with `torsh-dist run`).",
    )
    add_user_model_arguments(parser)
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        user = user_factories(args)
    except ValueError as exc:
        parser.error(str(exc))
    return _train_here(config, user)


if __name__ == "__main__":
    sys.exit(main())
