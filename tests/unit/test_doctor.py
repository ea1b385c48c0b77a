"""``torsh-dist doctor`` on recorded machines: real ``nvidia-smi topo -m`` outputs from public
sources with sysfs trees built to match them (tests/data/topology/*/SOURCE.md says which parts
are transcribed and which constructed). Pure file reads, no GPU, no network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from torsh_distributed.cli.main import main
from torsh_distributed.runtime._nccl_env import exact_list
from torsh_distributed.runtime.topology import (
    TopoParseError,
    diagnose,
    format_env,
    format_report,
    parse_topo,
    read_topo,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "topology"
MACHINES = ("h100-sxm-8gpu-ndr", "a100-sxm-8gpu-dgx-layout", "rtx6000ada-pcie-4gpu-roce")

EXPECTED = {
    "h100-sxm-8gpu-ndr": {
        "NCCL_SOCKET_IFNAME": "eth0,eth1,eth2,eth3,eth4",
        "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_IB_HCA": ",".join(f"mlx5_ib{i}:1" for i in range(8)),
        "NCCL_IB_DISABLE": None,
        "rails": [(f"GPU{i}", f"mlx5_ib{i}", "PIX") for i in range(8)],
        "numa": [0, 0, 0, 0, 1, 1, 1, 1],
    },
    "a100-sxm-8gpu-dgx-layout": {
        "NCCL_SOCKET_IFNAME": "enp225s0f0,enp225s0f1",
        "GLOO_SOCKET_IFNAME": "enp225s0f0",
        "NCCL_IB_HCA": ",".join(f"mlx5_{i}:1" for i in range(8)),  # not the storage pair 8/9
        "NCCL_IB_DISABLE": None,
        "rails": [(f"GPU{i}", f"mlx5_{i}", "PXB") for i in range(8)],
        "numa": [3, 3, 1, 1, 7, 7, 5, 5],
    },
    "rtx6000ada-pcie-4gpu-roce": {
        "NCCL_SOCKET_IFNAME": "enp130s0f0",
        "GLOO_SOCKET_IFNAME": "enp130s0f0",
        "NCCL_IB_HCA": None,  # every RoCE port is down
        "NCCL_IB_DISABLE": "1",
        "rails": [(f"GPU{i}", f"mlx5_{i}", "NODE") for i in range(4)],
        "numa": [0, 0, 1, 1],
    },
}


def _report(machine: str, root: Path | None = None, **kwargs):
    topo = read_topo(DATA / machine / "topo.txt")
    return diagnose(sysfs_root=root or DATA / machine / "root", topo=topo, environ={}, **kwargs)


@pytest.mark.parametrize("machine", MACHINES)
def test_recorded_machine_gets_the_expected_nccl_settings(machine: str):
    report = _report(machine)
    expected = EXPECTED[machine]
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE"):
        setting = report.setting(name)
        assert setting.value == expected[name], (name, setting)
        assert setting.reason and "\n" not in setting.reason
    assert [(p.gpu, p.nic, p.link) for p in report.placements] == expected["rails"]
    assert [p.numa_node for p in report.placements] == expected["numa"]
    assert [p.local_rank for p in report.placements] == list(range(len(expected["rails"])))


@pytest.mark.parametrize("machine", MACHINES)
def test_virtual_and_loopback_interfaces_are_never_chosen(machine: str):
    report = _report(machine)
    kinds = {i.name: i.kind for i in report.interfaces}
    assert kinds["lo"] == "loopback"
    assert kinds["docker0"] == kinds["veth3f2a1c0"] == "container"
    chosen = report.setting("NCCL_SOCKET_IFNAME").value.lstrip("=").split(",")
    assert all(kinds[name] == "physical" for name in chosen)
    assert "veth3f2a1c0 (container)" in report.setting("NCCL_SOCKET_IFNAME").reason


def test_parse_reads_the_legend_the_affinities_and_the_links():
    h100 = read_topo(DATA / "h100-sxm-8gpu-ndr" / "topo.txt")  # header without leading spaces
    assert h100.gpus == tuple(f"GPU{i}" for i in range(8))
    assert h100.nics[:2] == ("mlx5_ib0", "mlx5_ib1") and h100.nics[-1] == "mlx5_eth4"
    assert h100.gpu_links[("GPU0", "GPU7")] == "NV18"
    assert h100.nic_links[("GPU5", "mlx5_ib4")] == "PXB"
    assert h100.cpu_affinity["GPU4"] == "56-111,168-223" and h100.numa_node["GPU4"] == 1
    a100 = read_topo(DATA / "a100-sxm-8gpu-dgx-layout" / "topo.txt")  # tab-separated, no GPU NUMA ID
    assert a100.nic_links[("GPU0", "mlx5_8")] == "SYS" and a100.numa_node["GPU6"] == 5
    asus = read_topo(DATA / "rtx6000ada-pcie-4gpu-roce" / "topo.txt")
    assert asus.gpu_links[("GPU0", "GPU2")] == "SYS" and asus.gpu_links[("GPU2", "GPU3")] == "NODE"


def test_old_format_names_nic_columns_by_device_and_ansi_is_stripped():
    # Synthetic (not a recorded machine): the pre-legend layout, NIC columns named by device.
    text = (
        "\x1b[4m\tGPU0\tGPU1\tmlx5_0\tCPU Affinity\x1b[0m\n"
        "GPU0\t X \tNV1\tPHB\t0-7\n"
        "GPU1\tNV1\t X \tPHB\t0-7\n"
        "mlx5_0\tPHB\tPHB\t X \t\n"
    )
    topo = parse_topo(text)
    assert topo.nics == ("mlx5_0",) and topo.nic_links[("GPU1", "mlx5_0")] == "PHB"
    assert topo.cpu_affinity == {"GPU0": "0-7", "GPU1": "0-7"} and topo.numa_node == {}


def test_a_down_port_is_left_out_and_its_gpus_use_the_other_nic(tmp_path: Path):
    root = tmp_path / "root"
    shutil.copytree(DATA / "a100-sxm-8gpu-dgx-layout" / "root", root)
    (root / "sys/class/infiniband/mlx5_3/ports/1/state").write_text("1: DOWN\n")
    report = _report("a100-sxm-8gpu-dgx-layout", root)
    hcas = report.setting("NCCL_IB_HCA").value.split(",")
    assert "mlx5_3:1" not in hcas and len(hcas) == 7
    rails = {p.gpu: p.nic for p in report.placements}
    assert rails["GPU2"] == rails["GPU3"] == "mlx5_2"


def test_a_faster_virtual_interface_still_loses(tmp_path: Path):
    root = tmp_path / "root"
    shutil.copytree(DATA / "rtx6000ada-pcie-4gpu-roce" / "root", root)
    (root / "sys/class/net/veth3f2a1c0/speed").write_text("100000\n")
    (root / "sys/class/net/docker0/operstate").write_text("up\n")
    report = _report("rtx6000ada-pcie-4gpu-roce", root)
    assert report.setting("NCCL_SOCKET_IFNAME").value == "enp130s0f0"


def test_a_host_without_gpus_or_hcas_still_gets_a_gloo_interface(tmp_path: Path):
    for name, state, speed, device in (("lo", "unknown", "-1", False), ("eth0", "up", "-1", True)):
        net = tmp_path / "sys/class/net" / name
        net.mkdir(parents=True)
        (net / "operstate").write_text(state)
        (net / "speed").write_text(speed)
        if device:
            (net / "device").mkdir()
    report = diagnose(sysfs_root=tmp_path, topo=None, environ={}, topo_note="no GPUs found")
    assert report.gpus == () and report.placements == ()
    assert report.setting("GLOO_SOCKET_IFNAME").value == "eth0"
    assert report.setting("NCCL_IB_DISABLE").value == "1"
    assert "no InfiniBand/RoCE device" in report.setting("NCCL_IB_HCA").reason
    text = format_report(report)
    assert "GPUs: 0" in text and "no GPUs found" in text


def test_nothing_up_leaves_the_socket_settings_unset(tmp_path: Path):
    report = diagnose(sysfs_root=tmp_path, topo=None, environ={})
    assert report.setting("NCCL_SOCKET_IFNAME").value is None
    assert "no physical interface is up" in report.setting("NCCL_SOCKET_IFNAME").reason
    assert report.env() == {"NCCL_IB_DISABLE": "1"}


def test_exact_match_prefix_when_a_name_prefixes_another():
    every = [f"mlx5_{i}" for i in range(12)]
    assert exact_list(["mlx5_1:1", "mlx5_2:1"], every) == "=mlx5_1:1,mlx5_2:1"
    assert exact_list([f"mlx5_{i}:1" for i in range(8)], every[:10]) == ",".join(
        f"mlx5_{i}:1" for i in range(8))
    assert exact_list(["eth1"], ["eth1", "eth10"]) == "=eth1"


def test_the_report_shows_what_an_export_would_change():
    report = _report("h100-sxm-8gpu-ndr")
    report = diagnose(sysfs_root=DATA / "h100-sxm-8gpu-ndr" / "root",
                      topo=read_topo(DATA / "h100-sxm-8gpu-ndr" / "topo.txt"),
                      environ={"NCCL_IB_DISABLE": "1"})
    assert report.setting("NCCL_IB_DISABLE").current == "1"
    assert "NCCL_IB_DISABLE (leave unset)   [now '1']" in format_report(report)


@pytest.mark.parametrize(
    ("line", "old", "new", "message"),
    [
        (5, "NV12", "NVX", "unknown link 'NVX' in row GPU3"),
        (3, "\tNV12\t X ", "\tNV12\t", "row GPU1 has"),
        (4, "GPU2\t", "GPU9\t", "row 'GPU9' is not one of the header's columns"),
    ],
    ids=["bad-link", "short-row", "unknown-row"],
)
def test_a_malformed_topology_is_one_line_naming_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: int, old: str, new: str, message: str
):
    lines = (DATA / "a100-sxm-8gpu-dgx-layout" / "topo.txt").read_text().split("\n")
    assert old in lines[line - 1]
    lines[line - 1] = lines[line - 1].replace(old, new, 1)
    bad = tmp_path / "topo.txt"
    bad.write_text("\n".join(lines))
    with pytest.raises(TopoParseError, match=f"^{bad}:{line}: {message}"):
        read_topo(bad)
    code = main(["doctor", "--sysfs-root", str(tmp_path), "--topo", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"torsh-dist doctor: error: {bad}:{line}: {message}")


def test_a_file_that_is_not_a_topology_is_refused(tmp_path: Path):
    bad = tmp_path / "nvidia-smi.txt"
    bad.write_text("NVIDIA-SMI 575.51.03   Driver Version: 575.51.03\n")
    with pytest.raises(TopoParseError, match="no 'GPU0 ...' header line"):
        read_topo(bad)


def test_cli_env_prints_export_lines(capsys: pytest.CaptureFixture[str]):
    machine = DATA / "h100-sxm-8gpu-ndr"
    code = main(["doctor", "--sysfs-root", str(machine / "root"), "--topo", str(machine / "topo.txt"),
                 "--env"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    exports = {line.split("=", 1)[0].removeprefix("export "): line.split("=", 1)[1].split("  #")[0]
               for line in out if line.startswith("export ")}
    assert exports == {
        "NCCL_SOCKET_IFNAME": "eth0,eth1,eth2,eth3,eth4",
        "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_IB_HCA": EXPECTED["h100-sxm-8gpu-ndr"]["NCCL_IB_HCA"],
    }
    assert any(line.startswith("# NCCL_IB_DISABLE unset: ") for line in out)
    assert all(line.startswith(("export ", "# ")) for line in out)
    assert format_env(_report("h100-sxm-8gpu-ndr")) == "\n".join(out)


def test_cli_json_is_the_whole_report(capsys: pytest.CaptureFixture[str]):
    machine = DATA / "rtx6000ada-pcie-4gpu-roce"
    code = main(["doctor", "--sysfs-root", str(machine / "root"), "--topo", str(machine / "topo.txt"),
                 "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["env"] == {"NCCL_SOCKET_IFNAME": "enp130s0f0", "GLOO_SOCKET_IFNAME": "enp130s0f0",
                           "NCCL_IB_DISABLE": "1"}
    assert data["gpus"] == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert [p["nic_state"] for p in data["placements"]] == ["DOWN"] * 4
    assert {s["name"]: s["value"] for s in data["settings"]}["NCCL_IB_HCA"] is None
    assert [p["name"] for p in data["hca_ports"]] == [f"mlx5_{i}:1" for i in range(4)]
    assert any("no NVLink" in n for n in data["notes"])


def test_cli_on_a_recorded_tree_without_topo_does_not_run_nvidia_smi(
    capsys: pytest.CaptureFixture[str],
):
    code = main(["doctor", "--sysfs-root", str(DATA / "a100-sxm-8gpu-dgx-layout" / "root")])
    out = capsys.readouterr().out
    assert code == 0 and "GPUs: 0" in out and "no --topo file given" in out
    assert "NCCL_IB_HCA=mlx5_0:1,mlx5_1:1" in out  # every active port, no topology to narrow it


def test_a_topology_without_nic_columns_gives_numa_and_cpus_only(tmp_path: Path):
    topo = read_topo(DATA / "h100-sxm-8gpu-no-nic-columns" / "topo.txt")
    assert topo.nics == () and len(topo.gpus) == 8
    report = diagnose(sysfs_root=tmp_path, topo=topo, environ={})
    assert [(p.nic, p.link) for p in report.placements] == [(None, None)] * 8
    assert [p.cpus for p in report.placements] == ["0-51,104-155"] * 4 + ["52-103,156-207"] * 4
    assert any(n.startswith("NVLink between every GPU pair (NV18") for n in report.notes)
    assert "no NIC listed" in format_report(report)


def test_a_workstation_with_one_numa_node_needs_no_binding(tmp_path: Path):
    topo = read_topo(DATA / "rtx6000ada-2gpu-workstation" / "topo.txt")
    report = diagnose(sysfs_root=tmp_path, topo=topo, environ={})  # NIC states unknown
    assert [(p.gpu, p.nic, p.link, p.nic_state) for p in report.placements] == [
        ("GPU0", "mlx5_0", "NODE", None), ("GPU1", "mlx5_1", "NODE", None)]
    assert not any("NUMA nodes" in n for n in report.notes)
    assert "no NVLink: GPU-to-GPU traffic crosses PCIe" in report.notes
    assert not any("CPU interconnect" in n for n in report.notes)  # PHB, not SYS
