"""The parameter server on real processes (RPC over loopback): 2 servers + 2 workers.

- staleness 0 trains to the parameters of synchronous data parallel (a single-process reference
  averaging the workers' gradients, same data split, same lr) within 1e-6 in fp64;
- with s = 2 and one worker doing 7x the work per step, the observed staleness reaches the bound
  and never exceeds it;
- a sparse embedding moves only the rows a batch touches (rows and bytes counted);
- a server SIGKILLed mid-run restarts from its snapshot, training finishes, the lost updates are
  reported.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from torsh_distributed.testing import RankFailedError, run_distributed
from torsh_distributed.testing import models as M

STEPS = 8


def _run(config_kwargs: dict, model: str = "mlp", kill_at: int = 0) -> dict | None:
    from torsh_distributed.ps import PSConfig, PSTrainConfig, ServerOptimConfig, run

    ps = PSConfig(**config_kwargs.pop("ps"))
    optim = ServerOptimConfig(**config_kwargs.pop("optim"))
    cfg = PSTrainConfig(ps=ps, optim=optim, **config_kwargs)
    if kill_at and int(os.environ["RANK"]) == 1:
        threading.Thread(target=_kill_when_applied, args=(kill_at,), daemon=True).start()
    factory, data, loss = _MODELS[model]
    out = run(factory, data(), loss, cfg)
    if out is not None:
        out["params"] = {k: v.numpy() for k, v in out["params"].items()}  # not shared memory
    return out


def _kill_when_applied(count: int) -> None:
    """SIGKILL this server process once it has applied ``count`` updates (no clean-up at all)."""
    from torsh_distributed.ps import server

    while True:
        shard = server._SHARD
        if shard is not None and shard.applied >= count:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.001)


class _SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 8, sparse=True)
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(dim=1))


def _sparse_data() -> M.PairDataset:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (128, 3), generator=gen) * 7  # rows 0, 7, ..., 343 only
    return M.PairDataset(ids, ids[:, 0] % 4)


_MODELS = {
    "mlp": (M.mlp, M.classification_data, nn.functional.cross_entropy),
    "wide": (functools.partial(M.mlp, hidden=1024), functools.partial(M.classification_data, n=2048),
             nn.functional.cross_entropy),
    "sparse": (_SparseNet, _sparse_data, nn.functional.cross_entropy),
}


def _reference(optim_cls, steps: int, batch: int, workers: int, *, clip: float = 0.0, lrs: tuple[float, ...] = (),
               groups: bool = False, **kw) -> dict[str, torch.Tensor]:
    """Single-process data parallel: the mean of the workers' mean-loss gradients, torch.optim;
    ``clip`` clips the mean, ``lrs`` sets each step's lr, ``groups`` decays matrices only (the
    engine's)."""
    from torsh_distributed.ps.train import batch_indices

    torch.manual_seed(1234)
    model = M.mlp().double()
    data = M.classification_data()
    params = list(model.parameters())
    if groups:
        params = [{"params": [p for p in params if p.dim() >= 2]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = optim_cls(params, foreach=False, **kw)
    per = batch // workers
    for step in range(steps):
        idx = batch_indices(step, batch_size=batch, num_samples=len(data), seed=1234)
        grads = []
        for w in range(workers):
            items = [data[int(i)] for i in idx[w * per:(w + 1) * per]]
            x = torch.stack([a for a, _ in items]).double()
            y = torch.stack([b for _, b in items])
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads, strict=True):
            p.grad = sum(gs) / workers
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        for group in opt.param_groups if lrs else ():
            group["lr"] = lrs[step]
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_staleness_zero_equals_synchronous_data_parallel():
    cfg = {"ps": {"num_servers": 2, "staleness": 0},
           "optim": {"kind": "adam", "lr": 0.01, "beta2": 0.99},
           "max_steps": STEPS, "batch_size": 32, "dtype": "fp64"}
    out = run_distributed(_run, 4, args=(cfg,), init=False, timeout=60)[2]
    ref = _reference(torch.optim.Adam, STEPS, 32, 2, lr=0.01, betas=(0.9, 0.99))
    assert set(out["params"]) == set(ref)
    for key, value in ref.items():
        torch.testing.assert_close(torch.from_numpy(out["params"][key]), value, rtol=0, atol=1e-6, msg=key)
    assert out["staleness_histogram"] == {0: 2 * 2 * STEPS}  # 2 workers x 2 servers x steps
    assert out["applied"] == [STEPS, STEPS]
    assert not torch.equal(ref["0.weight"], M.mlp().double().state_dict()["0.weight"])


@pytest.mark.timeout(120)
def test_synchronous_mean_clipping_and_schedule_equal_data_parallel():
    # what `torsh-dist train --ps-servers 1 --staleness 0` asks of the server: the engine's AdamW
    # (matrices decay), its lr per step, and the step's mean gradient clipped (clip 0.05 clips
    # every step, and clipping each push before averaging would give other parameters)
    lrs = tuple([0.004 * (s + 1) for s in range(3)] + [0.012 * (1 - s / 10) for s in range(3, STEPS)])
    cfg = {"ps": {"num_servers": 1, "staleness": 0},
           "optim": {"kind": "adamw", "lr": 0.012, "lrs": lrs, "weight_decay": 0.1, "decay_matrices_only": True,
                     "clip_norm": 0.05, "clip_mean": True},
           "max_steps": STEPS, "batch_size": 32, "dtype": "fp64"}
    out = run_distributed(_run, 3, args=(cfg,), init=False, timeout=90)[1]
    ref = _reference(torch.optim.AdamW, STEPS, 32, 2, clip=0.05, lrs=lrs, groups=True, lr=0.012, weight_decay=0.1)
    for key, value in ref.items():
        torch.testing.assert_close(torch.from_numpy(out["params"][key]), value, rtol=0, atol=1e-6, msg=key)
    per_push = _reference(torch.optim.AdamW, STEPS, 32, 2, clip=0.0, lrs=lrs, groups=True, lr=0.012, weight_decay=0.1)
    assert not torch.allclose(per_push["0.weight"], ref["0.weight"], atol=1e-6)  # clipping mattered


def test_bounded_staleness_never_exceeds_s_with_a_slow_worker():
    cfg = {"ps": {"num_servers": 2, "staleness": 2},
           "optim": {"kind": "sgd", "lr": 0.05, "momentum": 0.9},
           "max_steps": 16, "batch_size": 512, "shares": (7, 1), "threads": (1, 1)}
    out = run_distributed(_run, 4, args=(cfg, "wide"), init=False, timeout=90)[2]
    hist = out["staleness_histogram"]
    assert max(hist) <= 2, hist
    assert max(hist) == 2, f"the slow worker never held the fast one back: {hist}"
    assert sum(hist.values()) == 2 * 2 * 16
    slow, fast = out["worker_seconds"]
    assert slow > fast * 0.8  # worker 0 does 7x the samples per step


def test_sparse_embedding_moves_only_touched_rows():
    cfg = {"ps": {"num_servers": 2, "staleness": -1},
           "optim": {"kind": "adagrad", "lr": 0.1},
           "max_steps": 6, "batch_size": 16}
    out = run_distributed(_run, 4, args=(cfg, "sparse"), init=False, timeout=60)[2]
    data = _sparse_data()
    from torsh_distributed.ps.train import batch_indices

    touched = 0
    for step in range(6):
        idx = batch_indices(step, batch_size=16, num_samples=len(data), seed=1234)
        for w in range(2):
            touched += len(torch.unique(data.inputs[idx[w * 8:(w + 1) * 8]]))
    assert out["rows_pushed"] == touched
    assert out["rows_pulled"] == touched  # each forward pulls exactly the rows of its batch
    full_table = 1000 * 8 * 4
    assert out["bytes_pulled"] < 6 * 2 * full_table / 10  # far less than pulling the table
    torch.manual_seed(1234)
    initial = _SparseNet().state_dict()["emb.weight"]
    final = torch.from_numpy(out["params"]["emb.weight"])
    never = torch.ones(1000, dtype=torch.bool)
    never[torch.arange(0, 350, 7)] = False
    assert torch.equal(final[never], initial[never])
    assert not torch.equal(final[~never], initial[~never])


def test_killed_server_restarts_from_its_snapshot(tmp_path: Path):
    cfg = {"ps": {"num_servers": 2, "staleness": 0, "snapshot_dir": str(tmp_path), "snapshot_every": 3,
                  "timeout_s": 20},
           "optim": {"kind": "sgd", "lr": 0.05, "momentum": 0.9},
           "max_steps": 12, "batch_size": 32}
    with pytest.raises(RankFailedError, match="rank 1: process exited with code -9|rank 1 of 4 failed: process exited with code -9"):
        run_distributed(_run, 4, args=({**cfg, "ps": dict(cfg["ps"])}, "mlp", 8), init=False, timeout=40)
    out = run_distributed(_run, 4, args=(cfg,), init=False, timeout=60)[2]
    assert out["restored"][1]["applied"] == 6  # the snapshot before the kill at 8 applied steps
    assert out["applied"] == [12, 12]
    assert [len(losses) for losses in out["worker_losses"]] == [6, 6]  # resumed at step 6
    assert out["lost_updates"] >= 2 * 2 * 1  # each worker had >= 7 pushes acknowledged by each server
