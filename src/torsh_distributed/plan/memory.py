"""Memory planner: model-state bytes per rank by the ZeRO paper's formulas, plus activations.

Model states are parameters, gradients and optimizer state. With ``Ψ`` parameters, ``N``
data-parallel ranks, ``p`` bytes per working parameter, ``g`` bytes per gradient and ``K`` bytes
of optimizer state per parameter, the ZeRO paper (Rajbhandari et al., 2020, §5) gives per rank:

=====  =============================  ==========================
stage  what is sharded                bytes per rank
=====  =============================  ==========================
0      nothing (DDP)                  (p + g + K)·Ψ
1      optimizer state                (p + g)·Ψ + K·Ψ/N
2      + gradients                    p·Ψ + (g + K)·Ψ/N
3      + parameters                   (p + g + K)·Ψ/N
=====  =============================  ==========================

Per-parameter bytes (:func:`bytes_per_param`):

* mixed precision (``bf16``/``fp16``) Adam: p = g = 2, K = 12 (fp32 master copy, momentum,
  variance) — the paper's case; 7.5 B parameters on 64 ranks gives 120 / 31.4 / 16.6 / 1.9 GB.
* fp32 Adam: p = g = 4, K = 8 (momentum, variance; the parameters are their own master copy).
* SGD with momentum: K = 4 in fp32 (momentum), 8 mixed (master + momentum).

``layout="fsdp2"`` gives what this package's implementation holds between steps instead of the
paper's idealisation (see docs/sharding.md): FSDP2 keeps the *sharded* parameter in its original
fp32 dtype (it is the master copy), so for stages 2 and 3 the sharded parameter and gradient are
4 bytes each and K counts only the optimizer's moments; stage 2's unsharded working parameters
exist only between forward and backward and are reported by :func:`transient_bytes`. For fp32
training both layouts agree for stages 0, 1 and 3.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

__all__ = [
    "DTYPES",
    "OPTIMIZERS",
    "OFFLOADS",
    "LAYOUTS",
    "ModelStateBytes",
    "MemoryPlan",
    "bytes_per_param",
    "model_state_bytes",
    "plan_memory",
    "transient_bytes",
    "activation_bytes",
    "parse_stages",
    "format_bytes",
]

DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "sgd", "sgd-plain")
_STATE_BYTES = {"adam": 8, "sgd": 4, "sgd-plain": 0}
OFFLOADS = ("none", "cpu")
LAYOUTS = ("paper", "fsdp2")
Layout = Literal["paper", "fsdp2"]


@dataclass(frozen=True, slots=True)
class ModelStateBytes:
    """Bytes of model states on one rank."""

    params: int
    """Parameters held."""
    grads: int
    """Gradients held."""
    optimizer: int
    """Optimizer state held (for mixed precision this includes the fp32 master copy)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """One stage's plan: bytes on the device and (with offload) on the host, per rank."""

    stage: int
    """ZeRO stage 0-3."""
    device: ModelStateBytes
    """Model states on the accelerator (on a CPU-only run, simply in process memory)."""
    host: ModelStateBytes
    """Model states offloaded to host memory (all zero without offload)."""

    def to_dict(self) -> dict[str, object]:
        return {
            "stage": self.stage,
            "model_state_bytes_per_rank": self.device.to_dict(),
            "host_bytes_per_rank": self.host.to_dict(),
        }


def _check(num_params: float, dp: int, stage: int, dtype: str, optimizer: str) -> None:
    if num_params <= 0:
        raise ValueError(f"params must be > 0, got {num_params}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be one of 0, 1, 2, 3; got {stage}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")


