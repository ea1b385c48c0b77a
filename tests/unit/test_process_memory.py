"""Process memory: current RSS through psutil, the cgroup limit read by hand."""

from __future__ import annotations

import psutil
import pytest
import torch

from torsh_distributed.monitor import metrics
from torsh_distributed.parallel.memory import current_rss_bytes, peak_rss_bytes

MiB = 1024 * 1024


def test_current_rss_follows_touched_memory_and_stays_under_the_peak():
    before = current_rss_bytes()
    block = torch.ones(64 * MiB, dtype=torch.uint8)  # written, so resident
    grown = current_rss_bytes()
    assert grown - before >= 60 * MiB
    assert abs(metrics.rss_bytes() - grown) < 16 * MiB  # both read the same counter
    assert grown <= peak_rss_bytes()
    del block


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1073741824\n", 1024 * MiB),  # cgroup v2 with a limit
        ("max\n", None),  # cgroup v2 without one: the machine's memory
        (str(2**63 - 4096), None),  # cgroup v1 writes "unlimited" as a huge number
    ],
)
def test_memory_limit_is_the_cgroup_limit_else_physical_memory(tmp_path, monkeypatch, text, expected):
    limit = tmp_path / "memory.max"
    limit.write_text(text)
    monkeypatch.setattr(metrics, "_CGROUP_LIMITS", (str(tmp_path / "missing"), str(limit)))
    total = float(psutil.virtual_memory().total)
    assert metrics.memory_limit_bytes() == (expected if expected is not None else total)


def test_memory_limit_without_any_cgroup_file_is_physical_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "_CGROUP_LIMITS", (str(tmp_path / "none"),))
    assert metrics.memory_limit_bytes() == float(psutil.virtual_memory().total) > 0
