"""Parameter server pieces in one process: the server optimizer equals torch.optim (dense keys
and the lazy row path with every row touched) within 1e-12 in fp64; configs refuse bad values;
sharding is stable and covers every row once; snapshots are atomic and tensor-only."""

from __future__ import annotations

import json

import pytest
import torch

from torsh_distributed.ps import PSConfig, ServerOptimConfig, TableSpec, _shard
from torsh_distributed.ps._optim import ServerOptimizer
from torsh_distributed.ps._snapshot import read_latest, write_snapshot

CASES = {
    "sgd-momentum": (ServerOptimConfig(kind="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
                     lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)),
    "adagrad": (ServerOptimConfig(kind="adagrad", lr=0.05, eps=1e-10, weight_decay=0.01),
                lambda p: torch.optim.Adagrad([p], lr=0.05, eps=1e-10, weight_decay=0.01, foreach=False)),
    "adam": (ServerOptimConfig(kind="adam", lr=0.01, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.01),
             lambda p: torch.optim.Adam([p], lr=0.01, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.01,
                                        foreach=False)),
    "adamw": (ServerOptimConfig(kind="adamw", lr=0.01, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1),
              lambda p: torch.optim.AdamW([p], lr=0.01, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1,
                                          foreach=False)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("path", ["dense", "rows"])
def test_server_optimizer_equals_torch_optim(name, path):
    cfg, make = CASES[name]
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(6, 5, dtype=torch.float64, generator=gen)
    ref = init.clone().requires_grad_(True)
    opt = make(ref)
    mine = init.clone()
    server = ServerOptimizer(cfg)
    for _ in range(7):
        grad = torch.randn(6, 5, dtype=torch.float64, generator=gen)
        ref.grad = grad.clone()
        opt.step()
        if path == "dense":
            server.update_dense("w", mine, grad.clone())
        else:
            server.update_rows("w", mine, torch.arange(6), grad.clone())
    torch.testing.assert_close(mine, ref.detach(), rtol=0, atol=1e-12)


def test_a_schedule_and_matrix_only_decay_equal_the_engines_adamw_groups():
    lrs = (0.01, 0.02, 0.03, 0.015, 0.005)  # a warm-up then a decay, one lr per step
    cfg = ServerOptimConfig(kind="adamw", lr=0.03, lrs=lrs, beta2=0.95, weight_decay=0.1, decay_matrices_only=True)
    gen = torch.Generator().manual_seed(0)
    init = {"w": torch.randn(4, 3, dtype=torch.float64, generator=gen), "b": torch.randn(3, dtype=torch.float64, generator=gen)}
    ref = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    opt = torch.optim.AdamW([{"params": [ref["w"]], "weight_decay": 0.1}, {"params": [ref["b"]], "weight_decay": 0.0}],
                            lr=0.03, betas=(0.9, 0.95), foreach=False)
    server = ServerOptimizer(cfg)
    mine = {k: v.clone() for k, v in init.items()}
    for lr in lrs:
        for group in opt.param_groups:
            group["lr"] = lr
        for key in mine:
            grad = torch.randn(init[key].shape, dtype=torch.float64, generator=gen)
            ref[key].grad = grad.clone()
            server.update_dense(key, mine[key], grad, lr=lr)
        opt.step()
    for key in mine:
        torch.testing.assert_close(mine[key], ref[key].detach(), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"lrs\[1\] must be >= 0 and finite"):
        ServerOptimConfig(lrs=(0.1, -1.0))


def test_synchronous_mean_clipping_through_several_servers_is_refused():
    from torsh_distributed.ps.config import check_clip_mean

    optim = ServerOptimConfig(clip_norm=1.0, clip_mean=True)
    with pytest.raises(ValueError, match=r"through 2 servers with 2 workers cannot clip the step's mean gradient"):
        check_clip_mean(optim, PSConfig(num_servers=2), num_workers=2)
    check_clip_mean(optim, PSConfig(num_servers=2), num_workers=1)  # one worker's push is the mean
    check_clip_mean(optim, PSConfig(num_servers=1), num_workers=2)  # the server holds the mean
    check_clip_mean(optim, PSConfig(num_servers=2, staleness=2), num_workers=2)  # SSP clips each push


def test_lazy_rows_leave_untouched_rows_and_state_alone():
    server = ServerOptimizer(ServerOptimConfig(kind="adam", lr=0.1))
    table = torch.zeros(5, 3, dtype=torch.float64)
    server.update_rows("e", table, torch.tensor([1, 3]), torch.ones(2, 3, dtype=torch.float64))
    assert table[[0, 2, 4]].abs().sum() == 0 and table[[1, 3]].abs().sum() > 0
    assert server.state["e"]["step"].tolist() == [0, 1, 0, 1, 0]


def test_configs_validate_at_construction():
    with pytest.raises(ValueError, match="kind must be one of"):
        ServerOptimConfig(kind="rmsprop")
    with pytest.raises(ValueError, match="beta2 must be in"):
        ServerOptimConfig(beta2=1.0)
    with pytest.raises(ValueError, match="staleness must be -1"):
        PSConfig(num_servers=1, staleness=-2)
    with pytest.raises(ValueError, match="num_servers must be >= 1"):
        PSConfig(num_servers=0)
    with pytest.raises(ValueError, match="snapshot_every > 0 needs snapshot_dir"):
        PSConfig(num_servers=1, snapshot_every=3)
    with pytest.raises(ValueError, match="set token"):
        PSConfig(num_servers=1, host="0.0.0.0")
    assert PSConfig(num_servers=1, host="0.0.0.0", token="s3cret").mode == "sync"
    assert PSConfig(num_servers=2, staleness=-1).mode == "async"
    with pytest.warns(UserWarning, match="momentum=0.9 is ignored"):
        ServerOptimConfig(kind="adam", momentum=0.9)
    with pytest.raises(ValueError, match="partition must be one of"):
        TableSpec(num_rows=4, dim=2, partition="hash")


@pytest.mark.parametrize("partition", ["mod", "range"])
def test_rows_are_owned_once_and_map_back(partition):
    spec = TableSpec(num_rows=23, dim=2, partition=partition)
    ids = torch.arange(23)
    seen = torch.zeros(23, dtype=torch.int64)
    for k, pos in enumerate(_shard.split_rows(ids, spec, 3)):
        owned = ids[pos]
        seen[owned] += 1
        assert len(owned) == _shard.num_local_rows(spec, k, 3)
        local = _shard.local_rows(owned, spec, 3)
        assert torch.equal(_shard.global_rows(spec, k, 3)[local], owned)
    assert seen.eq(1).all()


def test_dense_keys_hash_stably():
    assert _shard.server_of_key("layer.0.weight", 4) == _shard.server_of_key("layer.0.weight", 4)
    assert {_shard.server_of_key(f"k{i}", 4) for i in range(40)} == {0, 1, 2, 3}


def test_snapshots_are_atomic_and_keep_the_newest(tmp_path):
    write_snapshot(tmp_path, 3, {"dense/w": torch.ones(2)}, {"applied": 3})
    write_snapshot(tmp_path, 6, {"dense/w": torch.full((2,), 6.0)}, {"applied": 6})
    (tmp_path / "snap-00000009.pt").write_bytes(b"half-written, no JSON names it")
    tensors, meta = read_latest(tmp_path)
    assert meta["applied"] == 6 and tensors["dense/w"].tolist() == [6.0, 6.0]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json") == ["snap-00000006.json"]
    assert json.loads((tmp_path / "snap-00000006.json").read_text())["tensors"] == "snap-00000006.pt"
