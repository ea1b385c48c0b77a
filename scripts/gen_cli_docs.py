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
        "**Config files.** `train`, `federated`, `federated-node` and `serve` take `--config FILE.toml`:",
        "each key is a flag without `--` (`max_steps` or `max-steps`), a `--section.name` flag is the key",
        "`name` of the table `[section]`, and `train`'s `--model/--dataset/--loss/--val-dataset/--tp-plan`",
        "sit in a `[user]` table. Flags given on the command line override the file; the file overrides",
        "the defaults and `--preset`. An unknown key (with the nearest known ones), a value of the wrong",
        "type or outside a flag's choices is an error naming the file and the key. `--print-config`",
        "prints the resolved settings as TOML and exits (`train`: every field of the resolved",
        "configuration, a `--deepspeed` file applied); fed back with `--config`, it is the same run.",
        "",
        "```text",
        "torsh-dist train --nproc-per-node 2 --zero-stage 2 --lr 1e-3 --print-config > run.toml",
        "torsh-dist train --config run.toml --max-steps 100   # the file, 100 steps",
        "```",
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
