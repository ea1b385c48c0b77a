"""Expert parallelism on real Gloo ranks against a single-process reference, in fp64.

The reference is the unsharded layer (same seed) run in one process on every rank's batch in
turn; its loss is the mean of the per-rank losses (each the mean over that rank's tokens plus the
layer's aux and z losses). Every rank computes the reference itself and compares its own part:
outputs, dropped tokens, and gradients after the documented reductions (dense gradients averaged
over all ranks, expert gradients through ``reduce_expert_grads``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

import torsh_distributed as tdist
from torsh_distributed import DistributedTimeoutError
from torsh_distributed.comm.dims import ParallelDims
from torsh_distributed.parallel.expert import (
    apply_ep,
    expert_parameters,
    reduce_expert_grads,
    update_moe_biases,
)
from torsh_distributed.parallel.moe import MoE, MoEConfig
from torsh_distributed.testing import find_free_port, run_distributed

D = torch.float64
TOL = 1e-10


def _config(**kw: Any) -> MoEConfig:
    base: dict[str, Any] = {
        "num_experts": 8,
        "d_model": 6,
        "d_hidden": 10,
        "top_k": 2,
        "num_shared_experts": 1,
        "aux_loss_coef": 0.05,
        "z_loss_coef": 1e-3,
    }
    base.update(kw)
    return MoEConfig(**base)


def _make(cfg: MoEConfig) -> MoE:
    layer = MoE(cfg, dtype=D)
    torch.manual_seed(0)
    layer.reset_parameters()
    return layer


def _batch(rank: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(num_tokens, 6, dtype=D, generator=g)
    return x, torch.randn(num_tokens, 6, dtype=D, generator=g)


def _rank_loss(layer: MoE, y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over this rank's tokens (0 for none, still attached to the graph) + MoE losses."""
    assert layer.loss is not None
    return (y - target).square().sum() / max(y.shape[0], 1) + layer.loss


def _reference(cfg: MoEConfig, sizes: list[int]) -> tuple[MoE, list[torch.Tensor], list[Any]]:
    ref = _make(cfg)
    ref.train()
    outs, stats, losses = [], [], []
    for r, n in enumerate(sizes):
        x, target = _batch(r, n)
        y = ref(x)
        outs.append(y.detach())
        stats.append(ref.stats)
        losses.append(_rank_loss(ref, y, target))
    torch.stack(losses).mean().backward()
    return ref, outs, stats


def _grad(p: torch.Tensor) -> torch.Tensor:
    """The gradient of this rank's part (a DTensor expert's: its local shard)."""
    assert p.grad is not None
    return p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad


def _sharded_over(p: torch.Tensor, ep: int) -> bool:
    """An expert weight is a DTensor of the global shape, sharded Shard(0) over ep ranks."""
    return (
        isinstance(p, DTensor)
        and p.shape[0] == 8
        and p.to_local().shape[0] == 8 // ep
        and tuple(p.placements) == (Shard(0),)
        and p.device_mesh.size() == ep
    )


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.norm() / b.norm()).item()


