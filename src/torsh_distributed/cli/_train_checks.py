"""The checks ``torsh-dist train`` runs before any rank starts (most before torch is imported):
the parallel degrees against the world size, an energy meter named, the checkpoint paths."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torsh_distributed.engine.user import UserFactories
    from torsh_distributed.train.config import TrainConfig

__all__ = [
    "check_checkpoint_paths", "check_meter", "check_world", "launch_world", "precheck_world",
]


def launch_world(config: TrainConfig, nproc: int) -> int:
    """The world the parallel degrees split for ``nproc`` ranks in all: with replica groups
    (``--ft.replica-groups R``) one group's ranks, ``nproc / R``; otherwise ``nproc``."""
    return config.ft.check_nproc(nproc) if config.ft.enabled else nproc


def precheck_world(config: TrainConfig, world_size: int) -> None:
    """The part of :func:`check_world` that needs no torch (degrees, the batch split, ZeRO's
    data-parallel ranks): run before anything imports it, so such a refusal takes 0.2 s.
    ``world_size``: the ranks the degrees split (one replica group's, :func:`launch_world`)."""
    from torsh_distributed.comm.degrees import WorldSizeMismatch, check_degrees
    from torsh_distributed.parallel.config import check_world as check_sharding

    try:
        degrees = check_degrees(config.parallel, world_size)
    except WorldSizeMismatch as exc:
        if not config.ft.enabled:
            raise
        groups = config.ft.replica_groups
        raise ValueError(f"{exc} (one of {groups} replica groups' ranks)") from None
    data_ranks = degrees["dp"] * degrees["ep"]  # ParallelDims.data_degree
    if config.ft.enabled:  # the batch splits over the groups first: say so in the refusal
        config.ft.check_batch(config.batch_size, data_ranks=data_ranks,
                              grad_accum=config.grad_accum)
    else:
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
