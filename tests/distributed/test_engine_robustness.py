"""The engine's error paths: a resume that would not continue the data is refused, servers and
hooks are released when a run fails, unusual models get clear errors, and compression priming
neither breaks nor changes a model with batch norm."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from torch import nn

from torsh_distributed.testing import find_free_port, run_distributed


def _engine(directory: str = "", *, n: int = 64, steps: int = 3, **parallel) -> object:
    from torsh_distributed.engine import Engine, EngineConfig
    from torsh_distributed.testing.models import classification_data, mlp

    config = EngineConfig(max_steps=steps, batch_size=8, progress=False, eval_batches=1)
    config.checkpoint.dir = directory
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    return Engine(mlp, dataset=classification_data(n=n), config=config)


def _resume_cases(directory: str) -> dict[str, str]:
    _engine(directory, steps=3).fit()
    out = {}
    for name, kwargs in {"bigger dataset": {"n": 128, "steps": 6}, "past max_steps": {"steps": 2}}.items():
        try:
            _engine(directory, **kwargs).fit()
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_resume_that_would_not_continue_the_data_is_refused(tmp_path: Path):
    for r in run_distributed(_resume_cases, 2, args=(str(tmp_path),), timeout=120):
        assert "the data would not continue" in r["bigger dataset"]
        assert "num_samples 64 in the checkpoint, 128 now" in r["bigger dataset"]
        assert "is at step 3, beyond max_steps 2" in r["past max_steps"]


def _nan_run(port: int) -> str:
    from torsh_distributed.engine import Engine, EngineConfig
    from torsh_distributed.testing.models import classification_data, mlp

    config = EngineConfig(max_steps=5, batch_size=8, progress=False)
    config.monitor.metrics_port = port
    model = mlp()
    with torch.no_grad():
        model[0].weight.fill_(float("nan"))
    try:
        Engine(model, dataset=classification_data(n=64), config=config).fit()
    except FloatingPointError as exc:
        message = str(exc)
    else:
        return "no error"
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    with socket.socket() as s:  # the exporter released its port
        s.bind(("127.0.0.1", port))
    return f"{message} | hooks left {hooks}"


def test_a_failing_run_releases_its_server_and_hooks():
    msg = run_distributed(_nan_run, 1, args=(find_free_port(),), timeout=60)[0]
    assert "loss became nan at step 1" in msg and "hooks left 0" in msg


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _batchnorm(method: str) -> list[float]:
    from torsh_distributed.engine import Engine, EngineConfig
    from torsh_distributed.testing.models import classification_data

    config = EngineConfig(max_steps=4, batch_size=16, progress=False, eval_batches=1)
    config.compression.method = method
    return Engine(_BatchNormNet, dataset=classification_data(n=128), config=config).fit().losses


def test_compression_priming_leaves_batch_norm_statistics_alone():
    plain = run_distributed(_batchnorm, 2, args=("none",), timeout=120)[0]
    fp16 = run_distributed(_batchnorm, 2, args=("fp16",), timeout=120)[0]
    assert fp16 == pytest.approx(plain, rel=2e-3)


def test_default_loss_names_what_to_pass():
    from torsh_distributed.engine.engine import default_loss

    with pytest.raises(TypeError, match=r"pass loss_fn=\.\.\. \(--loss\)"):
        default_loss((torch.zeros(2, 3), None), torch.zeros(2, dtype=torch.long))
