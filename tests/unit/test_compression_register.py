"""register_compression for a user's own loop: one-process no-op, spec strings, clear errors,
and observe_loss reaching ``auto``."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.compression import (
    Adaptive,
    CompressionHook,
    TopK,
    find_compression,
    register_compression,
)
from torsh_distributed.testing import run_distributed


def test_one_process_registers_nothing_and_stays_quiet():
    assert not dist.is_initialized()
    model = nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same script on one process must not nag
        assert register_compression(model, "powersgd:4") is None
        assert register_compression(model, TopK(0.5)) is None
    assert find_compression(model) is None
    model(torch.ones(1, 4)).sum().backward()  # plain training still works
    assert model.weight.grad is not None


def test_a_bad_spec_or_object_fails_even_on_one_process():
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="unknown compression spec 'topk0.01'"):
        register_compression(model, "topk0.01")
    with pytest.raises(ValueError, match="topk ratio must be in"):
        register_compression(model, "topk:2")
    with pytest.raises(TypeError, match="must be a Compressor or a spec string.*got float"):
        register_compression(model, 0.01)  # type: ignore[arg-type]


class _Recording(TopK):
    def __init__(self) -> None:
        super().__init__(0.5)
        self.seen: list[float] = []

    def observe_loss(self, loss: float) -> None:
        self.seen.append(loss)


def test_observe_loss_reaches_a_compressor_that_wants_it_and_is_a_no_op_otherwise():
    recording = _Recording()
    CompressionHook(recording).observe_loss(torch.tensor(2.5))  # type: ignore[arg-type]
    assert recording.seen == [2.5] and isinstance(recording.seen[0], float)
    auto = Adaptive(window=3)
    hook = CompressionHook(auto)
    for loss in (3.0, 2.0, 1.0, 0.5):
        hook.observe_loss(loss)
    assert auto.losses == [2.0, 1.0, 0.5]  # auto keeps its stability window
    CompressionHook(TopK(0.5)).observe_loss(1.0)  # no observe_loss: nothing happens, no error


def _register_on_two_ranks() -> dict:
    torch.manual_seed(0)
    rank = dist.get_rank()
    out: dict = {}
    # spec strings build the compressor the spec names
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 8))
    hook = register_compression(model, "powersgd:2")
    assert hook is not None and find_compression(model) is hook
    out["powersgd"] = (type(hook.compressor).__name__, hook.compressor.rank)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(grads) for _ in range(2)]
    dist.all_gather(gathered, grads)
    out["same_grads"] = torch.equal(gathered[0], gathered[1])
    out["steps"] = hook.steps
    topk = register_compression(nn.parallel.DistributedDataParallel(nn.Linear(4, 2)), "topk:0.1")
    out["topk"] = (type(topk.compressor).__name__, type(topk.compressor.inner).__name__)
    # a model DDP does not wrap exchanges nothing: an error, not a silent no-op
    try:
        register_compression(nn.Linear(4, 2), "topk:0.01")
    except ValueError as exc:
        out["plain_error"] = str(exc)
    # a DDP group of one rank inside a larger world: nothing to compress, said out loud
    groups = [dist.new_group([r]) for r in range(2)]
    alone = nn.parallel.DistributedDataParallel(nn.Linear(4, 2), process_group=groups[rank])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["alone"] = register_compression(alone, "int8")
    out["alone_warnings"] = [str(w.message) for w in caught]
    return out


def test_spec_strings_and_errors_on_two_ranks():
    for out in run_distributed(_register_on_two_ranks, 2, timeout=120):
        assert out["powersgd"] == ("PowerSGD", 2)
        assert out["topk"] == ("ErrorFeedback", "TopK")  # topk's default error feedback
        assert out["same_grads"] and out["steps"] == 1
        assert "register_compression needs a DistributedDataParallel model" in out["plain_error"]
        assert "got Linear in a world of 2 ranks" in out["plain_error"]
        assert out["alone"] is None
        assert any("process group has one rank" in w for w in out["alone_warnings"])

