"""Meta-device initialisation through the engine gives every FSDP shard and every pipeline stage
its own draw (CPU meshes have no distributed RNG: one seed for all would repeat the same values),
and a model that nothing initialises is refused on every rank before any collective."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from torsh_distributed.testing import run_distributed


def _fit(directory: str, parallel: dict) -> None:
    from torsh_distributed.engine import Engine, EngineConfig
    from torsh_distributed.testing.models import TinyLM, token_data

    config = EngineConfig(max_steps=1, batch_size=8, progress=False, eval_batches=1)
    config.optim.lr = 1e-9  # the saved weights are (almost) the initial ones
    config.checkpoint.dir = directory
    for key, value in {"meta_init": True, **parallel}.items():
        setattr(config.parallel, key, value)
    Engine(lambda: TinyLM(n_layer=4), dataset=token_data(n=64), config=config).fit()


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = sorted(p for p in directory.iterdir() if p.name.startswith("step_"))[-1]
    out = directory / "full.pt"
    dcp_to_torch_save(step, out)
    return torch.load(out, weights_only=True)["model"]


def test_fsdp_shards_and_pipeline_stages_get_their_own_draws(tmp_path: Path):
    run_distributed(_fit, 2, args=(str(tmp_path / "z3"), {"zero_stage": 3}), timeout=120)
    w = _weights(tmp_path / "z3")
    fc1 = w["layers.0.fc1.weight"]
    half = fc1.shape[0] // 2
    assert not torch.allclose(fc1[:half], fc1[half:], atol=1e-4), "both FSDP shards got the same draw"
    assert 0.01 < float(fc1.std()) < 0.03  # TinyLM's init: normal(0, 0.02)

    run_distributed(_fit, 2, args=(str(tmp_path / "pp"), {"pp": 2, "microbatches": 2}), timeout=120)
    w = _weights(tmp_path / "pp")
    first, third = w["layers.0.fc1.weight"], w["layers.2.fc1.weight"]
    assert not torch.allclose(first, third, atol=1e-4), "the second stage repeated the first stage's draw"


class _Bare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))  # nothing resets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def _bare() -> str:
    from torsh_distributed.engine import Engine, EngineConfig
    from torsh_distributed.testing.models import PairDataset

    config = EngineConfig(max_steps=1, batch_size=4, progress=False)
    config.parallel.meta_init = True
    config.parallel.zero_stage = 3
    data = PairDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
    try:
        Engine(_Bare, dataset=data, config=config).fit()
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_uninitialised_parameter_is_refused_on_every_rank():
    for msg in run_distributed(_bare, 2, timeout=60):
        assert "meta_init: no reset_parameters() initialises scale" in msg, msg
