"""The expert rebalancer through the engine, on a user model with a deliberately skewed router
(:class:`~torsh_distributed.testing.models.SkewedMoENet`).

The router's selection bias sends every token to experts 0 and 1, which ep=2 places both on
rank 0: rank 1 computes nothing. With ``ep_rebalance_every`` the rebalancer must move one of
them to rank 1 (the ranks' load CV falls from 1), and the training losses must stay
bit-identical to the same run without migration (clipping off: the only computation whose
summation order a move changes is the global norm; with clipping on they agree within 1e-6).
A checkpoint written after a move resumes exactly, with the placement restored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from torsh_distributed.testing import run_distributed

STEPS = 8


def _train(
    every: int, clip: float, directory: str = "", resume: str = "", steps: int = STEPS, ep: int = 2
) -> dict[str, Any]:
    from torsh_distributed.checkpoint.config import CheckpointConfig
    from torsh_distributed.engine import Engine
    from torsh_distributed.engine.config import EngineConfig, OptimConfig
    from torsh_distributed.monitor.config import MonitorConfig
    from torsh_distributed.parallel.config import ParallelConfig
    from torsh_distributed.testing import models as M

    config = EngineConfig(
        max_steps=steps,
        batch_size=16,
        eval_batches=2,
        progress=False,
        optim=OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=clip),
        parallel=ParallelConfig(ep=ep, ep_rebalance_every=every),
        monitor=MonitorConfig(enabled=True, every=2),
        checkpoint=CheckpointConfig(dir=directory, every=3, resume=resume or "auto")
        if directory
        else CheckpointConfig(),
    )
    result = Engine(M.SkewedMoENet, dataset=M.classification_data(), config=config).fit()
    custom = (result.monitor or {}).get("custom", {})
    return {"losses": result.losses, "moe": result.moe, "ep_cv": custom.get("moe_ep_load_cv")}


def test_rebalancer_evens_the_ranks_and_keeps_the_losses():
    plain = run_distributed(_train, 2, args=(0, 0.0), timeout=180)[0]
    moved = run_distributed(_train, 2, args=(2, 0.0), timeout=180)[0]
    assert moved["losses"] == plain["losses"]  # bit-identical
    assert plain["moe"]["rebalance"] is None
    layer_plain, layer_moved = plain["moe"]["per_layer"][0], moved["moe"]["per_layer"][0]
    assert layer_plain["tokens_per_ep_rank"][1] == 0  # everything went to rank 0
    assert layer_plain["placement"] == [0, 1, 2, 3]
    rebalance = moved["moe"]["rebalance"]
    assert rebalance["moves"] == 1 and rebalance["moved_experts"] == 2  # one swap, then settled
    first = rebalance["windows"][0]
    # from all on one rank (CV 1) to the two busy experts on two ranks (CV = |a - b| / (a + b))
    assert first["cv_before"] == pytest.approx(1.0) and first["cv_after"] < 0.75
    assert all(w["moved"] == 0 for w in rebalance["windows"][1:])
    slots = layer_moved["placement"]
    assert slots[0] // 2 != slots[1] // 2  # the two busy experts now live on different ranks
    assert layer_moved["tokens_per_ep_rank"][1] > 0
    assert moved["moe"]["ep_load_cv"] < plain["moe"]["ep_load_cv"]
    # the step monitor sees it too (this rank's tokens over the ep ranks, last aggregation)
    assert plain["ep_cv"]["last"] == pytest.approx(1.0)
    assert moved["ep_cv"]["last"] < 0.9
    # identical routing: the same tokens per expert in both runs
    assert layer_moved["tokens_per_expert"] == layer_plain["tokens_per_expert"]


def test_with_clipping_the_losses_agree_closely():
    plain = run_distributed(_train, 2, args=(0, 0.5), timeout=180)[0]
    moved = run_distributed(_train, 2, args=(2, 0.5), timeout=180)[0]
    assert moved["moe"]["rebalance"]["moves"] == 1
    assert moved["losses"] == pytest.approx(plain["losses"], rel=1e-6)


def test_a_checkpoint_after_a_move_resumes_exactly(tmp_path: Path):
    from torsh_distributed.checkpoint import step_dir_name

    straight = run_distributed(_train, 2, args=(2, 0.0, str(tmp_path / "a")), timeout=180)[0]
    step6 = str(tmp_path / "a" / step_dir_name(6))  # written after the move at step 2
    resumed = run_distributed(_train, 2, args=(2, 0.0, str(tmp_path / "b"), step6), timeout=180)[0]
    assert resumed["losses"] == straight["losses"]
    assert resumed["moe"]["per_layer"][0]["placement"] == straight["moe"]["per_layer"][0]["placement"]
    # one process (ep=1) reads the moved experts through the saved placement
    single = run_distributed(_train, 1, args=(0, 0.0, str(tmp_path / "c"), step6, STEPS, 1), timeout=180)[0]
    assert single["losses"] == pytest.approx(straight["losses"], rel=1e-5)
