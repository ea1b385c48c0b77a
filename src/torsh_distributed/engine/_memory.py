"""The engine's memory accounting: predicted (planner) vs measured, per rank.

Kept out of the loop so the loop only calls three methods: construct before the model is built
(the resident memory at that point is the process baseline: Python, torch, the process group,
the data), :meth:`after_step` once (prints predicted vs measured on rank 0) and :meth:`summary`
at the end (the ``memory`` block of the summary). Model states are predicted by the ZeRO
formulas for any model; activations only when the caller supplies an estimate (the built-in
GPT's formula), otherwise the peak prediction leaves them out and says so. With tensor or
pipeline parallelism only the measurement is reported (the planner models dp sharding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torsh_distributed.parallel.blocks import block_entries, find_blocks
from torsh_distributed.parallel.expert import expert_parameters
from torsh_distributed.parallel.memory import (
    ModelStateMeasurement,
    cuda_peak_bytes,
    current_rss_bytes,
    measure_model_state,
    peak_rss_bytes,
    reset_peak_rss,
)
from torsh_distributed.plan.memory import (
    format_bytes,
    model_state_bytes,
    transient_bytes,
)

__all__ = ["MemoryReport", "predict_peak_rss", "for_table", "planner_optimizer"]


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
    largest model-state transient (DDP buckets, none at ``dp == 1`` where no DDP wraps the model;
    or unsharded FSDP parameters) + activations saved
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
    if stage <= 1 and dp == 1:
        transient = 0  # one data-parallel rank: no DDP wrapper, so no gradient buckets
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
    if optim.optimizer in ("adamw", "onebit_adam", "zerooneadam"):
        return "adam"  # the 1-bit methods' error buffers (about 1x more) are not modelled
    return "sgd" if optim.momentum else "sgd-plain"


def for_table(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with its ``memory`` block reduced to a few readable rows (for the table)."""
    out = {k: v for k, v in summary.items() if k != "memory"}
    memory = summary.get("memory") or {}
    measured = memory.get("model_state_bytes_per_rank")
    if measured:
        out["model states/rank (measured)"] = format_bytes(measured["total"])
        if "predicted_model_state_bytes_per_rank" in memory:
            predicted = memory["predicted_model_state_bytes_per_rank"]["total"]
            out["model states/rank (predicted)"] = format_bytes(predicted)
        out["shard padding/rank (B)"] = sum(measured["padding"].values())
    if "peak_rss_bytes" in memory:
        out["peak RSS/rank"] = format_bytes(memory["peak_rss_bytes"])
    if "predicted_peak_rss_bytes" in memory:
        out["peak RSS/rank (predicted)"] = format_bytes(memory["predicted_peak_rss_bytes"])
    return out


