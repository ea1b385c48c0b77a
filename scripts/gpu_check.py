"""`make gpu-check`: every GPU path and the GPU figures in one command, within nine minutes of a bare
accelerator machine (docs/gpu.md gives the exact `device` call).

Steps, each a subprocess with its own time budget (killed past it, the rest still run):

* ``tests``: ``pytest tests/gpu`` (junit XML kept, pass/skip/fail list in the JSON);
* ``bench-train``: the engine vs a plain PyTorch loop of the same model on one GPU, tokens/s and
  MFU, fp32 and bf16, eager and ``torch.compile`` (benchmarks/bench_gpu_train.py);
* ``bench-generate``: our generation vs ``transformers`` at batch 1/8/32: TTFT, TPOT, tokens/s
  (benchmarks/bench_vs_transformers.py on CUDA);
* ``bench-codecs``: the compressors', 1-bit Adam's and int8 ZeRO's codecs on GPU tensors
  (benchmarks/bench_gpu_codecs.py).

Writes ``gpu-check.json`` (device, driver, torch and CUDA versions, every step's status and wall
time, the test list, the figures) and ``gpu-check.log`` (every step's output) under ``--out``
(default ``$OUT``, else ``gpu-check-out``). Without CUDA it says so in one line and makes a dry
pass: the arguments, the files it would write, the carried wheels present, each step's command
checked without running it (``--help`` / ``--collect-only``).

Before the steps, ``--install`` installs the carried wheels (``.whl/``, see ``make gpu-wheels``)
into ``/tmp/site`` and the package itself without network (``pip install --no-deps
--no-build-isolation -e .``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
WHEEL_LIST = ROOT / "scripts" / "gpu_wheels.txt"
SITE = Path("/tmp/site")
TOTAL_BUDGET_S = 540.0
# Changes the GPU's power limit (and puts it back): the lent machines' settings must be left as
# they are, so the check deselects it; run it by hand on a GPU you own.
SETTINGS_TESTS = ("tests/gpu/test_energy_power_gpu.py",)


@dataclass(kw_only=True)
class Step:
    name: str
    budget_s: float
    argv: list[str]
    dry_argv: list[str]
    outputs: list[str] = field(default_factory=list)


def steps(out: Path, *, workers: int) -> list[Step]:
    py = sys.executable
    xml = str(out / "gpu-tests.xml")
    pytest_args = [py, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--timeout", "240"]
    if workers > 1:
        pytest_args += ["-n", str(workers), "--dist", "loadfile"]
    deselect = [f"--ignore={p}" for p in SETTINGS_TESTS]
    return [
        Step(name="tests", budget_s=240, argv=[*pytest_args, *deselect, "--junitxml", xml,
                                               "tests/gpu"],
             dry_argv=[py, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                       "tests/gpu"],
             outputs=["gpu-tests.xml"]),
        Step(name="bench-train", budget_s=160,
             argv=[py, "benchmarks/bench_gpu_train.py", "--json", str(out / "bench-train.json")],
             dry_argv=[py, "benchmarks/bench_gpu_train.py", "--help"],
             outputs=["bench-train.json"]),
        Step(name="bench-generate", budget_s=70,
             argv=[py, "benchmarks/bench_vs_transformers.py", "--device", "cuda",
                   "--layers", "12", "--width", "768", "--heads", "12", "--context", "1024",
                   "--prompt-len", "128", "--new-tokens", "64", "--rounds", "2",
                   "--json", str(out / "bench-generate.json")],
             dry_argv=[py, "benchmarks/bench_vs_transformers.py", "--help"],
             outputs=["bench-generate.json"]),
        Step(name="bench-codecs", budget_s=50,
             argv=[py, "benchmarks/bench_gpu_codecs.py", "--cpu-numel", str(1 << 22),
                   "--json", str(out / "bench-codecs.json")],
             dry_argv=[py, "benchmarks/bench_gpu_codecs.py", "--help"],
             outputs=["bench-codecs.json"]),
    ]


def _versions() -> dict:
    import torch

    info: dict = {"python": platform.python_version(), "torch": torch.__version__,
                  "cuda": torch.version.cuda, "nccl": None, "device": None, "driver": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"] = props.name
        info["device_count"] = torch.cuda.device_count()
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
        info["multiprocessors"] = props.multi_processor_count
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            info["nccl"] = f"unknown ({exc})"
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,power.limit",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["driver"] = q.stdout.strip() or q.stderr.strip()
    return info


def _tests_from_junit(path: Path) -> dict:
    if not path.is_file():
        return {}
    result: dict[str, list] = {"passed": [], "failed": [], "skipped": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if (skip := case.find("skipped")) is not None:
            result["skipped"].append([name, skip.get("message", "")])
        elif case.find("failure") is not None or case.find("error") is not None:
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            result["failed"].append([name, (bad.get("message") or "")[:400]])
        else:
            result["passed"].append(name)
    return result


def _norm(name: str) -> str:
    return name.lower().replace("-", "_")


def wheel_list() -> dict[str, str]:
    """``{normalised name: pinned version}`` from scripts/gpu_wheels.txt."""
    pins = {}
    for line in WHEEL_LIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_norm(name)] = version
    return pins


def missing_wheels() -> list[str]:
    """Pinned wheels with no matching file in .whl/ (``name==version``)."""
    have = {(_norm(p.name.split("-")[0]), p.name.split("-")[1]) for p in WHEELS.glob("*.whl")}
    return [f"{n}=={v}" for n, v in wheel_list().items() if (n, v) not in have]


def _install(log) -> dict:  # noqa: ANN001 - a text file
    """Install the carried wheels into /tmp/site and the package (editable), offline; a failure
    is reported, not fatal (the steps still find the package through PYTHONPATH=src)."""
    py = sys.executable
    done: dict = {}
    wheels = sorted(WHEELS.glob("*.whl"))
    cmds = {"editable": [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                         "--no-build-isolation", "-e", str(ROOT)]}
    if wheels:
        cmds = {"wheels": [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE),
                           *map(str, wheels)], **cmds}
    for what, cmd in cmds.items():
        print(f"== install {what}", file=log, flush=True)
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=180, check=False)
        done[what] = "ok" if proc.returncode == 0 else f"failed (rc {proc.returncode})"
    return done


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(ROOT / "src")]
    if SITE.is_dir():
        paths.append(str(SITE))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    cuda = torch.cuda.is_available()
    dry = args.dry_run or not cuda
    chosen = steps(out, workers=args.workers)
    names = [s.name for s in chosen]
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            print(f"gpu-check: unknown step(s) {', '.join(unknown)}; steps: {', '.join(names)}",
                  file=sys.stderr)
            return 2
        chosen = [s for s in chosen if s.name in wanted]
    if not cuda:
        print("gpu-check: no CUDA device here: dry pass (arguments, outputs, wheels, commands)")
    report: dict = {"dry_run": dry, "started_unix_s": time.time(), "env": _versions(),
                    "steps": [], "figures": {}}
    report["wheels"] = sorted(p.name for p in WHEELS.glob("*.whl"))
    report["wheels_missing"] = missing_wheels()
    if report["wheels_missing"]:
        print(f"gpu-check: {len(report['wheels_missing'])} pinned wheel(s) not in .whl/ "
              f"(`make gpu-wheels` fetches them): {', '.join(report['wheels_missing'])}")
    log_path = out / "gpu-check.log"
    start = time.monotonic()
    status = 0
    with log_path.open("w") as log:
        if args.install and not dry:
            report["install"] = _install(log)
        for step in chosen:
            argv = step.dry_argv if dry else step.argv
            left = TOTAL_BUDGET_S * args.budget_scale - (time.monotonic() - start)
            budget = min(step.budget_s * args.budget_scale, max(left, 0.0))
            entry = {"name": step.name, "budget_s": round(budget, 1), "argv": argv,
                     "outputs": [str(out / o) for o in step.outputs]}
            if budget < 5:
                entry.update(status="not run", why="the total budget is spent")
                report["steps"].append(entry)
                status = 1
                continue
            print(f"== {step.name} (budget {budget:.0f} s): {' '.join(argv)}", file=log, flush=True)
            t0 = time.monotonic()
            proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=budget)
                entry["status"] = "ok" if rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                rc = proc.wait()
                entry["status"] = "timeout"
            entry["rc"] = rc
            entry["wall_s"] = round(time.monotonic() - t0, 1)
            print(f"== {step.name}: {entry['status']} in {entry['wall_s']} s", file=log, flush=True)
            print(f"gpu-check: {step.name}: {entry['status']} ({entry['wall_s']} s)", flush=True)
            if entry["status"] != "ok":
                status = 1
            report["steps"].append(entry)
            if not dry:
                for name in step.outputs:
                    path = out / name
                    if path.suffix == ".json" and path.is_file():
                        report["figures"][step.name] = json.loads(path.read_text())
    report["tests"] = _tests_from_junit(out / "gpu-tests.xml") if not dry else {}
    report["deselected"] = {p: "changes the GPU's power limit: lent machines' settings must stay"
                            for p in SETTINGS_TESTS}
    report["wall_s"] = round(time.monotonic() - start, 1)
    tmp = out / "gpu-check.json.tmp"
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(out / "gpu-check.json")
    tests = report["tests"]
    if tests:
        print(f"gpu-check: tests {len(tests['passed'])} passed, {len(tests['failed'])} failed, "
              f"{len(tests['skipped'])} skipped")
        for name, why in tests["failed"]:
            print(f"  FAILED {name}: {why[:200]}")
    print(f"gpu-check: wrote {out / 'gpu-check.json'} and {log_path} ({report['wall_s']} s)")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out",
                        help="folder for gpu-check.json, the log and the benchmarks' JSON")
    parser.add_argument("--install", action="store_true",
                        help="install the carried wheels (.whl/) and the package first, offline")
    parser.add_argument("--dry-run", action="store_true", help="check the steps without running")
    parser.add_argument("--only", default="", help="comma-separated steps to run")
    parser.add_argument("--workers", type=int, default=4, help="pytest-xdist workers for tests/gpu")
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="multiply every step's time budget (and the 540 s total)")
    args = parser.parse_args(argv)
    if args.budget_scale <= 0:
        parser.error("--budget-scale must be positive")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
