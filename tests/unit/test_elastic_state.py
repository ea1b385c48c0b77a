"""ElasticState in one process: repeated restores, values checked when set, the package export."""

from __future__ import annotations

import pytest
import torch

from torsh_distributed import elastic


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(2, 3)).pow(2).sum().backward()
    optimizer.step()


def test_every_restore_returns_to_the_commit_after_further_steps():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    state = elastic.ElasticState(model=model, optimizer=optimizer, step=0)
    _step(model, optimizer)
    state.step = 1
    state.commit()
    committed = (
        model.weight.detach().clone(),
        optimizer.state[model.weight]["exp_avg"].clone(),
    )
    for _ in range(2):  # the second round fails if the first restore aliased the snapshot
        _step(model, optimizer)
        _step(model, optimizer)
        state.step = 3
        state.restore()
        assert state.step == 1
        assert torch.equal(model.weight, committed[0])
        assert torch.equal(optimizer.state[model.weight]["exp_avg"], committed[1])


def test_values_must_be_json_when_set_not_at_the_next_durable_commit():
    state = elastic.ElasticState(epoch=0, history=[])
    state.history.append(1.5)  # mutable values are committed by deep copy
    state.commit()
    state.history.append(2.5)
    state.restore()
    assert state.history == [1.5]
    with pytest.raises(TypeError, match="value 'loss' must be JSON-serialisable.*got Tensor"):
        state.loss = torch.tensor(1.0)
    with pytest.raises(TypeError, match="values must be JSON-serialisable"):
        elastic.ElasticState(rng=object())
    assert state.values == {"epoch": 0, "history": [1.5]}


# --- scheduler, loss scaler and compressor -----------------------------------------------------


def _companions(seed: int, manager=None):
    from torsh_distributed.compression.build import build_compressor

    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    compressor = build_compressor("topk:0.5", error_feedback=True)
    state = elastic.ElasticState(
        model=model, optimizer=optimizer, manager=manager, scheduler=scheduler, scaler=scaler,
        compressor=compressor, step=0,
    )  # fmt: skip
    return state


def _advance(state) -> None:
    """One step that changes every companion: scaler growth, scheduler, compressor residual."""
    state.optimizer.zero_grad()
    state.scaler.scale(state.model(torch.ones(2, 3)).pow(2).sum()).backward()
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.scheduler.step()
    grad = torch.cat([p.grad.reshape(-1) for p in state.model.parameters()])
    state.compressor.compress(grad, key=0)
    state.step += 1


def _fingerprint(state) -> dict:
    return {
        "lr": state.optimizer.param_groups[0]["lr"],
        "scheduler": state.scheduler.state_dict(),
        "scale": state.scaler.get_scale(),
        "residual": state.compressor.state_dict()["residuals"]["0"].clone(),
    }


def _same(a: dict, b: dict) -> bool:
    return (
        a["lr"] == b["lr"] and a["scheduler"] == b["scheduler"] and a["scale"] == b["scale"]
        and torch.equal(a["residual"], b["residual"])
    )  # fmt: skip


def test_restore_rolls_back_scheduler_scaler_and_compressor():
    state = _companions(0)
    for _ in range(3):
        _advance(state)
    state.commit()
    committed = _fingerprint(state)
    for _ in range(2):  # twice: a restore that aliased the snapshot fails the second round
        _advance(state)
        _advance(state)
        assert not _same(_fingerprint(state), committed)
        state.restore()
        assert _same(_fingerprint(state), committed)


def test_durable_commit_restores_scheduler_scaler_and_compressor_exactly(tmp_path):
    from torsh_distributed.checkpoint import CheckpointManager

    state = _companions(0, CheckpointManager(tmp_path, async_save=False))
    for _ in range(3):
        _advance(state)
    state.commit(step=state.step)
    committed = _fingerprint(state)
    for _ in range(2):
        _advance(state)
    # a restarted process: fresh objects, then the newest checkpoint
    again = _companions(1, CheckpointManager(tmp_path, async_save=False))
    assert again.load_latest() == 3 and again.step == 3
    assert _same(_fingerprint(again), committed)
    _advance(again)  # and it continues as the original did from the commit
    original = _companions(0)
    for _ in range(4):
        _advance(original)
    assert _same(_fingerprint(again), _fingerprint(original))


def test_companions_must_be_stateful_and_json_where_saved_as_json(tmp_path):
    from torsh_distributed.checkpoint import CheckpointManager

    with pytest.raises(TypeError, match="scheduler must have state_dict\\(\\) and load_state_dict"):
        elastic.ElasticState(scheduler=object())

    class Opaque:
        def state_dict(self) -> dict:
            return {"fn": object()}

        def load_state_dict(self, state: dict) -> None:
            pass

    model = torch.nn.Linear(2, 2)
    state = elastic.ElasticState(
        model=model, manager=CheckpointManager(tmp_path, async_save=False), scaler=Opaque()
    )
    with pytest.raises(TypeError, match="state_dict\\(\\) of scaler must be JSON-serialisable"):
        state.commit(step=1)
