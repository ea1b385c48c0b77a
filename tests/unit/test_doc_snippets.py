"""What a new user pastes from the docs works: README's Python snippets name nothing they do not
import or define (bar the placeholders they leave to the reader), and docs/planner.md's commands
run as written."""

from __future__ import annotations

import builtins
import json
import re
import shlex
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDERS = {"make_model", "train_set", "val_set", "rank"}
"""The reader's own objects in README's snippets (their model, datasets, rank)."""


def _blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


def _undefined(source: str) -> set[str]:
    """Names a snippet reads (at module level or as globals in its functions) that it neither
    imports nor assigns, nor builtins."""
    top = symtable.symtable(source, "README.md", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    used: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        used.update(s.get_name() for s in table.get_symbols()
                    if s.is_referenced() and (table is top or s.is_global()))
    return used - defined - set(dir(builtins))


def test_undefined_names_are_found():
    assert _undefined("def f():\n    return dist.get_rank() + len([])\n") == {"dist"}
    assert _undefined("import torch.distributed as dist\ndef f():\n    return dist.get_rank()\n") == set()


@pytest.mark.parametrize("index", range(len(_blocks(ROOT / "README.md", "python"))))
def test_readme_python_snippets_import_what_they_use(index: int):
    source = _blocks(ROOT / "README.md", "python")[index]
    compile(source, f"README.md python block {index}", "exec")
    assert _undefined(source) <= PLACEHOLDERS, source


def test_the_planner_docs_commands_run_as_pasted(capsys: pytest.CaptureFixture[str]):
    from torsh_distributed.cli.main import main

    commands = [line for block in _blocks(ROOT / "docs" / "planner.md", "bash")
                for line in block.replace("\\\n", " ").splitlines() if line.startswith("torsh-dist ")]
    assert commands
    for line in commands:
        argv = shlex.split(line, comments=True)[1:]
        assert main(argv) == 0, line
        assert main([*argv, "--json"]) == 0, line  # what the prose says --json adds
        out = capsys.readouterr().out
        json.loads(out[out.index("\n{") + 1:])
