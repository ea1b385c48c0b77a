#!/usr/bin/env python3
"""Rewrite tests/durations.json from a run's JUnit XML: each test file's summed test time.

`make test` hands whole test files to its pytest-xdist workers longest first by this table
(tests/conftest.py): the files a worker starts last are short, so both workers finish close
together. Refresh it after a clean-clone `make test` when files were added or changed much:

    python3 scripts/test_durations.py runs/pytest-junit.xml

A file missing from the table is placed at the median duration; nothing fails on a stale entry
but tests/unit/test_test_durations.py, which names it.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tests" / "durations.json"


def test_file(classname: str) -> str | None:
    """``tests.unit.test_x`` or ``tests.unit.test_x.TestClass`` -> ``tests/unit/test_x.py``."""
    parts = classname.split(".")
    while parts:
        path = "/".join(parts) + ".py"
        if (ROOT / path).is_file():
            return path
        parts.pop()
    return None


def durations(reports: list[Path]) -> dict[str, float]:
    """Seconds per test file, summed over every test case of every report."""
    total: dict[str, float] = defaultdict(float)
    for report in reports:
        for case in ET.parse(report).iter("testcase"):
            path = test_file(case.get("classname", ""))
            if path is not None:
                total[path] += float(case.get("time", 0.0))
    return {path: round(seconds, 1) for path, seconds in sorted(total.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="JUnit XML files of one run")
    parser.add_argument(
        "--out", type=Path, default=TABLE, help=f"default: {TABLE.relative_to(ROOT)}"
    )
    args = parser.parse_args(argv)
    for report in args.reports:
        if not report.is_file():
            parser.error(f"no such report: {report}")
    table = durations(args.reports)
    if not table:
        parser.error("the reports hold no test case of a file under tests/")
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{args.out}: {len(table)} files, {sum(table.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
