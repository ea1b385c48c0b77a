"""Which processes a test run starts cold, and which of them import torch (docs/testing.md).

``install`` puts a start-up hook into the venv (a ``.pth`` file and a small module): every Python
process started with ``TORSH_IMP_AUDIT=LOG`` in its environment appends to LOG a ``start`` line
(pid, parent pid, time, argv), an ``import`` line the first time it imports torch, Flower, Ray,
Dask, transformers or FastAPI itself (a process forked from one that already has them writes
none: those imports are what a warm start saves), and an ``exit`` line with its CPU seconds
(processes that leave through ``os._exit`` write none). ``uninstall`` removes the hook;
``report`` summarises a log, and with ``--cpu-log`` (the file ``TORSH_TEST_CPU_LOG`` wrote in the
same run) says which test files started the cold torch imports::

    .venv/bin/python scripts/import_audit.py install
    TORSH_IMP_AUDIT=/tmp/audit.log TORSH_TEST_CPU_LOG=/tmp/cpu.txt \\
        .venv/bin/python -m pytest -q -n 2 --dist loadfile tests
    .venv/bin/python scripts/import_audit.py report /tmp/audit.log --cpu-log /tmp/cpu.txt
    .venv/bin/python scripts/import_audit.py uninstall

The hook is for measuring only: it is never installed by ``make``.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import sysconfig
from pathlib import Path

_MODULE = "_torsh_import_audit"
_HOOK = '''import os, sys, time
_LOG = os.environ.get("TORSH_IMP_AUDIT")
if _LOG:
    def _w(line):
        try:
            with open(_LOG, "a") as f:
                f.write(line + "\\n")
        except OSError:
            pass
    _w(f"start {os.getpid()} {os.getppid()} {time.time():.3f} {' '.join(sys.argv)[:300]!r}")
    _WATCH = {"torch", "flwr", "ray", "dask", "transformers", "fastapi"}
    class _Finder:
        def find_spec(self, name, path=None, target=None):
            if name in _WATCH:
                _WATCH.discard(name)
                _w(f"import {name} {os.getpid()} {time.time():.3f}")
            return None
    sys.meta_path.insert(0, _Finder())
    import atexit
    def _bye():
        t = os.times()
        _w(f"exit {os.getpid()} {t.user + t.system:.2f} {' '.join(sys.argv)[:200]!r}")
    atexit.register(_bye)
'''


def _site() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def install() -> None:
    (_site() / f"{_MODULE}.py").write_text(_HOOK)
    (_site() / f"zz{_MODULE}.pth").write_text(f"import {_MODULE}\n")
    print(f"installed in {_site()}: set TORSH_IMP_AUDIT=LOG to record")


def uninstall() -> None:
    for name in (f"{_MODULE}.py", f"zz{_MODULE}.pth"):
        (_site() / name).unlink(missing_ok=True)
    print(f"removed from {_site()}")


def _command(argv: str) -> str:
    words = argv.strip("'").split()
    if not words:
        return "?"
    return "ray worker" if "ray" in words[0] else " ".join(Path(words[0]).name.split()[:1] + words[1:2])


def report(log: Path, cpu_log: Path | None) -> None:
    starts: dict[str, tuple[str, float, str]] = {}
    imports: dict[str, set[str]] = collections.defaultdict(set)
    cpu: dict[str, tuple[float, str]] = {}
    for line in log.read_text().splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "start":
            pid, ppid, when, argv = rest.split(" ", 3)
            starts[pid] = (ppid, float(when), argv)
        elif kind == "import":
            name, pid, _ = rest.split(" ", 2)
            imports[name].add(pid)
        elif kind == "exit":
            pid, seconds, argv = rest.split(" ", 2)
            cpu[pid] = (float(seconds), argv)
    cold = imports["torch"]
    print(f"{len(starts)} Python starts, {len(cold)} cold `import torch`, "
          f"{sum(c for c, _ in cpu.values()):.0f} CPU-s in the processes that ran atexit")
    by_command: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0])
    for pid, (_, _, argv) in starts.items():
        row = by_command[_command(cpu[pid][1] if pid in cpu else argv)]
        row[0] += 1
        row[1] += pid in cold
        row[2] += cpu.get(pid, (0.0, ""))[0]
    print("\nstarts  torch  CPU-s  command")
    for name, (n, t, c) in sorted(by_command.items(), key=lambda kv: -kv[1][2])[:30]:
        print(f"{n:6d} {t:6d} {c:6.1f}  {name}")
    if cpu_log is None:
        return
    tests: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
    for line in cpu_log.read_text().splitlines():
        parts = line.split()
        tests[parts[-1]].append((float(parts[-2]), " ".join(parts[2:-2])))
    for ends in tests.values():
        ends.sort()
    # xdist workers are the children of the pytest process; the first started is gw0
    main = min(starts, key=lambda p: starts[p][1])
    workers = sorted((p for p in starts if starts[p][0] == main), key=lambda p: starts[p][1])
    names = dict(zip(workers, sorted(tests), strict=False))

    def worker_of(pid: str) -> str | None:
        seen = set()
        while pid in starts and pid not in seen:
            seen.add(pid)
            if starts[pid][0] in names:
                return starts[pid][0]
            pid = starts[pid][0]
        return None

    per_file: collections.Counter[str] = collections.Counter()
    for pid in cold:
        worker = worker_of(pid)
        if worker is None:
            continue
        ends = tests[names[worker]]
        i = bisect.bisect_left(ends, (starts[pid][1], ""))
        per_file[ends[i][1].split("::")[0] if i < len(ends) else "?"] += 1
    print("\ncold `import torch` by test file")
    for name, n in per_file.most_common(30):
        print(f"{n:4d}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("install", help="add the start-up hook to this interpreter's site-packages")
    sub.add_parser("uninstall", help="remove it")
    rep = sub.add_parser("report", help="summarise a log")
    rep.add_argument("log", type=Path)
    rep.add_argument("--cpu-log", type=Path, help="the TORSH_TEST_CPU_LOG file of the same run")
    args = parser.parse_args()
    if args.action == "install":
        install()
    elif args.action == "uninstall":
        uninstall()
    else:
        report(args.log, args.cpu_log)


if __name__ == "__main__":
    main()
