"""Pipeline stages of any model, cut at split points named by module.

A user transformer (blocks in ``layers``, not ``blocks``) and an ``nn.Sequential`` MLP, split
on 2 ranks, give the unsplit model's loss, gradients and updated parameters on the same batch,
under the unsplit names; interleaved 1F1B with 2 stages per rank too, with a merged
``state_module()``. Without a process group: the pruning and every invalid split.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torsh_distributed.parallel.pipeline import (
    check_split_points,
    even_split_points,
    stage_module,
)
from torsh_distributed.testing import run_distributed

TOL = 1e-4
VOCAB, WIDTH, SEQ = 32, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    """Embedding, ``layers``, norm, head: written to the pipeline's None-skipping contract."""

    def __init__(self, n_layer: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(n_layer))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


class Nested(nn.Module):
    """GPT-2's layout: the blocks at ``transformer.h``, the head outside ``transformer``."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, WIDTH),
                "h": nn.ModuleList(Block() for _ in range(4)),
                "ln_f": nn.LayerNorm(WIDTH),
            }
        )
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        h = t["wte"](x) if t["wte"] is not None else x
        for block in t["h"]:
            h = block(h)
        h = t["ln_f"](h) if t["ln_f"] is not None else h
        return self.lm_head(h) if self.lm_head is not None else h


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _case(kind: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, object]:
    """The model (seeded), a batch of 8 and the loss of ``kind``."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if kind == "mlp":
        x = torch.randn(8, WIDTH, generator=gen)
        return mlp(), x, torch.randint(0, 4, (8,), generator=gen), F.cross_entropy
    x, y = (torch.randint(0, VOCAB, (8, SEQ), generator=gen) for _ in range(2))
    return Net(4), x, y, lm_loss


def _pipeline_step(
    kind: str, points: list[str] | None, schedule: str, virtual: int
) -> dict[str, object]:
    import torch.distributed as dist

    from torsh_distributed.parallel.pipeline import build_pipeline

    reference, x, y, loss_fn = _case(kind)
    model, _, _, _ = _case(kind)
    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()
    runner = build_pipeline(
        model,
        split_points=points,
        pp_rank=dist.get_rank(),
        pp=2,
        group=None,
        device=torch.device("cpu"),
        schedule=schedule,
        microbatches=2,
        virtual_stages=virtual,
        loss_fn=loss_fn,
    )
    loss = runner.step(x, y)
    ref = dict(reference.named_parameters())
    named = [(n, p) for m in runner.modules for n, p in m.named_parameters()]
    grad_err = max(float((p.grad - ref[n].grad).abs().max()) for n, p in named)
    for opt in (torch.optim.SGD(runner.parameters(), lr=0.5), torch.optim.SGD(ref.values(), lr=0.5)):
        opt.step()
    param_err = max(float((p - ref[n]).abs().max()) for n, p in named)
    state = runner.state_module().state_dict(keep_vars=True)
    return {
        "loss": None if loss is None else float(loss),
        "ref_loss": float(ref_loss),
        "grad_err": grad_err,
        "param_err": param_err,
        "names": [n for n, _ in named],
        "state_keys": list(state),
        # the merged view shares the stages' tensors (loading into it loads the stages)
        "state_shared": all(
            any(t is p for m in runner.modules for p in [*m.parameters(), *m.buffers()])
            for t in state.values()
        ),
        "has": (runner.has_first, runner.has_last),
    }


def _check_parity(results: list[dict], kind: str) -> None:
    reference, *_ = _case(kind)
    assert results[0]["has"] == (True, False) and results[1]["has"] == (False, True)
    assert results[0]["loss"] is None
    assert results[1]["loss"] == pytest.approx(results[1]["ref_loss"], rel=TOL, abs=TOL)
    for rank, r in enumerate(results):
        assert r["grad_err"] < TOL, f"rank {rank}: gradients differ by {r['grad_err']}"
        assert r["param_err"] < TOL, f"rank {rank}: updated parameters differ by {r['param_err']}"
        assert r["state_shared"], f"rank {rank}: state_module copied tensors"
    # each parameter on exactly one rank, under the unsplit model's name
    names = results[0]["names"] + results[1]["names"]
    assert sorted(names) == sorted(n for n, _ in reference.named_parameters())


