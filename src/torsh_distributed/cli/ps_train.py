"""``torsh-dist train --ps-servers S --staleness s``: the built-in GPT or the user's model trained
asynchronously through the parameter server (:mod:`torsh_distributed.ps.train`) instead of the
engine's data-parallel loop.

The world is ``--nproc-per-node`` ranks launched as usual: ranks below S are servers, the rest
workers. From the training config it takes ``max_steps``, ``batch_size`` (the global batch per
step), ``seed``, ``summary_json`` and the whole ``optim`` section: the servers apply the run's
optimizer (``adamw`` or ``sgd``, unless ``--ps-optim`` names another) with its ``lr``,
``momentum``, ``beta1``, ``beta2``, ``eps``, ``weight_decay`` (matrices only, as the engine
groups them), the engine's learning-rate schedule per step (warm-up, then ``schedule`` to
``min_lr_ratio``), and ``grad_clip`` (synchronous: on the step's mean gradient, as data
parallelism clips; else per push). Batches come from the engine's sampler with the same seed, so
``--staleness 0`` trains as the same command without ``--ps-servers`` (data parallelism).
Synchronous clipping through several servers with several workers is refused (no server holds
the mean's global norm); every other setting that differs from the preset is reported as
ignored. What runs on the ranks is ``python -m torsh_distributed.cli.ps_train --config-json ...
--ps-json ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torsh_distributed.ps.config import OPTIMIZERS, PSConfig, ServerOptimConfig, check_clip_mean
from torsh_distributed.train.config import TrainConfig

if TYPE_CHECKING:
    from torsh_distributed.engine.user import UserFactories
    from torsh_distributed.ps.train import PSTrainConfig

__all__ = ["add_ps_arguments", "handle_ps", "main"]

_USED = {"max_steps", "batch_size", "seed", "summary_json", "log_every", "optim"}
_USED_OPTIM = {"optimizer", "lr", "momentum", "beta1", "beta2", "eps", "grad_clip", "weight_decay",
               "warmup_steps", "schedule", "min_lr_ratio"}
_SERVER_KIND = {"adamw": "adamw", "sgd": "sgd"}
"""The servers' update rule for the engine's optimizer."""


def add_ps_arguments(parser: argparse.ArgumentParser) -> None:
    """``--ps-servers``, ``--staleness``, ``--ps-optim``, ``--ps-snapshot-dir``,
    ``--ps-snapshot-every``, ``--ps-host`` (the token comes from ``TORSH_PS_TOKEN``)."""
    group = parser.add_argument_group(
        "parameter server (docs/parameter-server.md): train through S server ranks instead of DDP"
    )
    group.add_argument("--ps-servers", type=int, default=0, metavar="S",
                       help="server ranks (the first S of --nproc-per-node); 0 = off (the engine)")
    group.add_argument("--staleness", type=int, default=0, metavar="s",
                       help="0 = synchronous, s > 0 = bounded staleness (SSP), -1 = fully asynchronous")
    group.add_argument("--ps-optim", choices=OPTIMIZERS, default=None,
                       help="the servers' optimizer; default: the run's --optimizer (adamw or sgd) "
                       "with its settings and learning-rate schedule, as data parallelism applies it")
    group.add_argument("--ps-snapshot-dir", default="", metavar="DIR",
                       help="snapshot each server's shard here; a restarted job restores from it")
    group.add_argument("--ps-snapshot-every", type=int, default=0, metavar="N",
                       help="snapshot every N applied updates (0 = only at the end)")
    group.add_argument("--ps-host", default="127.0.0.1",
                       help="address the RPC agents listen on; non-loopback needs TORSH_PS_TOKEN")


def _ps_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "num_servers": args.ps_servers,
        "staleness": args.staleness,
        "snapshot_dir": args.ps_snapshot_dir,
        "snapshot_every": args.ps_snapshot_every,
        "host": args.ps_host,
        "kind": args.ps_optim,
    }


def ps_train_config(
    config: TrainConfig, settings: dict[str, Any], *, warn: bool = False, user: UserFactories | None = None
) -> PSTrainConfig:
    """The :class:`PSTrainConfig` of a training config plus the ``--ps-*`` settings; ``user``:
    the user's model and data (their batches come from the engine's epoch sampler, the
    built-in GPT's from its replacement sampler, as the engine draws them)."""
    from torsh_distributed.engine.optim import lr_at
    from torsh_distributed.ps.train import PSTrainConfig
    from torsh_distributed.train.config import preset

    opt = config.optim
    if opt.optimizer in ("onebit_adam", "zerooneadam"):
        raise ValueError(
            f"--optimizer {opt.optimizer} exchanges data-parallel gradients itself: not with --ps-servers "
            "(the servers' optimizer is --ps-optim adam|sgd; for 1-bit Adam train without --ps-servers)"
        )
    if warn:
        base = preset("tiny").to_dict()
        given = config.to_dict()
        ignored = [f"optim.{k}" for k, v in given["optim"].items() if k not in _USED_OPTIM and v != base["optim"][k]]
        for section in ("parallel", "compression", "checkpoint", "monitor"):
            if section in given and given[section] != base.get(section):
                ignored.append(section + ".*")
        if ignored:
            warnings.warn(f"with --ps-servers these settings are ignored: {', '.join(ignored)}", stacklevel=2)
    settings = dict(settings)
    kind = settings.pop("kind") or _SERVER_KIND[opt.optimizer]
    if warn and kind != _SERVER_KIND.get(opt.optimizer):
        warnings.warn(f"--ps-optim {kind}: the servers apply {kind}, not the run's --optimizer "
                      f"{opt.optimizer}; the run will differ from data parallelism", stacklevel=2)
    ps = PSConfig(token=os.environ.get("TORSH_PS_TOKEN", ""), **settings)
    lrs = tuple(lr_at(step, optim=opt, max_steps=config.max_steps) for step in range(config.max_steps))
    optim = ServerOptimConfig(kind=kind, lr=opt.lr, lrs=lrs, momentum=opt.momentum if kind == "sgd" else 0.0,
                              beta1=opt.beta1, beta2=opt.beta2, eps=opt.eps,
                              weight_decay=opt.weight_decay if kind in ("adamw", "sgd") else 0.0,
                              decay_matrices_only=True, clip_norm=opt.grad_clip, clip_mean=True)
    return PSTrainConfig(ps=ps, optim=optim, max_steps=config.max_steps, batch_size=config.batch_size,
                         seed=config.seed, log_every=config.log_every if config.progress else 0,
                         summary_json=config.summary_json, sampler="replacement" if user is None else "epoch")


