"""docs/cli.md is generated from the real --help text and must not drift from it."""

from __future__ import annotations

import argparse
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


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    return dict(action.choices)


def test_main_registers_only_the_command_it_runs_with_the_same_help():
    from torsh_distributed.cli.main import _COMMANDS, build_parser

    full = _subcommands(build_parser())
    assert list(full) == list(_COMMANDS)
    for name in ("run", "train"):
        only = _subcommands(build_parser(name))
        assert list(only) == [name]
        assert only[name].format_help() == full[name].format_help()
