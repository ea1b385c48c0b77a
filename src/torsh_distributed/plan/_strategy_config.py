"""The strategy planner's inputs: a model, a cluster and a batch (:class:`StrategyConfig`).

Its own module so that both the cost formulas (:mod:`._cost`) and the search
(:mod:`.strategy`, which re-exports it) can import it; torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from torsh_distributed.plan.memory import DTYPES, OPTIMIZERS
from torsh_distributed.plan.profile import Profile

__all__ = ["DEVICE_PEAK_FLOPS", "StrategyConfig"]

DEVICE_PEAK_FLOPS = {"v100": 125e12, "a100": 312e12, "h100": 989e12, "h200": 989e12}
"""Dense 16-bit tensor-core peak per device (NVIDIA data sheets); ``cpu`` has none: measure it."""
_AC = ("auto", "none", "full")
_LAYOUTS = ("paper", "fsdp2")


@dataclass(kw_only=True, slots=True)
class StrategyConfig:
    """A model, a cluster and a batch to plan for. Errors name the CLI flag of the field."""

    params: float
    """Parameters of the model (all experts included)."""
    layers: int
    """Transformer layers (pp must divide them)."""
    hidden: int
    """Width of the residual stream."""
    heads: int
    """Attention heads (tp must divide them)."""
    devices: int
    """Accelerators in the job."""
    device_memory: float
    """Bytes of memory per device."""
    intra_bw: float
    """Bytes/s between two devices of a node (NVLink/NVSwitch), per device."""
    inter_bw: float
    """Bytes/s out of one node (all its NICs together); the node's devices share it."""
    nodes: int = 1
    """Nodes the devices are spread over, evenly."""
    intra_latency: float = 5e-6
    """Seconds per message inside a node (the alpha of the alpha-beta model)."""
    inter_latency: float = 1e-5
    """Seconds per message between nodes."""
    seq_len: int = 2048
    """Tokens per sequence."""
    vocab: int = 51200
    """Vocabulary size (logits width)."""
    global_batch: int = 0
    """Sequences per optimizer step; 0 = one per device."""
    dtype: str = "bf16"
    """``fp32``, or ``bf16``/``fp16`` mixed precision (fp32 master copy)."""
    optimizer: str = "adam"
    """``adam``, ``sgd`` (momentum) or ``sgd-plain``: optimizer-state bytes and the lr rule."""
    experts: int = 0
    """Experts per MoE layer (every layer, each ``4 * hidden`` wide); 0 = dense."""
    top_k: int = 1
    """Experts per token (MoE only)."""
    device: str = "a100"
    """Device kind for the default FLOP rate: v100, a100, h100, h200, or cpu (needs device_flops)."""
    device_flops: float = 0.0
    """Achieved FLOP/s per device; 0 = the kind's dense 16-bit peak times ``mfu``."""
    mfu: float = 0.5
    """Fraction of peak achieved when ``device_flops`` is 0 (Megatron-LM 2021 reports 0.44-0.52)."""
    activation_checkpointing: str = "auto"
    """``auto`` (recompute only where it is needed to fit), ``none`` or ``full``."""
    layout: str = "paper"
    """``paper``: the ZeRO paper's / DeepSpeed's accounting; ``fsdp2``: this package's
    DDP/FSDP2 (fp32 shards, bucket and gather transients, the optimizer's temporary)."""
    flash_attention: bool = True
    """Attention scores are not saved (flash / memory-efficient attention)."""
    dropout: bool = False
    """Dropout masks are saved (1 byte per element)."""
    reserve: float = 1e9
    """Bytes per device not available to the model (CUDA context, communication buffers)."""
    max_micro_batch: int = 64
    """Largest micro-batch (sequences) considered."""
    tp: int = 0
    """Pin the tensor-parallel degree (0 = search)."""
    pp: int = 0
    """Pin the pipeline-parallel degree (0 = search; 1 = no pipeline, e.g. a system without it)."""
    ep: int = 0
    """Pin the expert-parallel degree (0 = search)."""
    stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages considered."""
    uneven_stages: bool = False
    """Search pipeline degrees that do not divide the layers (the busiest stage holds
    ``ceil(layers / pp)``; Megatron-DeepSpeed and Llama 3's pipeline allow it, Megatron-LM 2021
    did not); off: pp divides the layers."""
    pp_scatter_gather: bool = False
    """Pipeline sends split over the tp ranks and gathered over the intra-node link
    (Narayanan et al. 2021, section 4.1): a ``tp`` times smaller inter-node message."""
    ref_batch: int = 0
    """Global batch the reference lr was tuned at; 0 = the global batch (no scaling)."""
    ref_lr: float | None = None
    """The reference lr, to report the scaled one."""
    ref_warmup_steps: int = 0
    """Warm-up steps of the reference run (kept constant in samples)."""
    profile: Profile | None = None
    """Measured block, optimizer and collective times of this model on the target machine
    (profile-guided mode, see :mod:`.profile`); ``None`` = the analytic model throughout. Terms
    the profile does not cover keep the analytic formula."""

    def __post_init__(self) -> None:
        if self.params <= 0:
            raise ValueError(f"--params must be > 0, got {self.params}")
        for name in (
            "layers",
            "hidden",
            "heads",
            "devices",
            "nodes",
            "seq_len",
            "vocab",
            "max_micro_batch",
            "top_k",
        ):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        for name in ("device_memory", "intra_bw", "inter_bw"):
            if getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be > 0, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"--heads ({self.heads}) must divide --hidden ({self.hidden})")
        if self.devices % self.nodes:
            raise ValueError(
                f"--devices ({self.devices}) must be a multiple of --nodes ({self.nodes})"
            )
        if self.global_batch < 0 or self.ref_batch < 0:
            raise ValueError("--global-batch and --ref-batch must be >= 0")
        if self.global_batch == 0:
            self.global_batch = self.devices
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}"
            )
        if self.experts < 0 or (self.experts and self.top_k > self.experts):
            raise ValueError(
                f"--experts must be >= 0 and >= --top-k; got {self.experts} (top-k {self.top_k})"
            )
        if self.device not in (*DEVICE_PEAK_FLOPS, "cpu"):
            kinds = ", ".join((*DEVICE_PEAK_FLOPS, "cpu"))
            raise ValueError(f"--device must be one of {kinds}; got {self.device!r}")
        if self.device_flops < 0 or not 0 < self.mfu <= 1:
            raise ValueError("--device-flops must be >= 0 and --mfu in (0, 1]")
        if not self.device_flops:
            if self.device == "cpu":
                raise ValueError("--device cpu has no known peak: give --device-flops (measured)")
            self.device_flops = DEVICE_PEAK_FLOPS[self.device] * self.mfu
        if self.activation_checkpointing not in _AC:
            raise ValueError(
                f"--activation-checkpointing must be one of {', '.join(_AC)}; "
                f"got {self.activation_checkpointing!r}"
            )
        if self.layout not in _LAYOUTS:
            raise ValueError(f"--layout must be one of {', '.join(_LAYOUTS)}; got {self.layout!r}")
        if self.reserve < 0 or self.intra_latency < 0 or self.inter_latency < 0:
            raise ValueError("--reserve, --intra-latency and --inter-latency must be >= 0")
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0 (0 = search), got {getattr(self, name)}")
        if not self.stages or any(st not in (0, 1, 2, 3) for st in self.stages):
            raise ValueError(f"--stages must lie in 0..3; got {self.stages}")
        if self.experts and 8.0 * self.hidden**2 * self.layers * self.experts >= self.params:
            raise ValueError(
                "--params must exceed the experts' parameters (layers x experts x 8 hidden^2)"
            )
        if self.profile is not None:
            if isinstance(self.profile, dict):
                self.profile = Profile.from_dict(self.profile)
            prof = self.profile
            if (prof.hidden, prof.seq_len) != (self.hidden, self.seq_len):
                raise ValueError(
                    f"--profile was measured at hidden {prof.hidden}, seq-len {prof.seq_len}; "
                    f"this plan has --hidden {self.hidden}, --seq-len {self.seq_len}"
                )

    @property
    def devices_per_node(self) -> int:
        return self.devices // self.nodes
