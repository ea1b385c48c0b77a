"""Checkpoints of expert-parallel runs: the built-in MoE GPT trained at ep=2 and saved at step 3
resumes exactly at ep=2, at ep=2 with ZeRO-3 (FSDP2 shards of the dense parameters), at ep=1
on one rank and at dp=2 x ep=2 on four ranks.

The experts are DTensors sharded over the ep mesh, so the checkpoint holds each expert weight
once with its global shape (not one rank's block saved as if the ranks held replicas), and DCP
reshards it, with the AdamW moments, to the layout of the resuming run. The data stream is
world-size independent and dropout is 0, so the continuation equals the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torsh_distributed.testing import run_distributed

STEPS = 6
MOE = {"num_experts": 4, "top_k": 2, "aux_loss_coef": 0.01, "z_loss_coef": 1e-3}


def _train(directory: str, parallel: dict[str, Any], resume: str) -> dict[str, Any]:
    from torsh_distributed.testing.configs import small_config, with_checkpoints
    from torsh_distributed.train import TrainConfig, train

    data = small_config(steps=STEPS).to_dict()
    data["moe"].update(MOE)
    data["parallel"].update(parallel)
    cfg = with_checkpoints(TrainConfig.from_dict(data), directory, every=3)
    if resume:
        cfg.checkpoint.resume = resume
    result = train(cfg)
    return {
        "losses": result.losses,
        "resumed_step": result.checkpoint.get("resumed_step"),
        "layout": result.layout,
        "d_model": cfg.model.d_model,
    }


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The uninterrupted ep=2 run on 2 ranks, saving at steps 3 and 6."""
    from torsh_distributed.checkpoint import step_dir_name

    root = tmp_path_factory.mktemp("moe-ckpt")
    runs = run_distributed(_train, 2, args=(str(root / "straight"), {"ep": 2}, ""), timeout=240)
    assert runs[0]["losses"] == runs[1]["losses"]
    return runs[0], root / "straight" / step_dir_name(3)


def test_the_checkpoint_holds_each_expert_weight_once_with_its_global_shape(
    straight: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run, step3 = straight
    assert run["layout"]["ep"] == 2
    dcp_to_torch_save(step3, tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=True)
    d_model = run["d_model"]
    shape = [4, d_model, 4 * d_model]
    w1 = state["model"]["blocks.0.mlp.experts.w1"]
    assert list(w1.shape) == shape
    assert list(state["model"]["blocks.0.mlp.experts.w2"].shape) == [4, 4 * d_model, d_model]
    # the two ep ranks' blocks are both there: different experts, not one rank's block twice
    assert not torch.equal(w1[:2], w1[2:])
    moments = state["optim"]["state"]["blocks.0.mlp.experts.w1"]
    for key in ("exp_avg", "exp_avg_sq"):
        assert list(moments[key].shape) == shape, key
        assert moments[key][2:].abs().sum() > 0, key  # ep rank 1's moments were written


@pytest.mark.parametrize(
    ("world", "parallel"),
    [(2, {"ep": 2}), (2, {"ep": 2, "zero_stage": 3}), (1, {}), (4, {"ep": 2})],
    ids=["ep2", "ep2-zero3", "ep1-one-rank", "dp2xep2"],
)
def test_resume_continues_exactly_on_another_ep_layout(
    straight: tuple[dict[str, Any], Path], tmp_path: Path, world: int, parallel: dict[str, Any]
) -> None:
    run, step3 = straight
    resumed = run_distributed(
        _train, world, args=(str(tmp_path / "resumed"), parallel, str(step3)), timeout=240
    )
    first = resumed[0]
    assert first["resumed_step"] == 3
    assert first["layout"]["ep"] == parallel.get("ep", 1)
    assert all(r["losses"] == first["losses"] for r in resumed), "ranks disagree"
    assert first["losses"][:3] == run["losses"][:3], "the resumed run reports the saved losses"
    assert first["losses"][3:] == pytest.approx(run["losses"][3:], rel=0, abs=1e-5)
