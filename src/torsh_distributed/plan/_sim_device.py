"""The simulator's device model: seconds of one GEMM, one attention core, one element-wise kernel.

Roofline with shape-dependent efficiency, torch-free:

* a GEMM ``(m x k) @ (k x n)`` takes ``max(2 m n k / (peak * gemm_eff * q), bytes / (hbm *
  mem_eff))``, where ``q`` is the tile and wave quantisation of the output (NVIDIA's "Matrix
  Multiplication Background" guide): the output is cut into tiles that fill the streaming
  multiprocessors in waves; a partial tile or a partial last wave wastes its share. cuBLAS picks
  among several tile shapes; we take the better of 256x128 and 128x128. So small and oddly shaped
  matrices (small hidden, large tp) run below ``gemm_eff``, large ones at it;
* an element-wise kernel (layer norm, GELU, dropout, residual, softmax) moves its bytes at
  ``hbm * mem_eff``;
* flash attention (fused, no score matrix in memory) runs at ``attn_eff`` of peak: FlashAttention-2
  (Dao, 2023) reports 50-73 % of A100 peak forward and less backward; no validation row uses it.

A measured device (``torsh-dist plan profile``, :mod:`torsh_distributed.plan.device_profile`:
a CPU) replaces the roofline by what was timed on it: the seconds of every GEMM shape the
simulator asks for (``measured``), the element-wise bandwidth, the fused attention's rate and its
backward-to-forward ratio, and the optimizer step per parameter; no tile quantisation.

For the accelerators, ``peak_flops``, ``hbm_bw`` and ``sms`` are data-sheet numbers. ``gemm_eff`` and ``mem_eff`` are
the free parameters: fitted on two published runs (:data:`CALIBRATED`), held for
every other prediction. ``attn_eff`` is taken from the FlashAttention-2 paper, not fitted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

__all__ = ["CALIBRATED", "DEVICES", "DeviceModel", "device_model", "gemm_key"]

_TILES = ((256, 128), (128, 128))

CALIBRATED: dict[str, float] = {"gemm_eff": 0.619, "mem_eff": 0.919}
"""``_sim_published.calibrate()`` on its ``CALIBRATION`` rows (Megatron-LM 1.7B and 145.6B),
rounded to 3 digits; tests/unit/test_plan_simulate.py checks those rows are reproduced."""


@dataclass(frozen=True, slots=True)
class DeviceModel:
    """Rates of one accelerator, and the fractions of them kernels reach."""

    name: str
    peak_flops: float
    """Dense 16-bit tensor-core FLOP/s (data sheet)."""
    hbm_bw: float
    """Memory bandwidth, bytes/s (data sheet)."""
    sms: int
    """Streaming multiprocessors: the width of one wave of GEMM tiles."""
    gemm_eff: float = 0.80
    """Fraction of peak a large, well-shaped GEMM reaches (fitted)."""
    mem_eff: float = 0.70
    """Fraction of ``hbm_bw`` an element-wise kernel reaches (fitted)."""
    attn_eff: float = 0.55
    """Fraction of peak of a fused (flash) attention kernel (FlashAttention-2 paper, not fitted)."""
    flash_backward: float = 2.5
    """Seconds of the fused attention's backward over its forward (FlashAttention-2: 2.5)."""
    quantise: bool = True
    """Tile and wave quantisation of GEMMs (GPUs); off for a measured device."""
    streams: bool = True
    """Collectives can run beside the kernels (GPU streams). Off (a CPU): FSDP2 issues its
    parameter all-gathers and gradient reduce-scatters on the "current stream", which on a CPU
    is the training thread itself, so they block it (DDP's bucket all-reduces still run on the
    backend's threads, overlapped)."""
    measured: Mapping[str, float] = field(default_factory=dict)
    """Measured seconds of GEMMs by :func:`gemm_key`; a shape not in it uses the roofline."""
    fsdp_forward_s: float = 0.0
    """Without streams: FSDP2's own seconds per unit in a forward beyond the unit's compute and
    its all-gather's bytes (copies in and out, DTensor dispatch, hooks, waiting for the peer at
    each blocking collective), measured at world size >= 2 (``device_profile``); 0 = none."""
    fsdp_backward_s: float = 0.0
    """The same for a unit's backward (its second all-gather and its reduce-scatter's bytes
    excluded)."""
    fsdp_optimizer_s: float = 0.0
    """The optimizer step on one unit's DTensor shards beyond a plain step of as many
    parameters, once per step."""
    optimizer_per_param: float = 0.0
    """Measured seconds of the optimizer step (gradient clipping included) per local parameter;
    0 = memory-bound, its bytes at the element-wise rate."""
    source: str = "data sheet"
    """Where the rates come from."""

    def gemm(
        self, m: float, n: float, k: float, *, batch: float = 1.0, dtype_bytes: int = 2
    ) -> float:
        """Seconds of ``batch`` GEMMs ``(m x k) @ (k x n)``."""
        if min(m, n, k, batch) <= 0:
            return 0.0
        seconds = self.measured.get(gemm_key(m, n, k, batch, dtype_bytes))
        if seconds is not None:
            return seconds
        flops = 2.0 * m * n * k * batch
        q = 1.0
        if self.quantise:
            q = max(_quantisation(m, n, batch, self.sms, tile) for tile in _TILES)
        compute = flops / (self.peak_flops * self.gemm_eff * q)
        memory = dtype_bytes * batch * (m * k + k * n + m * n) / (self.hbm_bw * self.mem_eff)
        return max(compute, memory)

    def elementwise(self, nbytes: float) -> float:
        """Seconds of memory-bound kernels moving ``nbytes`` (reads plus writes)."""
        return nbytes / (self.hbm_bw * self.mem_eff)

    def flash(self, flops: float) -> float:
        """Seconds of a fused attention kernel doing ``flops``."""
        return flops / (self.peak_flops * self.attn_eff)

    def optimizer(self, params: float, nbytes: float) -> float:
        """Seconds of the optimizer step on ``params`` local parameters moving ``nbytes``."""
        if self.optimizer_per_param > 0:
            return params * self.optimizer_per_param
        return self.elementwise(nbytes)