@pytest.mark.parametrize(
    ("kind", "points", "rank0_keys"),
    [
        ("net", ["layers.1"], ["embed.weight", "layers.0.norm.weight"]),  # uneven: 1 + 3 blocks
        ("mlp", ["2"], ["0.weight", "0.bias"]),
    ],
)
def test_two_stages_match_unsplit_model(kind: str, points: list[str], rank0_keys: list[str]) -> None:
    results = run_distributed(_pipeline_step, 2, args=(kind, points, "1f1b", 1), timeout=120)
    _check_parity(results, kind)
    reference, *_ = _case(kind)
    whole = list(reference.state_dict())
    assert results[0]["state_keys"][:2] == rank0_keys
    # the two ranks' state dicts partition the whole model's, in its order
    assert results[0]["state_keys"] + results[1]["state_keys"] == whole


def test_interleaved_two_stages_per_rank_matches_unsplit_model() -> None:
    # even split of 4 layers into 4 stages: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    results = run_distributed(_pipeline_step, 2, args=("net", None, "interleaved", 2), timeout=120)
    _check_parity(results, "net")
    whole = list(Net(4).state_dict())

    def held(prefixes: tuple[str, ...]) -> list[str]:
        return [k for k in whole if k.startswith(prefixes)]

    assert results[0]["state_keys"] == held(("embed.", "layers.0.", "layers.2."))
    assert results[1]["state_keys"] == held(("layers.1.", "layers.3.", "norm.", "head."))


# --- without a process group: split resolution and pruning ---