def bytes_per_param(
    dtype: str = "bf16", optimizer: str = "adam", *, layout: Layout = "paper", stage: int = 0
) -> tuple[int, int, int]:
    """``(p, g, K)``: bytes per parameter of parameters, gradients and optimizer state.

    Args:
        dtype: ``fp32``, or ``bf16``/``fp16`` for mixed precision with an fp32 master copy.
        optimizer: ``adam`` (two moments), ``sgd`` (with momentum: one) or ``sgd-plain`` (no
            momentum: no state).
        layout: ``paper`` (the ZeRO paper's accounting) or ``fsdp2`` (what FSDP2 stores for
            stages 2 and 3: fp32 sharded parameters and gradients, the master copy is the
            parameter itself). Stages 0 and 1 are DDP-based and always fp32 here.
        stage: Only matters for ``layout="fsdp2"``.
    """
    moments = _STATE_BYTES[optimizer]
    if layout == "fsdp2" and (stage >= 2 or dtype == "fp32"):
        return 4, 4, moments
    if dtype == "fp32":
        return 4, 4, moments
    return 2, 2, 4 + moments


def model_state_bytes(
    num_params: float,
    dp: int,
    stage: int,
    *,
    dtype: str = "bf16",
    optimizer: str = "adam",
    layout: Layout = "paper",
) -> ModelStateBytes:
    """Model-state bytes per rank for ZeRO ``stage`` on ``dp`` data-parallel ranks.

    Shards are ``Ψ/N`` exactly (fractional bytes rounded to the nearest byte); real shards of
    tensors whose first dimension does not divide by ``N`` are padded, which the measurement
    (:mod:`torsh_distributed.parallel.memory`) reports separately.
    """
    _check(num_params, dp, stage, dtype, optimizer)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    p, g, k = bytes_per_param(dtype, optimizer, layout=layout, stage=stage)
    psi = float(num_params)
    shard = psi / dp
    params = p * psi
    grads = g * psi
    opt = k * psi
    if stage >= 1:
        opt = k * shard
    if stage >= 2:
        grads = g * shard
        if layout == "fsdp2":  # FSDP2 reshards after backward: params sharded between steps
            params = p * shard
    if stage >= 3:
        params = p * shard
    return ModelStateBytes(params=round(params), grads=round(grads), optimizer=round(opt))


def plan_memory(
    num_params: float,
    dp: int,
    stage: int,
    *,
    dtype: str = "bf16",
    optimizer: str = "adam",
    offload: str = "none",
    layout: Layout = "paper",
) -> MemoryPlan:
    """Model states per rank, split into device and host bytes.

    ``offload="cpu"`` follows torch's ``CPUOffloadPolicy``: the *sharded* parameters, gradients
    and optimizer state live in host memory (the optimizer steps on the CPU); only transient
    unsharded parameters reach the device. It needs stage 2 or 3.
    """
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}; got {offload!r}")
    if offload != "none" and stage < 2:
        raise ValueError(
            f"offload={offload!r} needs stage 2 or 3: torch's CPUOffloadPolicy belongs to FSDP2"
        )
    states = model_state_bytes(
        num_params, dp, stage, dtype=dtype, optimizer=optimizer, layout=layout
    )
    zero = ModelStateBytes(params=0, grads=0, optimizer=0)
    if offload == "none":
        return MemoryPlan(stage=stage, device=states, host=zero)
    p, _, _ = bytes_per_param(dtype, optimizer, layout=layout, stage=stage)
    # stage 2 (paper layout) keeps the replicated working parameters on the device
    device_params = round(p * float(num_params)) if stage == 2 and layout == "paper" else 0
    host_params = states.params - device_params
    return MemoryPlan(
        stage=stage,
        device=ModelStateBytes(params=device_params, grads=0, optimizer=0),
        host=ModelStateBytes(params=host_params, grads=states.grads, optimizer=states.optimizer),
    )


