"""The order `make test` hands test files to its workers: tests/durations.json, longest first."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_file_in_the_table_exists():
    table = json.loads((ROOT / "tests" / "durations.json").read_text())
    stale = [path for path in table if not (ROOT / path).is_file()]
    assert not stale, (
        f"tests/durations.json names files that are gone: {stale} (scripts/test_durations.py)"
    )
    assert all(isinstance(s, (int, float)) and s >= 0 for s in table.values())


def test_longest_files_first_keeps_each_files_tests_together_and_in_order():
    conftest = _load(ROOT / "tests" / "conftest.py", "suite_conftest_under_test")
    ids = ["a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "d.py::t1", "b.py::t2", "e.py::t1"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    conftest.longest_files_first(items, {"a.py": 1.0, "b.py": 9.0, "c.py": 5.0, "d.py": 0.5})
    # e.py is not in the table: the median (3.0) puts it between c.py and a.py
    assert [i.nodeid for i in items] == [
        "b.py::t1", "b.py::t2", "c.py::t1", "e.py::t1", "a.py::t1", "a.py::t2", "d.py::t1",
    ]  # fmt: skip


def test_the_table_is_written_from_junit_reports(tmp_path: Path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.unit.test_pip_install" name="a" time="1.25"/>'
        '<testcase classname="tests.unit.test_pip_install" name="b" time="0.5"/>'
        '<testcase classname="tests.unit.test_test_durations.SomeClass" name="c" time="2"/>'
        '<testcase classname="not.a.test.file" name="d" time="9"/>'
        "</testsuite></testsuites>"
    )
    out = tmp_path / "durations.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "test_durations.py"), str(report),
                           "--out", str(out)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == {
        "tests/unit/test_pip_install.py": 1.8,
        "tests/unit/test_test_durations.py": 2.0,
    }
    missing = subprocess.run([sys.executable, str(ROOT / "scripts" / "test_durations.py"),
                              str(tmp_path / "none.xml")], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert missing.returncode == 2 and "no such report" in missing.stderr