def gemm_key(m: float, n: float, k: float, batch: float = 1.0, dtype_bytes: int = 2) -> str:
    """The key of one GEMM shape in :attr:`DeviceModel.measured`."""
    return f"{m:g}x{n:g}x{k:g}x{batch:g}:{dtype_bytes}"


def _quantisation(m: float, n: float, batch: float, sms: int, tile: tuple[int, int]) -> float:
    """Useful fraction of the tiles' work: partial tiles and a partial last wave are wasted."""
    tm, tn = tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn) * math.ceil(batch)
    waves = math.ceil(tiles / sms)
    return (m * n * batch) / (waves * sms * tm * tn)


DEVICES: dict[str, DeviceModel] = {
    # NVIDIA data sheets: V100 SXM2 (125 TFLOP/s fp16, 900 GB/s, 80 SMs); A100 SXM4 80GB
    # (312 TFLOP/s bf16 dense, 2039 GB/s, 108 SMs); H100 SXM5 (989 TFLOP/s bf16 dense, 3.35 TB/s,
    # 132 SMs); H200 (H100's compute, 4.8 TB/s).
    "v100": DeviceModel(name="v100", peak_flops=125e12, hbm_bw=900e9, sms=80),
    "a100": DeviceModel(name="a100", peak_flops=312e12, hbm_bw=2039e9, sms=108),
    "h100": DeviceModel(name="h100", peak_flops=989e12, hbm_bw=3350e9, sms=132),
    "h200": DeviceModel(name="h200", peak_flops=989e12, hbm_bw=4800e9, sms=132),
}
"""Data-sheet rates; ``gemm_eff``/``mem_eff`` are replaced by the calibrated values in
:func:`device_model`."""


def device_model(
    kind: str, *, gemm_eff: float | None = None, mem_eff: float | None = None
) -> DeviceModel:
    """The model of ``kind`` with the calibrated efficiencies (or the ones given).

    The efficiencies were fitted on A100 runs; other kinds use them as fractions of their own
    peak and bandwidth (an assumption the validation table's non-A100 rows would test).
    """
    if kind not in DEVICES:
        kinds = ", ".join(DEVICES)
        raise ValueError(
            f"--device {kind!r} has no simulator device model (one of {kinds}); for a CPU, "
            "measure one with `torsh-dist plan profile` and pass it as --device-profile FILE"
        )
    return replace(
        DEVICES[kind],
        gemm_eff=CALIBRATED["gemm_eff"] if gemm_eff is None else gemm_eff,
        mem_eff=CALIBRATED["mem_eff"] if mem_eff is None else mem_eff,
    )