def handle_ps(args: argparse.Namespace, config: TrainConfig, user: UserFactories | None, options: Any) -> int:
    """Launch the parameter-server run that ``args`` describe (the CLI's side)."""
    from torsh_distributed.elastic.launch import launch

    settings = _ps_settings(args)
    ps = ps_train_config(config, settings, warn=True, user=user)  # validate before any rank starts
    world = options.nproc_per_node * int(str(options.nnodes).split(":")[0])
    if world <= args.ps_servers:
        raise ValueError(f"--ps-servers {args.ps_servers} needs --nproc-per-node > {args.ps_servers} "
                         "(servers plus at least one worker)")
    check_clip_mean(ps.optim, ps.ps, num_workers=world - args.ps_servers)
    return launch(options, module="torsh_distributed.cli.ps_train",
                  args=["--config-json", config.to_json(), "--ps-json", json.dumps(settings),
                        *(user.to_args() if user else [])])


def _pieces(config: TrainConfig, user: UserFactories | None) -> tuple[Any, Any, Any]:
    if user is not None:
        import torch

        from torsh_distributed.engine.user import load_object

        model = load_object(user.model, what="model")
        dataset = load_object(user.dataset, what="dataset")()
        loss = load_object(user.loss, what="loss") if user.loss else torch.nn.functional.cross_entropy
        return model, dataset, loss
    from torsh_distributed.data.corpus import TokenWindows, load_corpus
    from torsh_distributed.models.gpt import GPT, lm_loss

    corpus = load_corpus(config.data, min_tokens=config.model.block_size + 2)
    return (lambda: GPT(config.model, moe=config.moe)), TokenWindows(corpus.train, config.model.block_size), lm_loss


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point on each launched rank."""
    from torsh_distributed.engine.user import UserFactories
    from torsh_distributed.ps.train import format_summary, run

    parser = argparse.ArgumentParser(prog="python -m torsh_distributed.cli.ps_train")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--ps-json", required=True)
    for flag in ("--model", "--dataset", "--val-dataset", "--loss", "--tp-plan"):  # UserFactories.to_args
        parser.add_argument(flag, default="")
    args = parser.parse_args(argv)
    config = TrainConfig.from_dict(json.loads(args.config_json))
    user = (UserFactories(model=args.model, dataset=args.dataset, loss=args.loss) if args.model else None)
    model_fn, dataset, loss_fn = _pieces(config, user)
    summary = run(model_fn, dataset, loss_fn, ps_train_config(config, json.loads(args.ps_json), user=user))
    if summary is not None:
        print(format_summary(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
