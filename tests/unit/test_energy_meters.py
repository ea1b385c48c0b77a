"""Energy meters: RAPL against a fake powercap tree written in the kernel's format (normal,
wrap-around, missing DRAM, permission denied), NVML's arithmetic through a fake of the two
pynvml calls, the CPU-time estimate, and the ``auto`` choice with its reason."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from torsh_distributed.energy import (
    CpuTimeEstimate,
    MeterUnavailableError,
    NvmlMeter,
    RaplMeter,
    open_meter,
)

# A package's counter wraps after max_energy_range_uj; this is a common Intel value.
PKG_RANGE = 262143328850
DRAM_RANGE = 65712999613


def _zone(root: Path, name: str, label: str, energy_uj: int, max_uj: int) -> Path:
    """One zone as the kernel lays it out: decimal values with a trailing newline."""
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "name").write_text(f"{label}\n")
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_uj}\n")
    (zone / "enabled").write_text("1\n")
    return zone


def _set(zone: Path, energy_uj: int) -> None:
    (zone / "energy_uj").write_text(f"{energy_uj}\n")


def _tree(root: Path, *, dram: bool = True) -> dict[str, Path]:
    zones = {
        "pkg0": _zone(root, "intel-rapl:0", "package-0", 1_000_000, PKG_RANGE),
        "core0": _zone(root, "intel-rapl:0:0", "core", 500_000, PKG_RANGE),
        "pkg1": _zone(root, "intel-rapl:1", "package-1", 7_000_000, PKG_RANGE),
        "psys": _zone(root, "intel-rapl:2", "psys", 0, PKG_RANGE),
    }
    if dram:
        zones["dram0"] = _zone(root, "intel-rapl:0:1", "dram", 2_000_000, DRAM_RANGE)
    return zones


def test_rapl_sums_packages_and_dram_not_core_or_psys(tmp_path: Path):
    zones = _tree(tmp_path)
    meter = RaplMeter(tmp_path)
    assert meter.read() == 0.0
    assert [z.name for z in meter.zones] == ["package-0", "dram", "package-1"]
    _set(zones["pkg0"], 1_000_000 + 3_000_000)  # +3 J
    _set(zones["pkg1"], 7_000_000 + 1_500_000)  # +1.5 J
    _set(zones["dram0"], 2_000_000 + 250_000)  # +0.25 J
    _set(zones["core0"], 99_000_000)  # inside package-0: not added again
    _set(zones["psys"], 99_000_000)  # the whole platform: would count twice
    assert meter.read() == pytest.approx(4.75, abs=1e-9)
    assert meter.source == "measured" and meter.scope == "host"
    assert "package-0, dram, package-1" in meter.detail


def test_rapl_unfolds_a_wrap_around(tmp_path: Path):
    zones = _tree(tmp_path, dram=False)
    _set(zones["pkg0"], PKG_RANGE - 1_000_000)  # 1 J before the wrap
    meter = RaplMeter(tmp_path)
    _set(zones["pkg0"], 2_000_000)  # wrapped: 1 J + 2 J
    assert meter.read() == pytest.approx(3.0, abs=1e-9)
    _set(zones["pkg0"], 2_500_000)
    assert meter.read() == pytest.approx(3.5, abs=1e-9)


def test_rapl_without_dram_says_so(tmp_path: Path):
    _tree(tmp_path, dram=False)
    meter = RaplMeter(tmp_path)
    assert [z.name for z in meter.zones] == ["package-0", "package-1"]
    assert "no DRAM domain on this host: packages only" in meter.detail


def test_rapl_unavailable_with_a_reason(tmp_path: Path):
    with pytest.raises(MeterUnavailableError, match="does not exist .no powercap interface"):
        RaplMeter(tmp_path / "missing")
    with pytest.raises(MeterUnavailableError, match="no intel-rapl:\\* zone under"):
        RaplMeter(tmp_path)
    _zone(tmp_path, "intel-rapl:0:0", "dram", 0, DRAM_RANGE)
    with pytest.raises(MeterUnavailableError, match="no package zone under"):
        RaplMeter(tmp_path)


def test_rapl_permission_denied_names_the_file_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    zones = _tree(tmp_path)
    denied = zones["pkg0"] / "energy_uj"
    denied.chmod(0)  # as the kernel's 0400 root:root looks to a user
    if os.geteuid() == 0:  # root reads whatever the mode: the kernel's refusal, at the read
        real = Path.read_text

        def read_text(self: Path, *args: object, **kwargs: object) -> str:
            if self == denied:
                raise PermissionError(13, "Permission denied", str(self))
            return real(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(Path, "read_text", read_text)
    with pytest.raises(MeterUnavailableError, match=r"permission denied reading .*intel-rapl:0/energy_uj \(root-only since Linux 5.10"):
        RaplMeter(tmp_path)


class FakePynvml:
    """A fake of the library boundary only: the pynvml calls NvmlMeter makes, with a settable
    counter in millijoules since driver load."""

    def __init__(self, start_mj: int) -> None:
        self.mj = start_mj
        self.asked: list[int] = []

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:  # noqa: N802 - pynvml's name
        self.asked.append(index)
        if index > 3:
            raise RuntimeError("NVMLError_InvalidArgument")
        return f"handle{index}"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:  # noqa: N802
        assert handle.startswith("handle")
        return self.mj


def test_nvml_reads_millijoules_since_it_opened(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakePynvml(start_mj=123_456_789)
    meter = NvmlMeter(0, nvml=fake)
    assert meter.read() == 0.0
    fake.mj += 2_500  # 2.5 J
    assert meter.read() == pytest.approx(2.5)
    fake.mj += 1_000_000
    assert meter.read() == pytest.approx(1002.5)
    assert meter.source == "measured" and meter.scope == "gpu" and "GPU 0" in meter.detail


def test_nvml_reads_the_gpu_cuda_visible_devices_names(monkeypatch: pytest.MonkeyPatch):
    fake = FakePynvml(0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    NvmlMeter(1, nvml=fake)  # torch's cuda:1 is the host's GPU 3
    assert fake.asked == [3]


def test_nvml_unavailable_with_a_reason(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(MeterUnavailableError, match="NVML energy counter of GPU 5: NVMLError_InvalidArgument"):
        NvmlMeter(5, nvml=FakePynvml(0))
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    with pytest.raises(MeterUnavailableError, match=r"nvidia-ml-py is not installed \(pip install 'torsh-distributed\[energy\]'\)"):
        NvmlMeter(0)


def test_estimate_is_cpu_seconds_times_the_power_model():
    clock = iter([10.0, 10.0, 12.5, 20.0])
    meter = CpuTimeEstimate(watts_per_core=6.0, cpu_seconds=lambda: next(clock))
    assert meter.read() == 0.0
    assert meter.read() == pytest.approx(15.0)
    assert meter.read() == pytest.approx(60.0)
    assert meter.source == "estimated" and meter.scope == "process"
    with pytest.raises(ValueError, match="watts_per_core must be > 0"):
        CpuTimeEstimate(watts_per_core=0)


def test_estimate_follows_this_process_cpu_time():
    meter = CpuTimeEstimate()
    start = time.process_time()
    while time.process_time() - start < 0.05:  # real work, measured
        sum(range(1000))
    burnt = time.process_time() - start
    assert meter.read() == pytest.approx(burnt * 4.0, rel=0.2)


def test_auto_prefers_nvml_then_rapl_then_the_estimate(tmp_path: Path):
    _tree(tmp_path)
    meter, why = open_meter("auto", device_type="cpu", powercap_root=str(tmp_path))
    assert meter.name == "rapl" and "nvml: this rank computes on the CPU" in why
    meter, why = open_meter("auto", powercap_root=str(tmp_path / "none"))
    assert meter.name == "estimate" and meter.source == "estimated"
    assert "no hardware counter" in why and "rapl: " in why and "does not exist" in why
    with pytest.raises(MeterUnavailableError, match="does not exist"):
        open_meter("rapl", powercap_root=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="energy.meter must be one of"):
        open_meter("off")


def test_nvml_installed_without_a_driver_says_so():
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py not installed")
    try:
        pynvml.nvmlInit()
    except Exception:
        pass
    else:
        pytest.skip("NVML starts here: a driver is present")
    with pytest.raises(MeterUnavailableError, match="NVML cannot start: "):
        NvmlMeter(0)