def _chain(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


def test_pruned_stages_keep_original_keys_and_compose_to_the_model() -> None:
    torch.manual_seed(0)
    model = Net(4)
    split = check_split_points(model, ["layers.3"], num_stages=2)
    assert split.container == "layers" and split.split_points == ["layers.3"]
    first, last = (stage_module(model, split, s) for s in range(2))
    assert list(first.layers._modules) == ["0", "1", "2"] and list(last.layers._modules) == ["3"]
    assert first.norm is None and first.head is None and last.embed is None
    assert [n for n, _ in last.named_parameters()][:2] == ["layers.3.norm.weight", "layers.3.norm.bias"]
    # the original is unchanged, and the stages are copies
    assert len(model.layers) == 4 and model.norm is not None
    assert first.embed.weight is not model.embed.weight
    x = torch.randint(0, VOCAB, (2, SEQ))
    assert torch.equal(_chain([first, last], x), model(x))


def test_nested_container_prunes_each_ancestor_level() -> None:
    torch.manual_seed(0)
    model = Nested()
    assert even_split_points(model, 2) == ["transformer.h.2"]
    split = check_split_points(model, None, num_stages=2)
    first, last = (stage_module(model, split, s) for s in range(2))
    # before `h` in `transformer`: first stage; after it (ln_f) and after `transformer`: last
    assert first.transformer["wte"] is not None and first.transformer["ln_f"] is None
    assert first.lm_head is None
    assert last.transformer["wte"] is None and last.transformer["ln_f"] is not None
    assert list(last.transformer["h"]._modules) == ["2", "3"]
    names = [n for s in (first, last) for n, _ in s.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    x = torch.randint(0, VOCAB, (2, SEQ))
    assert torch.equal(_chain([first, last], x), model(x))


def test_sequential_split_by_entry_name() -> None:
    torch.manual_seed(0)
    model = mlp()
    split = check_split_points(model, ["1", "4"], num_stages=3)
    assert split.container == "" and split.stages == (("0",), ("1", "2", "3"), ("4",))
    stages = [stage_module(model, split, s) for s in range(3)]
    assert [list(s._modules) for s in stages] == [["0"], ["1", "2", "3"], ["4"]]
    x = torch.randn(3, WIDTH)
    assert torch.equal(_chain(stages, x), model(x))


def test_even_split_points() -> None:
    assert even_split_points(Net(4), 2) == ["layers.2"]
    assert even_split_points(Net(4), 4) == ["layers.1", "layers.2", "layers.3"]
    assert even_split_points(Net(4), 1) == []
    with pytest.raises(ValueError, match=r"the 4 entries of 'layers' \(layers.0 .. layers.3\) "
                       r"do not split evenly into 3 pipeline stages"):
        even_split_points(Net(4), 3)
    # Linear, Tanh, ...: no container whose entries share one type
    with pytest.raises(ValueError, match=r"cannot split Sequential evenly .* no container of "
                       r"repeated blocks.*give split points"):
        even_split_points(mlp(), 2)
    with pytest.raises(ValueError, match=r"num_stages must be >= 1; got 0"):
        even_split_points(Net(4), 0)


class TwoLists(Net):
    def __init__(self) -> None:
        super().__init__(4)
        self.extra = nn.ModuleList(Block() for _ in range(2))


class RootParam(Net):
    def __init__(self) -> None:
        super().__init__(4)
        self.scale = nn.Parameter(torch.ones(WIDTH))


class NestedBuffer(Nested):
    def __init__(self) -> None:
        super().__init__()
        self.transformer.register_buffer("mask", torch.ones(SEQ))


class Tied(Net):
    def __init__(self) -> None:
        super().__init__(4)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize(
    ("model", "points", "stages", "match"),
    [
        (Net, ["layer.9"], 2, r"pp split point 'layer.9' names no module of Net "
         r"\(entries of 'layers': layers.0 .. layers.3\)"),
        (Net, ["layers.9"], 2, r"'layers.9' names no module of Net \(entries of 'layers'"),
        (Net, ["layers.1.fc"], 2, r"'layers.1.fc' is not an entry of a container \(nn.ModuleList, "
         r"nn.ModuleDict or nn.Sequential\): 'layers.1' is a Block"),
        (Net, ["head"], 2, r"'head' is not an entry of a container .*: the model is a Net"),
        (Net, [""], 2, r"pp split point '' is Net itself"),
        (TwoLists, ["layers.2", "extra.1"], 3, r"entries of one container of blocks; got "
         r"'layers.2' in 'layers', 'extra.1' in 'extra'"),
        (Net, ["layers.2", "layers.1"], 3, r"must be strictly increasing in the order of 'layers'"),
        (Net, ["layers.2", "layers.2"], 3, r"must be strictly increasing"),
        (Net, ["layers.0"], 2, r"'layers.0' is the first entry of 'layers': stage 0 would be empty"),
        (Net, ["layers.1"], 3, r"name 1 modules; 3 pipeline stages \(pp x virtual_stages\) need 2"),
        (Net, ["layers.1", "layers.2"], 2, r"name 2 modules; 2 pipeline stages"),
        (Net, None, 3, r"the 4 entries of 'layers' .* do not split evenly into 3"),
        (Net, ["layers.1"], 0, r"num_stages must be >= 1; got 0"),
        (RootParam, ["layers.2"], 2, r"RootParam holds parameters or buffers directly on the path "
         r"to its container of blocks 'layers': 'scale'"),
        (NestedBuffer, ["transformer.h.2"], 2, r"directly .* 'transformer.mask'"),
        (Tied, ["layers.2"], 2, r"parameter 'embed.weight' = 'head.weight' of Tied is shared by "
         r"stages 0, 1"),
    ],
)
def test_invalid_split_points(
    model: type[nn.Module], points: list[str] | None, stages: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        check_split_points(model(), points, num_stages=stages)


def test_split_point_must_be_a_name() -> None:
    with pytest.raises(TypeError, match=r"module names like 'layers.4'; got 2 \(int\)"):
        check_split_points(Net(4), [2], num_stages=2)


def test_stage_index_is_checked() -> None:
    split = check_split_points(Net(4), ["layers.2"], num_stages=2)
    with pytest.raises(ValueError, match=r"stage 2 is not in \[0, 2\)"):
        stage_module(Net(4), split, 2)
