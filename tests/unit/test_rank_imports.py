"""A rank imports only what its job uses (issue 37): a plain data-parallel run (pp=1, tp=1) of the
built-in GPT and of a user's model, through the Python API in a fresh interpreter, must not load
torch's pipelining (which imports ``torch._dynamo``'s tracing front end: seconds per rank on a
loaded host) nor any optional subsystem (torchft, Flower, Ray, FastAPI, transformers).

``torch._dynamo`` itself is not checked: torch's own optimizers import it on their first
``add_param_group`` (``torch._disable_dynamo``), so every training run loads it. Speed is a
benchmark (docs/benchmarks.md, "Start-up"); this checks what was imported."""

from __future__ import annotations

import json
import subprocess
import sys

ABSENT = ("torch.distributed.pipelining", "torchft", "flwr", "ray", "fastapi", "uvicorn",
          "transformers")
"""Modules that a DDP run with pp=1 and no optional feature must not load."""

_SCRIPT = f"""
import dataclasses, json, sys
from torsh_distributed.train import preset, train
from torsh_distributed.engine import Engine
from torsh_distributed.engine.config import EngineConfig, OptimConfig
from torsh_distributed.testing import models as M

gpt = train(dataclasses.replace(preset("tiny"), max_steps=2, progress=False))
user = Engine(
    M.mlp, dataset=M.classification_data(),
    config=EngineConfig(max_steps=2, batch_size=16, progress=False,
                        optim=OptimConfig(lr=1e-2, warmup_steps=0)),
).fit()
loaded = sorted(m for m in {ABSENT!r} if m in sys.modules)
print(json.dumps({{"steps": [len(gpt.losses), len(user.losses)], "loaded": loaded}}), file=sys.__stderr__)
"""


def test_a_ddp_run_imports_no_pipelining_nor_optional_subsystems():
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stderr.rstrip("\n").rsplit("\n", 1)[-1])
    assert result["steps"] == [2, 2]
    assert result["loaded"] == [], f"a pp=1 DDP run imported {result['loaded']}"
