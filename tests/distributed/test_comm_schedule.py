"""``--comm-schedule priority`` (PriorityDataParallel) is bit-identical to DDP (``fifo``) on 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.testing import run_distributed


class _Net(nn.Module):
    """Embedding, a few linear layers of mixed sizes (tensors cut and merged into chunks), a
    tied output (one parameter read by two modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 24)
        self.blocks = nn.Sequential(
            nn.Linear(24, 96), nn.GELU(), nn.Linear(96, 24), nn.LayerNorm(24), nn.Linear(24, 24)
        )
        self.head = nn.Linear(24, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(x)))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 50, (4, 6), generator=g)
    return x, torch.roll(x, 1, dims=1)


def _train(
    schedule: str, optimizer: str, clip: float, partition: int, steps: int, probe_every: int = 0
) -> dict:
    from torsh_distributed.comm.dims import side_group
    from torsh_distributed.parallel.data import apply_ddp
    from torsh_distributed.parallel.priority import PriorityDataParallel

    torch.manual_seed(dist.get_rank())  # different initial weights: init_sync must fix them
    net = _Net()
    if schedule == "fifo":
        model = apply_ddp(net, bucket_cap_mb=0.01)
    else:
        model = PriorityDataParallel(
            net,
            group=side_group("priority_test"),
            partition_bytes=partition,
            credit_bytes=2 * partition,
            probe_every=probe_every,
        )
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if optimizer == "adamw":
        opt = torch.optim.AdamW(groups, lr=1e-2, foreach=True)
    else:
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, foreach=True)
    if schedule == "priority":
        model.bind(opt, grad_clip=clip)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = group["lr"] * 0.97  # a schedule: each step's own lr must be applied
        x, y = _batch(step, dist.get_rank())
        if schedule == "fifo":
            opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if schedule == "fifo":
            if clip:
                torch.nn.utils.clip_grad_norm_(list(net.parameters()), clip)
            opt.step()
        else:
            model.submit()
        losses.append(loss.item())
    if schedule == "priority":
        model.wait()
        summary = model.summary()
        model.close()
    else:
        summary = {}
    state = {k: v.clone() for k, v in net.state_dict().items()}
    return {"losses": losses, "state": state, "opt": opt.state_dict()["state"], "summary": summary}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("optimizer", "clip", "partition", "probe_every"),
    [("adamw", 0.0, 1024, 0), ("sgd", 0.5, 300, 2)],
)
def test_priority_equals_ddp_bitwise(
    optimizer: str, clip: float, partition: int, probe_every: int
) -> None:
    """Bit for bit, with the link probes on the exchange's group in between (after step 3, and
    with ``probe_every=2`` after step 5 too)."""
    steps = 6
    fifo = run_distributed(_train, 2, args=("fifo", optimizer, clip, partition, steps), timeout=100)
    prio = run_distributed(
        _train, 2, args=("priority", optimizer, clip, partition, steps, probe_every), timeout=100
    )
    assert prio[0]["summary"]["chunks"] > 3, "the test must exercise several chunks"
    for rank in range(2):
        summary = prio[rank]["summary"]
        assert summary["probes"] == (2 if probe_every else 1), summary
        assert summary["bandwidth"]["source"] == "probe+fit", summary
        assert summary["achieved_mbit"] > 0
    assert (
        prio[0]["summary"]["bandwidth"]["bandwidth_mbit"]
        == prio[1]["summary"]["bandwidth"]["bandwidth_mbit"]
    ), "every rank must report the same probed link"
    for rank in range(2):
        assert prio[rank]["losses"] == fifo[rank]["losses"], f"rank {rank}: losses differ"
        for name, value in fifo[rank]["state"].items():
            assert torch.equal(prio[rank]["state"][name], value), f"rank {rank}: {name} differs"
        for key, st in fifo[rank]["opt"].items():
            for field, value in st.items():
                assert torch.equal(prio[rank]["opt"][key][field], value), (
                    f"optimizer state {key}.{field}"
                )
    assert torch.equal(prio[0]["state"]["emb.weight"], prio[1]["state"]["emb.weight"])


