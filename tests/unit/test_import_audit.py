"""scripts/import_audit.py: the hook's log format and the report's counts (docs/testing.md)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "import_audit.py"


def _module():
    spec = importlib.util.spec_from_file_location("import_audit", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_hook_logs_a_cold_import_and_the_report_counts_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    audit = _module()
    hook = tmp_path / "hook.py"
    # its own variable: a hook installed in this venv (scripts/import_audit.py install) stays quiet
    hook.write_text(audit._HOOK.replace("TORSH_IMP_AUDIT", "TORSH_IMP_AUDIT_TEST"))
    log = tmp_path / "audit.log"
    env = {**os.environ, "TORSH_IMP_AUDIT_TEST": str(log)}
    env.pop("TORSH_IMP_AUDIT", None)
    # the hook as the .pth file runs it: a parent that starts a child that imports torch
    child = tmp_path / "child.py"
    child.write_text(f"exec(open({str(hook)!r}).read())\nimport torch\n")
    parent = tmp_path / "parent.py"
    parent.write_text(f"exec(open({str(hook)!r}).read())\nimport subprocess, sys\n"
                      f"subprocess.run([sys.executable, {str(child)!r}], check=True)\n")
    subprocess.run([sys.executable, str(parent)], env=env, check=True, timeout=120)
    lines = log.read_text().splitlines()
    assert [line.split()[0] for line in lines].count("start") == 2
    assert sum(line.startswith("import torch ") for line in lines) == 1
    assert sum(line.startswith("exit ") for line in lines) == 2
    audit.report(log, None)
    assert "2 Python starts, 1 cold `import torch`" in capsys.readouterr().out
