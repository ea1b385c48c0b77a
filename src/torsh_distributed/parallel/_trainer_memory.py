"""The trainer's memory accounting: predicted (planner) vs measured, per rank.

Kept out of the loop so the loop only calls three methods: construct before the model is built
(the resident memory at that point is the process baseline: Python, torch, the process group,
the corpus), :meth:`after_step` once (prints predicted vs measured on rank 0) and
:meth:`summary` at the end (the ``memory`` block of the summary).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torsh_distributed.parallel.memory import (
    ModelStateMeasurement,
    cuda_peak_bytes,
    current_rss_bytes,
    measure_model_state,
    peak_rss_bytes,
    reset_peak_rss,
)
from torsh_distributed.plan.memory import (
    activation_bytes,
    format_bytes,
    model_state_bytes,
    transient_bytes,
)

__all__ = ["TrainerMemory", "predict_peak_rss", "for_table", "planner_optimizer"]


def predict_peak_rss(
    *,
    baseline: int,
    num_params: int,
    block_params: int,
    n_layer: int,
    dp: int,
    stage: int,
    param_dtype: str,
    activations: int,
    optimizer: str = "adam",
    weight_decay: bool = True,
) -> dict[str, int]:
    """Predicted peak resident memory of one rank on CPU, by term.

    ``baseline`` (measured before the model exists) + model states (planner, FSDP2 layout) + the
    largest model-state transient (DDP buckets, or unsharded FSDP parameters) + activations saved
    for backward + the optimizer step's temporary (torch's foreach Adam allocates one
    ``sqrt(v)`` buffer the size of the local state it steps; foreach SGD with weight decay one
    copy of the gradients, without none). ``optimizer`` is the planner's name (``adam``,
    ``sgd``, ``sgd-plain``).
    """
    states = model_state_bytes(
        num_params, dp, stage, dtype="fp32", optimizer=optimizer, layout="fsdp2"
    )
    transient = transient_bytes(
        stage,
        num_params=num_params,
        unit_params=[block_params] * n_layer,
        root_params=num_params - block_params * n_layer,
        dtype=param_dtype,
    )
    local = num_params if stage == 0 else num_params / dp
    terms = {
        "baseline": baseline,
        "model_states": states.total,
        "transient": transient,
        "activations": activations,
        "optimizer_temp": round(4 * local) if optimizer == "adam" or weight_decay else 0,
    }
    terms["total"] = sum(terms.values())
    return terms


def planner_optimizer(optim: Any) -> str:
    """The planner's optimizer name for a trainer's ``OptimConfig``."""
    if optim.optimizer == "adamw":
        return "adam"
    return "sgd" if optim.momentum else "sgd-plain"


def for_table(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with its ``memory`` block reduced to a few readable rows (for the table)."""
    out = {k: v for k, v in summary.items() if k != "memory"}
    memory = summary.get("memory") or {}
    measured = memory.get("model_state_bytes_per_rank")
    if measured:
        predicted = memory["predicted_model_state_bytes_per_rank"]["total"]
        out["model states/rank (measured)"] = format_bytes(measured["total"])
        out["model states/rank (predicted)"] = format_bytes(predicted)
        out["shard padding/rank (B)"] = sum(measured["padding"].values())
    if "peak_rss_bytes" in memory:
        out["peak RSS/rank"] = format_bytes(memory["peak_rss_bytes"])
    if "predicted_peak_rss_bytes" in memory:
        out["peak RSS/rank (predicted)"] = format_bytes(memory["predicted_peak_rss_bytes"])
    return out


class TrainerMemory:
    """Predicted vs measured memory of a training run (see module docstring)."""

    def __init__(self, config: Any, *, world_size: int) -> None:
        self._config = config
        self._dp = world_size
        reset_peak_rss()
        self._baseline = current_rss_bytes()
        self._measured: ModelStateMeasurement | None = None
        self._predicted: dict[str, int] = {}
        self._peak_terms: dict[str, int] = {}

    def after_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *, main: bool, write: Any
    ) -> None:
        """Measure once (the first call) and, on the main rank, ``write`` predicted vs measured."""
        if self._measured is not None:
            return
        cfg = self._config
        stage = cfg.parallel.zero_stage
        num_params = sum(p.numel() for p in model.parameters())
        blocks = getattr(model, "blocks", [])
        block_params = sum(p.numel() for p in blocks[0].parameters()) if len(blocks) else 0
        self._measured = measure_model_state(model, optimizer)
        optimizer_kind = planner_optimizer(cfg.optim)
        predicted = model_state_bytes(
            num_params, self._dp, stage, dtype="fp32", optimizer=optimizer_kind, layout="fsdp2"
        )
        self._predicted = predicted.to_dict()
        every = cfg.parallel.checkpoint_every
        checkpointed = len(range(0, cfg.model.n_layer, every)) if every else 0
        acts = activation_bytes(
            n_layer=cfg.model.n_layer,
            d_model=cfg.model.d_model,
            n_head=cfg.model.n_head,
            seq_len=cfg.model.block_size,
            batch=cfg.batch_size // self._dp,
            vocab_size=cfg.model.vocab_size,
            checkpointed_layers=checkpointed,
            dtype_bytes=4 if cfg.parallel.param_dtype == "fp32" else 2,
        )
        self._peak_terms = predict_peak_rss(
            baseline=self._baseline,
            num_params=num_params,
            block_params=block_params,
            n_layer=len(blocks),
            dp=self._dp,
            stage=stage,
            param_dtype=cfg.parallel.param_dtype,
            activations=acts,
            optimizer=optimizer_kind,
            weight_decay=cfg.optim.weight_decay > 0,
        )
        if main:
            m = self._measured
            # ZeRO-1 partitions whole parameters: the per-rank optimizer state is uneven
            imbalance = m.total - m.padding - predicted.total
            extra = f", ZeRO-1 partition imbalance {imbalance:+d} B" if imbalance else ""
            write(
                f"memory per rank after step 1 (ZeRO stage {stage}, dp {self._dp}): model states "
                f"predicted {format_bytes(predicted.total)}, measured {format_bytes(m.total)} "
                f"(params {format_bytes(m.params.held)}, grads {format_bytes(m.grads.held)}, "
                f"optimizer {format_bytes(m.optimizer.held)}; shard padding {m.padding} B{extra}); "
                f"peak RSS so far {format_bytes(peak_rss_bytes())}, predicted peak "
                f"{format_bytes(self._peak_terms['total'])} (one-off runtime allocations of the "
                f"first step not modelled: see docs/sharding.md)"
            )

    def summary(self) -> dict[str, Any]:
        """The ``memory`` block of the run summary (this rank's figures)."""
        out: dict[str, Any] = {"zero_stage": self._config.parallel.zero_stage}
        if self._measured is not None:
            out["model_state_bytes_per_rank"] = self._measured.to_dict()
            out["predicted_model_state_bytes_per_rank"] = self._predicted
            out["predicted_peak_rss_bytes"] = self._peak_terms.get("total", 0)
        out["baseline_rss_bytes"] = self._baseline
        out["peak_rss_bytes"] = peak_rss_bytes()
        cuda = cuda_peak_bytes()
        if cuda is not None:
            out["cuda_max_allocated_bytes"] = cuda
        return out