def _ep_parity(cfg_kw: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(**cfg_kw)
    ref, ref_outs, ref_stats = _reference(cfg, sizes)

    model = apply_ep(_make(cfg))
    model.train()
    x, target = _batch(rank, sizes[rank])
    y = model(x)
    _rank_loss(model, y, target).backward()

    experts = expert_parameters(model)
    assert [id(p) for p in experts] == [id(model.experts.w1), id(model.experts.w2)]
    raw_w1 = _grad(model.experts.w1).clone()
    for p in model.parameters():
        if not getattr(p, "_torsh_expert", False):
            grad = _grad(p)
            dist.all_reduce(grad)
            grad /= world
    reduce_expert_grads(experts, group=None, dp=1, ep=world)

    lo, hi = rank * 8 // world, (rank + 1) * 8 // world
    ref_w1 = _grad(ref.experts.w1)[lo:hi]
    assert model.shared is not None and ref.shared is not None
    out: dict[str, Any] = {
        "local_experts": model.experts.num_local_experts,
        "dtensor": all(_sharded_over(p, world) for p in experts),
        "out": _max_err(y, ref_outs[rank]),
        "router": _max_err(_grad(model.router.weight), _grad(ref.router.weight)),
        "shared": _max_err(_grad(model.shared.w1.weight), _grad(ref.shared.w1.weight)),
        "w1": _max_err(_grad(model.experts.w1), ref_w1),
        "w2": _max_err(_grad(model.experts.w2), _grad(ref.experts.w2)[lo:hi]),
        "w1_ratio": _ratio(_grad(model.experts.w1), ref_w1),
        "raw_w1_ratio": _ratio(raw_w1, ref_w1),
        "stats": model.stats,
        "ref_stats": ref_stats[rank],
    }
    if not cfg.capacity_factor:  # dropless: the layer fed all tokens at once gives the same
        full = _make(cfg)(torch.cat([_batch(r, n)[0] for r, n in enumerate(sizes)])).detach()
        out["concat"] = _max_err(torch.cat(ref_outs), full)
    return out


def _check(results: list[dict[str, Any]], ep: int) -> None:
    for rank, res in enumerate(results):
        assert res["local_experts"] == 8 // ep
        assert res["dtensor"], rank
        for key in ("out", "router", "shared", "w1", "w2", "concat"):
            assert res.get(key, 0.0) < TOL, (rank, key, res[key])
        assert res["stats"] == res["ref_stats"], rank  # same routing, same drops
        # Not scaled by ep: the all-to-all backward sums ep ranks' contributions (raw = ep x the
        # right gradient) and reduce_expert_grads divides them out.
        assert res["w1_ratio"] == pytest.approx(1.0, abs=1e-9), rank
        assert res["raw_w1_ratio"] == pytest.approx(float(ep), abs=1e-9), rank


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_ep_matches_single_process_dropless(ep: int) -> None:
    results = run_distributed(_ep_parity, ep, args=({}, [10] * ep), timeout=120)
    _check(results, ep)
    assert all(r["stats"].dropped == 0 for r in results)


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_capacity_drops_what_the_reference_drops(ep: int) -> None:
    sizes = [16, 9, 12, 5][:ep]
    kw = {"capacity_factor": 1.0, "score": "sigmoid"}
    results = run_distributed(_ep_parity, ep, args=(kw, sizes), timeout=120)
    _check(results, ep)
    assert sum(r["stats"].dropped for r in results) > 0  # the capacity did bind


@pytest.mark.parametrize(
    ("sizes", "kw"),
    [([0, 9], {}), ([7, 0, 13, 2], {"capacity_factor": 1.25})],
    ids=["ep2-dropless", "ep4-capacity"],
)
def test_ep_uneven_tokens_with_an_empty_rank(sizes: list[int], kw: dict[str, Any]) -> None:
    results = run_distributed(_ep_parity, len(sizes), args=(kw, sizes), timeout=120)
    _check(results, len(sizes))
    empty = results[sizes.index(0)]["stats"]
    assert sum(empty.routed_per_expert) == 0


def _dp_ep() -> dict[str, Any]:
    """dp=2 x ep=2 on 4 ranks: rank = dp_index * 2 + ep_index."""
    rank = dist.get_rank()
    dims = ParallelDims(dp=2, ep=2).build()
    ep_rank = dist.get_rank(dims.group("ep"))
    sizes = [6, 11, 8, 3]
    cfg = _config(capacity_factor=1.5, bias_update_rate=0.01)
    ref, ref_outs, _ = _reference(cfg, sizes)

    # Built on meta and sharded before materialising: each rank allocates only its experts,
    # which must get their slice of the unsharded initialisation.
    model = apply_ep(MoE(cfg, device="meta", dtype=D), dims.mesh["ep"])
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    model.train()
    x, target = _batch(rank, sizes[rank])
    y = model(x)
    _rank_loss(model, y, target).backward()
    experts = expert_parameters(model)
    for p in model.parameters():
        if not getattr(p, "_torsh_expert", False):
            grad = _grad(p)
            dist.all_reduce(grad)
            grad /= 4
    # What a DDP over the expert-data-parallel group would give: the mean over dp only.
    dp_mean = _grad(model.experts.w1).clone()
    dist.all_reduce(dp_mean, group=dims.group("dp"))
    dp_mean /= 2
    with pytest.raises(ValueError, match=r"dp \(4\) must equal the size of group \(2\)"):
        reduce_expert_grads(experts, group=dims.group("dp"), dp=4, ep=1)
    reduce_expert_grads(experts, group=dims.group("dp"), dp=2, ep=2)

    update_moe_biases(model)  # loads summed over all 4 ranks
    ref.update_bias()  # the reference saw all 4 batches

    lo, hi = ep_rank * 4, (ep_rank + 1) * 4
    ref_w1 = _grad(ref.experts.w1)[lo:hi]
    return {
        "ep_rank": ep_rank,
        "dtensor": all(_sharded_over(p, 2) for p in experts),
        "init_is_slice": torch.equal(model.experts.w1.to_local(), ref.experts.w1[lo:hi])
        and torch.equal(model.experts.w2.to_local(), ref.experts.w2[lo:hi]),
        "out": _max_err(y, ref_outs[rank]),
        "router": _max_err(_grad(model.router.weight), _grad(ref.router.weight)),
        "w1": _max_err(_grad(model.experts.w1), ref_w1),
        "w2": _max_err(_grad(model.experts.w2), _grad(ref.experts.w2)[lo:hi]),
        "w1_ratio": _ratio(_grad(model.experts.w1), ref_w1),
        "dp_mean_ratio": _ratio(dp_mean, ref_w1),
        "bias": _max_err(model.expert_bias, ref.expert_bias),
        "bias_moved": ref.expert_bias.abs().sum().item(),
    }


def test_dp2_ep2_reduce_expert_grads_is_not_scaled_by_ep() -> None:
    results = run_distributed(_dp_ep, 4, timeout=120)
    assert [r["ep_rank"] for r in results] == [0, 1, 0, 1]
    for rank, res in enumerate(results):
        for key in ("out", "router", "w1", "w2", "bias"):
            assert res[key] < TOL, (rank, key, res[key])
        assert res["w1_ratio"] == pytest.approx(1.0, abs=1e-9)
        assert res["dp_mean_ratio"] == pytest.approx(2.0, abs=1e-9)  # pytorch#160285
        assert res["bias_moved"] > 0
        assert res["dtensor"] and res["init_is_slice"], rank  # meta init: exactly its slice


def _indivisible() -> str:
    if dist.get_rank() == 1:
        return "rank 1 never communicates"  # rank 0 must fail without waiting for it
    try:
        apply_ep(MoE(_config(num_experts=3)))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_apply_ep_rejects_indivisible_experts_before_communicating() -> None:
    msg, _ = run_distributed(_indivisible, 2, timeout=60)
    assert msg == "num_experts (3) of MoE layer '<root>' must be divisible by ep (2)"


def _missing_peer(port: int, done: str) -> Any:
    tdist.shutdown()  # re-init with a 3 s collective timeout
    rank = int(os.environ["RANK"])
    tdist.init(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout=3)
    if rank == 1:  # never joins the dispatch; returns once rank 0 is done
        deadline = time.monotonic() + 30
        while not Path(done).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return "waited"
    model = apply_ep(_make(_config()))
    start = time.monotonic()
    try:
        model(_batch(0, 5)[0])
    except DistributedTimeoutError as exc:
        return str(exc), time.monotonic() - start
    finally:
        Path(done).touch()
    return "no error", time.monotonic() - start


def test_a_peer_that_never_arrives_raises_within_the_timeout(tmp_path: Path) -> None:
    args = (find_free_port(), str(tmp_path / "done"))
    (msg, elapsed), _ = run_distributed(_missing_peer, 2, args=args, timeout=60)
    assert msg.startswith("[rank 0, all_to_all_single] all_to_all_single on world timed out")
    # the 3 s collective timeout, not rank 1's 30 s wait for rank 0 (which it would reach if the
    # timeout were not honoured); the upper bound leaves a busy host 17 s of scheduling
    assert 2.5 < elapsed < 20.0
