"""The simulator's layout (:class:`SimLayout`): degrees, ZeRO stage, schedule, recomputation;
its own module so that the cost modules and :mod:`.simulate` (which re-exports it) share it."""

from __future__ import annotations

from dataclasses import dataclass

from torsh_distributed.plan._sim_network import BACKENDS, TOPOLOGIES
from torsh_distributed.plan._sim_schedule import SCHEDULES

__all__ = ["RECOMPUTE", "SimLayout"]

RECOMPUTE = ("none", "selective", "full")


@dataclass(kw_only=True, slots=True)
class SimLayout:
    """One pinned layout and how it runs. ``dp`` is what the devices leave: ``devices / (tp pp ep)``."""

    tp: int = 1
    """Tensor-parallel degree (inside a node)."""
    pp: int = 1
    """Pipeline ranks."""
    ep: int = 1
    """Expert-parallel degree (MoE models)."""
    zero_stage: int = 0
    """0: all-reduce; 1: sharded optimizer (reduce-scatter + all-gather); 2: + gradients
    reduce-scattered every micro-batch; 3: + parameters gathered per layer."""
    micro_batch: int = 1
    """Sequences per micro-batch."""
    schedule: str = "1f1b"
    """``gpipe``, ``1f1b``, ``interleaved`` (needs ``interleave`` > 1) or ``deepspeed``
    (DeepSpeed's pipeline engine: blocking paired sends, lock-step neighbours)."""
    interleave: int = 1
    """Model chunks per pipeline rank (v of the interleaved schedule)."""
    recompute: str = "none"
    """``none``, ``selective`` (attention core) or ``full`` (every layer's forward)."""
    sequence_parallel: bool = False
    """Norms and dropouts sharded over tp; all-reduces become reduce-scatter + all-gather."""
    dp_overlap: bool = False
    """Gradient buckets reduced during the last backward (DDP); off: after it (Megatron-LM 2021)."""
    bucket_mb: float = 25.0
    """Gradient bucket size, MB."""
    fsdp_prefetch: bool = True
    """ZeRO-3: gather the next layer while this one computes."""
    ffn_hidden: int = 0
    """MLP width; 0 = 4 x hidden."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 = one per attention head."""
    gated_mlp: bool = False
    """A gated MLP (SwiGLU: three matrices, the first ``2 x ffn_hidden`` wide)."""
    topology: str = "rail"
    """Between nodes: ``rail`` (full bisection) or ``fat-tree`` (with ``oversubscription``)."""
    oversubscription: float = 1.0
    """Fat-tree: inter-node bandwidth divided by this."""
    backend: str = "nccl"
    """Collective library: ``nccl`` (ring reduce-scatter and all-gather, half an all-reduce's
    time) or ``gloo`` (torch's Gloo reduce-scatter takes an all-reduce's time: measured on the
    network lab, docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "micro_batch", "interleave"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage must be one of 0, 1, 2, 3; got {self.zero_stage}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(
                f"--recompute must be one of {', '.join(RECOMPUTE)}; got {self.recompute!r}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"--schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}"
            )
        if self.interleave > 1 and self.schedule == "deepspeed":
            raise ValueError(f"--interleave needs the 1f1b schedule, not {self.schedule}")
        if self.interleave > 1 and self.schedule == "1f1b":
            self.schedule = "interleaved"
        if self.schedule == "interleaved" and self.interleave < 2:
            raise ValueError("--schedule interleaved needs --interleave V >= 2")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"--backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}"
            )
        if self.topology not in TOPOLOGIES:
            raise ValueError(
                f"--topology must be one of {', '.join(TOPOLOGIES)}; got {self.topology!r}"
            )
        if (
            self.oversubscription < 1
            or self.bucket_mb <= 0
            or min(self.ffn_hidden, self.kv_heads) < 0
        ):
            raise ValueError(
                "--oversubscription must be >= 1, --bucket-mb > 0, --ffn-hidden and --kv-heads >= 0"
            )