def _engine_run(schedule: str, ckpt_dir: str, report: str) -> dict:
    from torsh_distributed.train import TrainConfig, train

    cfg = TrainConfig.from_dict(
        {
            "max_steps": 8,
            "batch_size": 8,
            "grad_accum": 2,  # the first micro-batch's backward must not exchange
            "progress": False,
            "eval_batches": 2,
            "data": {"max_bytes": 200_000},
            "model": {"block_size": 32, "n_layer": 2, "n_head": 2, "d_model": 64},
            "optim": {"grad_clip": 0.0},
            # recomputed forwards run inside backward: they must not wait for this step's update
            "parallel": {"activation_checkpointing": "full"},
            "checkpoint": {"dir": ckpt_dir, "every": 4},
            "monitor": {"enabled": True, "every": 2, "report_json": report},
            "comm": {"exchange_schedule": schedule}
            | ({"partition_kb": 16, "credit_kb": 32} if schedule == "priority" else {}),
        }
    )
    result = train(cfg)
    return {"losses": result.losses, "val": result.val_loss, "comm": result.comm}


@pytest.mark.timeout(180)
def test_engine_priority_equals_fifo(tmp_path) -> None:
    """The trainer's --comm-schedule priority (gradient accumulation, activation checkpointing,
    checkpoints every 4 steps drain the exchange, the monitor gets the link estimate) gives
    DDP's losses bit for bit."""
    import json

    runs = {}
    for schedule in ("fifo", "priority"):
        report = str(tmp_path / f"{schedule}.json")
        args = (schedule, str(tmp_path / schedule), report)
        runs[schedule] = run_distributed(_engine_run, 2, args=args, timeout=150)[0]
    assert runs["priority"]["losses"] == runs["fifo"]["losses"]
    assert runs["priority"]["val"] == runs["fifo"]["val"]
    comm = runs["priority"]["comm"]
    assert comm["schedule"] == "priority" and comm["chunks"] > 4 and runs["fifo"]["comm"] == {}
    assert comm["bandwidth"]["bandwidth_mbit"] > 0
    text = json.dumps(json.loads((tmp_path / "priority.json").read_text()))
    assert "comm_bandwidth_mbit" in text
    assert sorted(p.name for p in (tmp_path / "priority").iterdir()) == sorted(
        p.name for p in (tmp_path / "fifo").iterdir()
    )


def _train_zero2(schedule: str, partition: int, steps: int) -> dict:
    """ZeRO-2: FSDP2 (``fifo``: units blocks[0], blocks[2], then the root with the tied
    embedding) against the priority exchange's reduce-scatter / shard step / all-gather."""
    from torsh_distributed.comm.dims import side_group
    from torsh_distributed.parallel.priority import PriorityDataParallel
    from torsh_distributed.parallel.sharded import apply_fsdp

    torch.manual_seed(0)  # FSDP2 shards each rank's own initial weights: the same seed
    net = _Net()
    if schedule == "fifo":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        model = apply_fsdp(net, mesh, stage=2, units=[net.blocks[0], net.blocks[2]])
    else:
        model = PriorityDataParallel(
            net,
            group=side_group("priority_zero_test"),
            partition_bytes=partition,
            credit_bytes=2 * partition,
            zero_stage=2,
        )
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2, foreach=True)
    if schedule == "priority":
        model.bind(opt)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = group["lr"] * 0.97
        x, y = _batch(step, dist.get_rank())
        if schedule == "fifo":
            opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if schedule == "fifo":
            opt.step()
        else:
            model.submit()
        losses.append(loss.item())
    if schedule == "priority":
        model.wait()
        summary = model.summary()
        model.close()
        state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    else:
        summary = {}
        state = {k: v.full_tensor().clone() for k, v in net.state_dict().items()}
    return {"losses": losses, "state": state, "summary": summary}


