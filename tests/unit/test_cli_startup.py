"""``torsh-dist`` prints its help and refuses bad input without importing torch or any optional
subsystem (Flower, Ray, Dask, FastAPI, transformers): on a loaded host those imports took 20-40 s
before the first line (issue 37). Speed itself is a benchmark (docs/benchmarks.md, "Start-up");
these tests check what was imported, in a fresh interpreter."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types

import pytest

HEAVY = ("torch", "numpy", "flwr", "ray", "dask", "distributed", "fastapi", "uvicorn", "transformers",
         "mlflow", "tensorboard")
"""Top-level modules that the parser and its refusals must not load."""

# Runs main() in a fresh interpreter, then reports the exit code and which HEAVY modules loaded.
_WRAPPER = f"""
import json, sys
from torsh_distributed.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
loaded = sorted(m for m in {HEAVY!r} if m in sys.modules)
print(json.dumps({{"code": code, "loaded": loaded}}), file=sys.__stderr__)
"""


def _run(*argv: str) -> tuple[int, list[str], str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *argv], capture_output=True, text=True, timeout=120
    )
    *lines, report = proc.stderr.rstrip("\n").split("\n")
    result = json.loads(report)
    return result["code"], result["loaded"], proc.stdout, "\n".join(lines)


def _command_paths() -> list[list[str]]:
    """Every command and sub-command of ``torsh-dist`` (``[]`` is the top level)."""
    from torsh_distributed.cli.main import build_parser

    def walk(parser: argparse.ArgumentParser, prefix: list[str]) -> list[list[str]]:
        paths = [prefix]
        for action in parser._actions:  # noqa: SLF001
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                for name, child in action.choices.items():
                    paths += walk(child, [*prefix, name])
        return paths

    return walk(build_parser(), [])


def test_the_command_tree_is_walked():
    paths = {" ".join(p) for p in _command_paths()}
    assert {"", "train", "run", "generate", "federated", "plan"} <= paths
    assert len(paths) >= 15


@pytest.mark.parametrize("path", _command_paths(), ids=lambda p: " ".join(p) or "torsh-dist")
def test_help_imports_no_torch_nor_optional_subsystems(path: list[str]):
    code, loaded, out, err = _run(*path, "--help")
    assert code == 0, err
    assert out.startswith("usage: torsh-dist"), out[:200]
    assert loaded == [], f"torsh-dist {' '.join(path)} --help imported {loaded}"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["train", "--nproc-per-node", "0"], "torsh-dist train: error: nproc_per_node must be >= 1, got 0"),
        (["train", "--lr", "-1"], "torsh-dist train: error: optim.lr must be > 0, got -1.0"),
        (
            ["train", "--lr-ref-batch", "8", "--lr-scaling", "cubic"],
            "torsh-dist train: error: optim.lr_scaling must be one of auto, linear, sqrt, got 'cubic'",
        ),
        (
            ["train", "--tp", "3", "--nproc-per-node", "2"],
            "torsh-dist train: error: parallel degrees do not match the world size: world size 2 is "
            "not divisible by the fixed degrees (pp=1 * dp=-1 * ep=1 * tp=3 = 3); dp cannot fill the rest",
        ),
        (
            ["train", "--batch-size", "33", "--nproc-per-node", "2"],
            "torsh-dist train: error: batch_size 33 (global) is not divisible by the 2 data-parallel "
            "ranks; choose a multiple of 2",
        ),
        (  # replica groups: the degrees split one group's ranks (4 / 2), not the whole world
            ["train", "--nproc-per-node", "4", "--ft.replica-groups", "2", "--tp", "2", "--dp", "2"],
            "torsh-dist train: error: parallel degrees do not match the world size: dp * tp * pp * "
            "ep = pp=1 * dp=2 * ep=1 * tp=2 = 4 != world size 2; use -1 for one degree to take the "
            "rest (one of 2 replica groups' ranks)",
        ),
        (
            ["train", "--nproc-per-node", "4", "--ft.replica-groups", "2", "--batch-size", "6"],
            "torsh-dist train: error: batch_size 6 is not divisible by the 4 data-parallel ranks of "
            "2 replica groups; choose a multiple of 4",
        ),
        (
            ["train", "--nproc-per-node", "4", "--ft.replica-groups", "2", "--nnodes", "1:1",
             "--batch-size", "6"],
            "torsh-dist train: error: batch_size 6 is not divisible by the 4 data-parallel ranks of "
            "2 replica groups; choose a multiple of 4",
        ),
        (
            ["train", "--nproc-per-node", "4", "--ft.replica-groups", "2", "--nnodes", "2"],
            "torsh-dist train: error: --ft.replica-groups runs on one node (--nnodes 1) for now",
        ),
        (["run", "--nproc-per-node", "0", "x.py"], "torsh-dist run: error: nproc_per_node must be >= 1, got 0"),
        (
            ["generate", "--checkpoint", "runs/none", "--prompt", "a", "--top-p", "2"],
            "torsh-dist generate: error: sampling.top_p must be in (0, 1] (1 = off), got 2.0",
        ),
        (
            ["train", "--tensorboard", "runs/tb", "--experiment", "e"],
            "torsh-dist train: error: monitor.experiment (--experiment e) names an MLflow experiment: "
            "give --mlflow URI too (TensorBoard has no experiments: use --run-name)",
        ),
    ],
    ids=["train-nproc-0", "train-lr", "train-lr-scaling", "train-tp-3", "train-batch-33",
         "train-ft-group-degrees", "train-ft-group-batch", "train-ft-elastic-1-node",
         "train-ft-nodes", "run-nproc-0", "generate-top-p", "train-experiment"],
)
def test_refusal_is_one_line_and_imports_no_torch(argv: list[str], line: str):
    code, loaded, out, err = _run(*argv)
    assert (code, out, err) == (2, "", line)
    assert loaded == [], f"torsh-dist {' '.join(argv)} imported {loaded}"


# Bad paths and unreachable servers: each was refused only after `import torch` (5-9 s on the
# 2-core VM, 20-40 s under load) until the twenty-second session. {tmp}: an empty directory,
# {port}: a closed port, {cwd}: the working directory.
MISSING = "/nonexistent-torsh"
PATH_REFUSALS = [
    (["run", "no_such_script.py"],
     "torsh-dist run: error: script 'no_such_script.py' is not a file (working directory {cwd})"),
    (["generate", "--checkpoint", MISSING, "--prompt", "a"],
     f"torsh-dist generate: error: no such checkpoint directory: {MISSING}"),
    (["generate", "--checkpoint", "{tmp}", "--prompt", "a"],
     "torsh-dist generate: error: no checkpoint in {tmp}: it holds no step_XXXXXXXX checkpoint "
     "directories (is it the --checkpoint-dir of a torsh-dist train run?)"),
    (["infer", "--checkpoint", MISSING, "--input", "in.jsonl", "--output", "out.jsonl"],
     f"torsh-dist infer: error: no such checkpoint directory: {MISSING}"),
    (["checkpoint", "list", MISSING], f"torsh-dist checkpoint list: {MISSING} does not exist"),
    (["bench", "collectives", "--sizes", "12Q"],
     "torsh-dist bench: error: size must look like 1K, 1M or 4096, got '12Q'"),
    (["federated", "--clients", "0"], "torsh-dist federated: error: federated.clients must be > 0, got 0"),
    (["federated", "--model", "{tmp}/nets.py:make", "--dataset", "{tmp}/nets.py:data"],
     "torsh-dist federated: error: --model {tmp}/nets.py:make: cannot import '{tmp}/nets.py': "
     "FileNotFoundError: no such file {tmp}/nets.py"),
    (["train", "--model", "nets.py:make", "--dataset", "nets.py:data"],
     "torsh-dist train: error: --model nets.py:make: cannot import 'nets.py': FileNotFoundError: "
     "no such file nets.py"),
    (["train", "--nproc-per-node", "2", "--mlflow", "http://127.0.0.1:{port}"],
     "torsh-dist train: error: --mlflow: MLflow tracking URI 'http://127.0.0.1:{port}' is not usable: "
     "cannot connect to 127.0.0.1:{port}: Connection refused"),
    (["train", "--checkpoint-dir", "/dev/null/ckpt"],
     "torsh-dist train: error: --checkpoint-dir '/dev/null/ckpt' cannot be created: Not a directory"),
    (["train", "--resume", "always"],
     "torsh-dist train: error: --resume always: no such checkpoint directory (give auto, never, or a "
     "checkpoint's path)"),
    (["train", "--ft.replica-groups", "2", "--nproc-per-node", "3"],
     "torsh-dist train: error: --nproc-per-node 3 is not a multiple of ft.replica_groups 2"),
    (["train", "--model", f"hf:{MISSING}", "--dataset", "hf:{tmp}/text.txt"],
     f"torsh-dist train: error: --model hf:{MISSING}: not a save_pretrained directory (with "
     "config.json) or a config.json file; models are not downloaded here: save a Hub model first "
     "(huggingface-cli download NAME --local-dir DIR) and pass hf:DIR"),
    (["serve", "--checkpoint", MISSING, "--port", "8000"],
     f"torsh-dist serve: error: no such checkpoint directory: {MISSING}"),
    (["serve", "--checkpoint", "{tmp}", "--port", "8000", "--host", "0.0.0.0"],
     "torsh-dist serve: error: server.host '0.0.0.0' is not a loopback address: other machines could "
     "send requests, so a token is required (--token-env VAR or --token-file FILE); bind 127.0.0.1 to "
     "serve this machine only"),
    (["horovodrun", "-np", "2", "python", "no_such_script.py"],
     "torsh-dist horovodrun: error: script 'no_such_script.py' is not a file (working directory {cwd})"),
    (["federated-node", "--superlink", "127.0.0.1:{port}", "--partition-id", "5", "--num-partitions", "2"],
     "torsh-dist federated-node: error: --partition-id 5 is not in [0, 2)"),
]


@pytest.mark.parametrize(("argv", "line"), PATH_REFUSALS, ids=lambda v: "-".join(v)[:40] if isinstance(v, list) else "")
def test_bad_paths_and_servers_are_refused_before_torch(argv: list[str], line: str, tmp_path):
    from torsh_distributed.testing import find_free_port

    fill = {"tmp": str(tmp_path), "port": str(find_free_port()), "cwd": os.getcwd()}
    code, loaded, out, err = _run(*(a.format(**fill) for a in argv))
    assert (code, out, err) == (2, "", line.format(**fill))
    assert loaded == [], f"torsh-dist {' '.join(argv)} imported {loaded}"


def test_package_import_is_light():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, torsh_distributed; "
         f"print([m for m in {HEAVY!r} if m in sys.modules])"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.stdout.strip() == "[]", proc.stderr


@pytest.mark.parametrize(
    "package",
    ["torsh_distributed", "torsh_distributed.runtime", "torsh_distributed.checkpoint",
     "torsh_distributed.comm", "torsh_distributed.compression", "torsh_distributed.data",
     "torsh_distributed.elastic", "torsh_distributed.energy", "torsh_distributed.inference",
     "torsh_distributed.monitor", "torsh_distributed.parallel", "torsh_distributed.ps"],
)
def test_every_lazy_export_resolves(package: str):
    import importlib

    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018


def test_an_export_named_like_its_module_stays_the_export():
    import importlib

    inference = importlib.import_module("torsh_distributed.inference")
    submodule = importlib.import_module("torsh_distributed.inference.generate")
    assert isinstance(submodule, types.ModuleType)
    assert inference.generate is submodule.generate
    from torsh_distributed.inference import generate

    assert callable(generate) and not isinstance(generate, types.ModuleType)