def transient_bytes(
    stage: int,
    *,
    num_params: float,
    unit_params: list[int],
    root_params: int,
    dtype: str = "fp32",
) -> int:
    """Largest transient buffer of the step that belongs to model states, per rank.

    * stages 0 and 1 (DDP): the gradient buckets, one fp32 copy of all gradients
      (DDP copies ``param.grad`` into flat buckets for the all-reduce).
    * stage 2 (FSDP2, no reshard after forward): every unsharded parameter, from the end of
      forward until each unit's backward.
    * stage 3: the root's unsharded parameters plus the two largest units (the running one and
      the one prefetched).

    Args:
        stage: ZeRO stage.
        num_params: All parameters (Ψ).
        unit_params: Parameters of each FSDP unit below the root (e.g. each block).
        root_params: Parameters that belong to the root unit.
        dtype: Working dtype of unsharded parameters (``bf16`` halves them).
    """
    work = 4 if dtype == "fp32" else 2
    if stage <= 1:
        return round(4 * float(num_params))
    if stage == 2:
        return round(work * float(num_params))
    largest = sorted(unit_params, reverse=True)[:2]
    return work * (root_params + sum(largest))


def activation_bytes(
    *,
    n_layer: int,
    d_model: int,
    n_head: int,
    seq_len: int,
    batch: int,
    vocab_size: int = 256,
    checkpointed_layers: int = 0,
    dtype_bytes: int = 4,
) -> int:
    """Bytes saved for backward by one forward of the built-in GPT on one rank.

    Counted from the tensors autograd saves for this model on torch's CPU kernels (verified by
    tests/unit/test_memory_plan.py with saved-tensor hooks), per token of the micro-batch:

    * each block: ``16·d + n_head + 4`` elements (layer-norm inputs and statistics, the inputs of
      the four linear layers, the attention's q, k, v, output and log-sum-exp, the GELU input);
    * a checkpointed block keeps only its input (``d``) during forward and recomputes one block's
      worth during backward (added once);
    * outside the blocks: final layer-norm input and output (``2·d``), logits (``vocab``), and
      statistics (4), plus the int64 token and position ids.

    Args:
        n_layer: Transformer blocks.
        d_model: Width.
        n_head: Attention heads.
        seq_len: Tokens per sequence.
        batch: Sequences per rank per step.
        vocab_size: Vocabulary (logits width).
        checkpointed_layers: Blocks under activation checkpointing.
        dtype_bytes: 4 for fp32 activations; 2 approximates bf16 (statistics stay fp32).
    """
    if not 0 <= checkpointed_layers <= n_layer:
        raise ValueError(
            f"checkpointed_layers must be in [0, {n_layer}], got {checkpointed_layers}"
        )
    tokens = batch * seq_len
    per_block = 16 * d_model + n_head + 4
    plain = n_layer - checkpointed_layers
    elements = plain * per_block + checkpointed_layers * d_model
    if checkpointed_layers:
        elements += per_block  # one block recomputed at a time during backward
    elements += 2 * d_model + vocab_size + 4
    return dtype_bytes * tokens * elements + 8 * tokens + 8 * seq_len


def parse_stages(text: str) -> list[int]:
    """``"2"`` -> [2]; ``"0..3"`` or ``"0-3"`` -> [0, 1, 2, 3]; ``"1,3"`` -> [1, 3]."""
    stages: list[int] = []
    for part in text.split(","):
        part = part.strip()
        sep = ".." if ".." in part else ("-" if "-" in part else None)
        try:
            if sep:
                lo, hi = (int(x) for x in part.split(sep))
                stages.extend(range(lo, hi + 1))
            else:
                stages.append(int(part))
        except ValueError:
            raise ValueError(
                f"stage must be 0-3, a range like 0..3, or a list like 1,3; got {text!r}"
            ) from None
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise ValueError(f"stages must lie in 0..3; got {text!r}")
    return sorted(set(stages))


def format_bytes(num: float) -> str:
    """Decimal units with one decimal, as the ZeRO paper uses (1 GB = 1e9 bytes)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(num) >= scale:
            return f"{num / scale:.1f} {unit}"
    return f"{int(num)} B"
