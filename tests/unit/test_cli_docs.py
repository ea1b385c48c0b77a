"""docs/cli.md is generated from the real --help text and must not drift from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cli_reference_is_current():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_cli_docs.py"), "--check"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_every_command_has_help_with_examples():
    text = (ROOT / "docs" / "cli.md").read_text()
    for command in ("torsh-dist run", "torsh-dist train"):
        assert f"## `{command}`" in text
    assert text.count("examples:") >= 2
