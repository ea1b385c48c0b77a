"""Write docs/cli.md from the real `torsh-dist ... --help` output (run after changing any flag).

    .venv/bin/python scripts/gen_cli_docs.py          # rewrite docs/cli.md
    .venv/bin/python scripts/gen_cli_docs.py --check  # exit 1 if docs/cli.md is stale
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def _help(argv: list[str]) -> str:
    from torsh_distributed.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    return out.getvalue().rstrip()


def _commands(parser: argparse.ArgumentParser, prefix: list[str]) -> list[list[str]]:
    found: list[list[str]] = []
    for action in parser._actions:  # noqa: SLF001 - argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append([*prefix, name])
                found.extend(_commands(sub, [*prefix, name]))
    return found


def render() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal width: pin it
    from torsh_distributed.cli.main import build_parser

    parts = [
        "# `torsh-dist` command reference",
        "",
        "Generated from the commands' own `--help` by `scripts/gen_cli_docs.py`; do not edit by hand.",
        "",
        "```text",
        _help([]),
        "```",
    ]
    for argv in _commands(build_parser(), []):
        parts += ["", f"## `torsh-dist {' '.join(argv)}`", "", "```text", _help(argv), "```"]
    return "\n".join(parts) + "\n"


def main() -> int:
    check = "--check" in sys.argv[1:]
    text = render()
    if check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale: run python scripts/gen_cli_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
