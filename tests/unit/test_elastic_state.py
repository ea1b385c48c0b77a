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