@pytest.mark.timeout(120)
def test_priority_zero2_equals_fsdp2_bitwise() -> None:
    """``zero_stage=2`` (reduce-scatter, shard step, all-gather per chunk, by priority) gives
    FSDP2's ZeRO-2 (``reshard_after_forward=False``) losses and parameters bit for bit."""
    steps = 6
    fifo = run_distributed(_train_zero2, 2, args=("fifo", 300, steps), timeout=100)
    prio = run_distributed(_train_zero2, 2, args=("priority", 300, steps), timeout=100)
    assert prio[0]["summary"]["chunks"] > 3 and prio[0]["summary"]["zero_stage"] == 2
    for rank in range(2):
        assert prio[rank]["losses"] == fifo[rank]["losses"], f"rank {rank}: losses differ"
        for name, value in fifo[rank]["state"].items():
            assert torch.equal(prio[rank]["state"][name], value), f"rank {rank}: {name} differs"


def _refuse_clip() -> str:
    from torsh_distributed.comm.dims import side_group
    from torsh_distributed.parallel.priority import PriorityDataParallel

    model = PriorityDataParallel(_Net(), group=side_group("refuse"), zero_stage=2)
    try:
        model.bind(torch.optim.SGD(model.parameters(), lr=0.1), grad_clip=1.0)
    except ValueError as exc:
        return str(exc)
    finally:
        model.close()
    return ""


@pytest.mark.timeout(60)
def test_priority_zero2_refuses_clipping() -> None:
    assert "cannot clip gradients" in run_distributed(_refuse_clip, 2, timeout=50)[0]


def _engine_zero2(schedule: str) -> list[float]:
    from torsh_distributed.train import TrainConfig, train

    cfg = TrainConfig.from_dict(
        {
            "max_steps": 6,
            "batch_size": 8,
            "grad_accum": 2,  # FSDP2's set_requires_gradient_sync(False) vs local accumulation
            "progress": False,
            "eval_batches": 2,
            "data": {"max_bytes": 200_000},
            "model": {"block_size": 32, "n_layer": 2, "n_head": 2, "d_model": 64},
            "optim": {"grad_clip": 0.0},
            "parallel": {"zero_stage": 2},
            "comm": {"exchange_schedule": schedule}
            | ({"partition_kb": 16, "credit_kb": 32} if schedule == "priority" else {}),
        }
    )
    result = train(cfg)
    return [*result.losses, result.val_loss], result.comm


@pytest.mark.timeout(180)
def test_engine_priority_zero2_equals_fsdp2() -> None:
    """The trainer's --comm-schedule priority --zero-stage 2 (the exchange shards by itself, no
    FSDP2) gives FSDP2 ZeRO-2's losses bit for bit, with gradient accumulation."""
    fifo = run_distributed(_engine_zero2, 2, args=("fifo",), timeout=150)[0]
    prio = run_distributed(_engine_zero2, 2, args=("priority",), timeout=150)[0]
    assert prio[0] == fifo[0]
    assert prio[1]["zero_stage"] == 2 and prio[1]["chunks"] > 4 and fifo[1] == {}


def _probe_twice() -> list[dict]:
    from torsh_distributed.comm.link_probe import probe_group_link

    out = [probe_group_link(target_s=0.005, reps=2).to_dict() for _ in range(2)]
    for bad, match in (({"target_s": 0}, "target_s"), ({"reps": 0}, "reps"),
                       ({"max_bytes": 1000}, "max_bytes")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            probe_group_link(**bad)
    return out


@pytest.mark.timeout(120)
def test_probe_group_link_agrees_on_every_rank() -> None:
    """The probe is a collective: both ranks issue the same sizes (agreed through the warm-up's
    time) and return the same estimate, from 2 repetitions of 12 queued all-reduces."""
    ranks = run_distributed(_probe_twice, 2, timeout=100)
    assert ranks[0] == ranks[1]
    for link in ranks[0]:
        assert link["bandwidth_mbit"] > 0 and link["latency_ms"] >= 0
        assert link["source"] == "probe" and link["sizes"] == 1 and link["samples"] == 24
