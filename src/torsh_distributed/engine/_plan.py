"""The layout of a run, validated before anything is built: :func:`plan_run`.

:func:`plan_run` is pure (no communication): every rank evaluates it on the same inputs, so an
invalid set-up raises the same ``ValueError`` on every rank before any of them waits on another,
and ``torsh-dist train`` runs it once more before it launches the ranks. It lives apart from
:mod:`~torsh_distributed.engine._setup` so that the launcher does not import what only the ranks
use (DTensor, FSDP2, ``torch.distributed.pipelining`` and, through them, sympy and dynamo: about
2 s before the first rank starts); the pipeline and tensor-parallel checks import their modules
only for ``pp > 1`` / ``tp > 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torsh_distributed.comm.degrees import check_degrees
from torsh_distributed.comm.dims import ParallelDims
from torsh_distributed.compression.spec import parse_spec
from torsh_distributed.parallel.config import check_world

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import TypeAlias

    from torch.distributed.tensor.parallel import ParallelStyle

    from torsh_distributed.compression.config import CompressionConfig
    from torsh_distributed.engine.config import EngineConfig
    from torsh_distributed.parallel.tp_plan import TPPlan

    PlanLike: TypeAlias = TPPlan | Mapping[str, str | ParallelStyle]
    """What a tensor-parallel plan may be given as (a :class:`TPPlan` or its rules)."""

__all__ = ["RunPlan", "check_compression", "plan_run"]


@dataclass(kw_only=True, slots=True)
class RunPlan:
    """The validated layout of a run (no process groups yet)."""

    dims: ParallelDims
    """Degrees (unbuilt until :func:`build_model`)."""
    per_dp: int
    """Samples per data-parallel rank per step (the batch is split over ``dp * ep`` ranks)."""
    tp_plan: TPPlan | None
    """The tensor-parallel plan, normalised (``None`` at tp 1)."""

    @property
    def model_parallel(self) -> bool:
        return self.dims.tp > 1 or self.dims.pp > 1


def plan_run(
    config: EngineConfig,
    *,
    world_size: int,
    tp_plan: PlanLike | None,
    device_type: str = "cpu",
    nodes: list[int] | None = None,
) -> RunPlan:
    """Validate degrees, batch split, pipeline schedule and component combinations.

    Raises:
        ValueError: naming the setting and what it must be.
    """
    par = config.parallel
    degrees = check_degrees(par, world_size)
    dims = ParallelDims(**degrees, world_size=world_size, device_type=device_type,
                        node_assignment=nodes)
    if config.ft.enabled:  # world_size is one replica group's: the groups split the batch first
        per_dp = config.ft.check_batch(config.batch_size, data_ranks=dims.data_degree,
                                       grad_accum=config.grad_accum)
    else:
        per_dp = config.check_world(dims.data_degree)  # ep ranks hold different samples
    check_world(par, dims.data_degree)  # FSDP2 shards dense parameters over dp x ep
    if dims.ep > 1 and config.compression.enabled:
        raise ValueError(
            f"--compression {config.compression.method} with parallel.ep={dims.ep} is not built "
            "yet; use --compression none with expert parallelism"
        )
    # compression x layout, before any rank builds anything (the CLI runs this before launching)
    check_compression(
        config.compression, zero_stage=par.zero_stage, model_parallel=dims.tp > 1 or dims.pp > 1
    )
    if (dims.tp > 1 or dims.pp > 1) and config.grad_accum > 1:
        raise ValueError(
            f"--grad-accum {config.grad_accum} applies to data parallelism; with --tp/--pp "
            "use --microbatches (pipeline micro-batches) instead"
        )
    if dims.pp > 1:
        from torsh_distributed.parallel.pipeline import check_pipeline

        check_pipeline(
            pp=dims.pp,
            schedule=par.pp_schedule,
            microbatches=par.num_microbatches,
            virtual_stages=par.virtual_stages,
            batch_size=per_dp,
        )
    elif par.virtual_stages != 1:
        raise ValueError(f"parallel.virtual_stages={par.virtual_stages} needs parallel.pp > 1")
    if par.meta_init and dims.tp > 1 and device_type == "cpu":
        raise ValueError(
            "parallel.meta_init with tp > 1 needs DTensor's distributed random numbers, which "
            "CPU meshes lack (every tensor-parallel shard would get the same draw); build the "
            "model on the device (no meta_init) or run on CUDA"
        )
    plan: TPPlan | None = None
    if dims.tp > 1:
        from torsh_distributed.parallel.tp_plan import TPPlan

        if tp_plan is None:
            raise ValueError(
                f"parallel.tp={dims.tp} needs a tensor-parallel plan for this model "
                "(Engine(tp_plan=...), or --tp-plan MODULE:FUNCTION)"
            )
        plan = tp_plan if isinstance(tp_plan, TPPlan) else TPPlan(rules=tp_plan)
        if plan.loss_parallel and dims.pp > 1:
            raise ValueError(
                "a loss-parallel TP plan leaves the logits sharded; with pp > 1 the pipeline's "
                "last stage needs whole logits: use a plan with loss_parallel=False"
            )
    return RunPlan(dims=dims, per_dp=per_dp, tp_plan=plan)


def check_compression(
    section: CompressionConfig, *, zero_stage: int, model_parallel: bool = False
) -> None:
    """Reject combinations compression cannot honour, naming what works instead.

    Raises:
        ValueError: at ZeRO stage 1 (ZeroRedundancyOptimizer) any method; at stages 2-3 any
            method but ``int8`` (FSDP2 reduce-scatters gradients and all-gathers parameters: only
            the block-quantised collectives apply there), or int8 collectives with tp/pp
            (``model_parallel``).
    """
    if not section.enabled:
        return
    stage, method = zero_stage, str(parse_spec(section.method))
    if stage == 1:
        raise ValueError(
            f"--compression {method} applies to DDP (parallel.zero_stage 0) or, as int8 "
            "quantised collectives, to FSDP2 (zero_stage 2|3); got --zero-stage 1. Use "
            f"--zero-stage 0 --compression {method}, or --zero-stage 2 --compression int8"
        )
    if stage >= 2 and method != "int8":
        raise ValueError(
            f"--compression {method} applies to DDP (parallel.zero_stage 0) only; got "
            f"--zero-stage {stage}, where FSDP2 reduce-scatters gradients and all-gathers "
            f"parameters. Use --compression int8 with --zero-stage {stage} (block-quantised "
            f"all-gather and reduce-scatter, ZeRO++'s qwZ/qgZ), or --zero-stage 0 --compression "
            f"{method}"
        )
    if stage >= 2 and model_parallel:
        raise ValueError(_ZERO_MP)


_ZERO_MP = (
    "--zero-stage 2|3 --compression int8 (quantised FSDP2 collectives) needs tp 1 and pp 1; with "
    "tensor or pipeline parallelism use --zero-stage 0 --compression int8 (the data-parallel "
    "exchange of the local shards)"
)
