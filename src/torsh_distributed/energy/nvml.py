"""GPU energy from NVML's total-energy counter (``nvidia-ml-py``, imported lazily).

``nvmlDeviceGetTotalEnergyConsumption`` gives millijoules since the driver was loaded (Volta and
newer); the meter subtracts its first reading. Install with ``pip install
'torsh-distributed[energy]'``; without the package, a driver or a GPU the meter is unavailable and
says why.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from torsh_distributed.energy.meters import MeterUnavailableError

__all__ = ["NvmlMeter"]


def _load_pynvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise MeterUnavailableError(
            "nvidia-ml-py is not installed (pip install 'torsh-distributed[energy]')"
        ) from None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        raise MeterUnavailableError(f"NVML cannot start: {exc}") from None
    return pynvml


class NvmlMeter:
    """Energy of one GPU since the meter opened.

    Args:
        index: The CUDA device index as torch numbers it; translated through
            ``CUDA_VISIBLE_DEVICES`` (indices or ``GPU-...`` UUIDs) to NVML's device, which
            numbers every GPU of the host.
        nvml: The ``pynvml`` module, or in tests an object with the functions used here
            (``nvmlDeviceGetHandleByIndex`` or ``...ByUUID``,
            ``nvmlDeviceGetTotalEnergyConsumption``); ``None`` imports and initialises ``pynvml``.
    """

    name = "nvml"
    source = "measured"
    scope = "gpu"

    def __init__(self, index: int = 0, *, nvml: Any = None) -> None:
        if nvml is None:
            nvml = _load_pynvml()
        self.nvml = nvml
        """The ``pynvml`` module in use (the power-limit control shares it)."""
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        target: int | str = index
        if visible and index < len(visible):
            target = int(visible[index]) if visible[index].isdigit() else visible[index]
        try:
            if isinstance(target, str):
                self.handle = nvml.nvmlDeviceGetHandleByUUID(target)
            else:
                self.handle = nvml.nvmlDeviceGetHandleByIndex(target)
            self._start_mj = int(nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except Exception as exc:  # NVMLError_NotSupported on pre-Volta GPUs, invalid index
            raise MeterUnavailableError(f"NVML energy counter of GPU {target}: {exc}") from None
        uuid = ""
        if hasattr(nvml, "nvmlDeviceGetUUID"):
            try:
                uuid = str(nvml.nvmlDeviceGetUUID(self.handle))
            except Exception:
                uuid = ""
        self.scope_key = uuid or f"{socket.gethostname()}:gpu{index}"
        self.detail = f"NVML total energy of GPU {target}" + (f" ({uuid})" if uuid else "")

    def read(self) -> float:
        """Joules of this GPU since the meter opened (the counter is 64-bit: no wrap in practice)."""
        now = int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        return (now - self._start_mj) * 1e-3