class MemoryReport:
    """Predicted vs measured memory of a training run (see module docstring).

    Args:
        zero_stage: ZeRO stage of the run.
        dp: Data-parallel ranks the dense parameters are sharded over (``dp * ep``).
        optimizer: The planner's optimizer name (``adam``, ``sgd``, ``sgd-plain``; see
            :func:`planner_optimizer`), or ``""`` when unknown (a user's optimizer): then only
            the measurement is reported.
        weight_decay: Whether the optimizer decays (SGD's step then allocates a gradient copy).
        param_dtype: Compute dtype (``fp32``/``bf16``/``fp16``) of the transient gathers.
        activations: Bytes of activations saved for backward per rank, or ``None`` (unknown).
        predict: ``False`` with tensor or pipeline parallelism (measured only).
    """

    def __init__(
        self,
        *,
        zero_stage: int,
        dp: int,
        optimizer: str = "adam",
        weight_decay: bool = True,
        param_dtype: str = "fp32",
        activations: Callable[[], int] | None = None,
        predict: bool = True,
    ) -> None:
        self._stage, self._dp = zero_stage, dp
        self._optimizer, self._weight_decay = optimizer, weight_decay
        self._param_dtype = param_dtype
        self._activations = activations
        self._predict = predict and bool(optimizer)
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
        self._measured = measure_model_state(model, optimizer)
        if not self._predict:
            if main:
                m = self._measured
                write(
                    f"memory per rank after step 1: model states measured {format_bytes(m.total)} "
                    f"(params {format_bytes(m.params.held)}, grads {format_bytes(m.grads.held)}, "
                    f"optimizer {format_bytes(m.optimizer.held)}); peak RSS so far "
                    f"{format_bytes(peak_rss_bytes())}"
                )
            return
        stage = self._stage
        experts = {id(p) for p in expert_parameters(model)}

        def count(params: Any) -> int:  # this rank's experts (DTensor shards), the rest whole
            return sum(p.to_local().numel() if id(p) in experts else p.numel() for p in params)

        num_params = count(model.parameters())
        expert_params = count(p for p in model.parameters() if id(p) in experts)
        try:
            _, container = find_blocks(model)
            blocks = [m for _, m in block_entries(container)]
        except ValueError:
            blocks = []
        block_params = count(blocks[0].parameters()) if blocks else 0
        # FSDP2 (stage >= 2) shards the dense parameters; it leaves the experts whole (sharded
        # over ep by expert parallelism, replicated over dp): count those as unsharded
        whole = expert_params if stage >= 2 else 0
        predicted = model_state_bytes(
            num_params - whole,
            self._dp,
            stage,
            dtype="fp32",
            optimizer=self._optimizer,
            layout="fsdp2",
        )
        if whole:
            unsharded = model_state_bytes(
                whole, 1, 0, dtype="fp32", optimizer=self._optimizer, layout="fsdp2"
            )
            predicted = dataclasses.replace(
                predicted,
                params=predicted.params + unsharded.params,
                grads=predicted.grads + unsharded.grads,
                optimizer=predicted.optimizer + unsharded.optimizer,
            )
        self._predicted = predicted.to_dict()
        acts = self._activations() if self._activations is not None else 0
        self._peak_terms = predict_peak_rss(
            baseline=self._baseline,
            num_params=num_params,
            block_params=block_params,
            n_layer=len(blocks),
            dp=self._dp,
            stage=stage,
            param_dtype=self._param_dtype,
            activations=acts,
            optimizer=self._optimizer,
            weight_decay=self._weight_decay,
        )
        if self._activations is None:
            self._peak_terms["activations_unknown"] = 1
        if main:
            m = self._measured
            # ZeRO-1 partitions whole parameters: the per-rank optimizer state is uneven
            imbalance = m.total - m.padding - predicted.total
            extra = (
                f", ZeRO-1 partition imbalance {imbalance:+d} B" if imbalance and stage == 1 else ""
            )
            write(
                f"memory per rank after step 1 (ZeRO stage {stage}, {self._dp} data-parallel "
                f"ranks): model states "
                f"predicted {format_bytes(predicted.total)}, measured {format_bytes(m.total)} "
                f"(params {format_bytes(m.params.held)}, grads {format_bytes(m.grads.held)}, "
                f"optimizer {format_bytes(m.optimizer.held)}; shard padding {m.padding} B{extra}); "
                f"peak RSS so far {format_bytes(peak_rss_bytes())}, predicted peak "
                f"{format_bytes(self._peak_terms['total'])} (one-off runtime allocations of the "
                f"first step{'' if self._activations else ' and activations'} not modelled: "
                f"see docs/sharding.md)"
            )

    def summary(self) -> dict[str, Any]:
        """The ``memory`` block of the run summary (this rank's figures)."""
        out: dict[str, Any] = {"zero_stage": self._stage}
        if self._measured is not None:
            out["model_state_bytes_per_rank"] = self._measured.to_dict()
        if self._predicted:
            out["predicted_model_state_bytes_per_rank"] = self._predicted
            out["predicted_peak_rss_bytes"] = self._peak_terms.get("total", 0)
        out["baseline_rss_bytes"] = self._baseline
        out["peak_rss_bytes"] = peak_rss_bytes()
        cuda = cuda_peak_bytes()
        if cuda is not None:
            out["cuda_max_allocated_bytes"] = cuda
        return out
