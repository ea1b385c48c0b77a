"""The checks ``torsh-dist train`` runs before any rank starts (most before torch is imported):
the parallel degrees against the world size, an energy meter named, the checkpoint paths."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torsh_distributed.engine.user import UserFactories
    from torsh_distributed.train.config import TrainConfig

__all__ = ["check_checkpoint_paths", "check_meter", "check_world", "precheck_world"]


def precheck_world(config: TrainConfig, world_size: int) -> None:
    """The part of :func:`check_world` that needs no torch (degrees, the batch split, ZeRO's
    data-parallel ranks): run before anything imports it, so such a refusal takes 0.2 s."""
    from torsh_distributed.comm.degrees import check_degrees
    from torsh_distributed.parallel.config import check_world as check_sharding

    degrees = check_degrees(config.parallel, world_size)
    data_ranks = degrees["dp"] * degrees["ep"]  # ParallelDims.data_degree
    config.check_world(data_ranks)
    check_sharding(config.parallel, data_ranks)


def check_world(config: TrainConfig, world_size: int, user: UserFactories | None) -> None:
    """The engine's checks that need only the world size (degrees, batch split, pipeline
    schedule), before any rank starts: the same function every rank runs again."""
    precheck_world(config, world_size)
    from torsh_distributed.engine._plan import plan_run

    par, plan = config.parallel, None

    if par.tp > 1:
        if user is None:
            from torsh_distributed.models.gpt_tp import gpt_tp_plan

            plan = gpt_tp_plan(sequence_parallel=par.sequence_parallel, loss_parallel=par.pp == 1)
        else:
            plan = user.plan()
    plan_run(config, world_size=world_size, tp_plan=plan)


def check_meter(config: TrainConfig) -> None:
    """A meter asked for by name must be readable on this host (all ranks run here): refused
    with the reason before any rank starts instead of on every rank after set-up."""
    from torsh_distributed.energy.auto import open_meter
    from torsh_distributed.energy.meters import MeterUnavailableError

    energy = config.energy
    try:
        open_meter(
            energy.meter, powercap_root=energy.powercap_root, watts_per_core=energy.watts_per_core
        )
    except MeterUnavailableError as exc:
        raise ValueError(f"--energy.meter {energy.meter}: {exc}") from None


def check_checkpoint_paths(config: TrainConfig, *, one_node: bool) -> None:
    """``--checkpoint-dir`` can be created (nothing is created here) and written; on one node, a ``--resume PATH`` exists
    (other nodes may hold their own copy: they check it themselves)."""
    from torsh_distributed._checks import check_creatable_dir

    section = config.checkpoint
    if section.dir:
        check_creatable_dir(Path(section.dir), "--checkpoint-dir")
    if one_node and section.resume not in ("auto", "never") and not Path(section.resume).is_dir():
        raise ValueError(
            f"--resume {section.resume}: no such checkpoint directory (give auto, never, or a "
            "checkpoint's path)"
        )
