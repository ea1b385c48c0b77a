"""``hvd.DistributedOptimizer`` and ``hvd.broadcast_optimizer_state`` at 2 ranks on Gloo.

Parity is the proof: backward_passes_per_step=2 equals torch's DDP with two-step accumulation
(``no_sync``) and plain Average equals one process on the global batch, in fp64 within 1e-6;
every reduced gradient is checked against the mean (or sum, or Adasum) of the ranks' local
gradients computed separately; broadcast optimizer state is compared tensor by tensor with
``torch.equal``.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torsh_distributed.compat.horovod.torch as hvd
from torsh_distributed.testing import run_distributed

STEPS = 4


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return _Net().double()


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64)
    return x, torch.randn(5, 3, generator=g, dtype=torch.float64)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _local_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """This rank's gradients, computed on a hook-free copy."""
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    F.mse_loss(twin(x), y).backward()
    return [p.grad.detach().clone() for p in twin.parameters()]


def _parity_bpps2_vs_ddp_accumulation() -> dict[str, float]:
    hvd.init()
    r = hvd.rank()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), backward_passes_per_step=2
    )
    ref = DDP(_net())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):
            x, y = _batch(step, micro, r)
            (F.mse_loss(model(x), y) / 2).backward()
            if micro == 0:
                with ref.no_sync():
                    (F.mse_loss(ref(x), y) / 2).backward()
            else:
                (F.mse_loss(ref(x), y) / 2).backward()
        opt.step()
        ref_opt.step()
    bpps2 = float((_flat(model) - _flat(ref.module)).abs().max())

    # backward_passes_per_step=1 with Average = one process on the global batch
    model = _net(1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    single = _net(1)
    single_opt = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(_batch(step, 0, r)[0]), _batch(step, 0, r)[1]).backward()
        opt.step()
        single_opt.zero_grad()
        xs, ys = zip(*[_batch(step, 0, k) for k in range(hvd.size())], strict=True)
        F.mse_loss(single(torch.cat(xs)), torch.cat(ys)).backward()
        single_opt.step()
    global_batch = float((_flat(model) - _flat(single)).abs().max())

    # gradient_predivide_factor changes numerics only
    results = []
    for factor in (1.0, 4.0):
        m = _net(2)
        o = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1),
            named_parameters=m.named_parameters(),
            gradient_predivide_factor=factor,
        )
        F.mse_loss(m(_batch(0, 0, r)[0]), _batch(0, 0, r)[1]).backward()
        o.step()
        results.append(_flat(m))
    predivide = float((results[0] - results[1]).abs().max())

    # ... and what it is for: an fp16 sum of 40000 + 40000 overflows, 20000 + 20000 does not
    overflow = []
    for factor in (1.0, 2.0):
        w = nn.Parameter(torch.zeros(3))
        o = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                     compression=hvd.Compression.fp16,
                                     gradient_predivide_factor=factor)
        (40000.0 * w.sum()).backward()
        o.synchronize()
        overflow.append(w.grad.tolist())
    return {"bpps2_vs_ddp": bpps2, "avg_vs_global_batch": global_batch, "predivide": predivide,
            "fp16_overflow": overflow}


def test_backward_passes_per_step_2_equals_ddp_accumulation_and_average_equals_global_batch():
    for out in run_distributed(_parity_bpps2_vs_ddp_accumulation, 2, timeout=90):
        assert out["bpps2_vs_ddp"] <= 1e-6, out
        assert out["avg_vs_global_batch"] <= 1e-6, out
        assert out["predivide"] <= 1e-12, out
        assert out["fp16_overflow"] == [[float("inf")] * 3, [40000.0] * 3], out


def _reduced_gradients() -> list[str]:
    hvd.init()
    r, w = hvd.rank(), hvd.size()
    failures: list[str] = []

    def expect(label: str, got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if a.shape != b.shape or not torch.allclose(a.double(), b.double(), atol=tol, rtol=0):
                failures.append(f"rank {r} {label} param {i}: max diff {(a - b).abs().max()}")

    x, y = _batch(7, 0, r)
    model = _net(3)
    everyone = hvd.allgather_object(_local_grads(model, x, y))
    mean = [sum(g[i] for g in everyone) / w for i in range(len(everyone[0]))]
    total = [m * w for m in mean]

    def run(op=hvd.Average, compression=hvd.Compression.none, **kw):
        m = _net(3)
        o = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
            op=op, compression=compression, **kw,
        )
        F.mse_loss(m(x), y).backward()
        o.synchronize()
        return m, o, [p.grad.detach().clone() for p in m.parameters()]

    _, _, grads = run()
    expect("average", grads, mean, 1e-12)
    _, _, grads = run(op=hvd.Sum)
    expect("sum", grads, total, 1e-12)
    _, _, grads = run(compression=hvd.Compression.fp16)
    expect("fp16", grads, mean, 2e-3)
    if any(g.dtype != torch.float64 for g in grads):
        failures.append("fp16 compression changed the gradient dtype")
    _, _, grads = run(compression=hvd.Compression.torsh("none"))
    expect("Compression.torsh('none')", grads, mean, 1e-6)  # our compressors work in fp32
    _, _, grads = run(compression=hvd.Compression.torsh("topk:0.5"))
    agreed = hvd.allgather_object(grads)
    if any(not torch.equal(a, b) for a, b in zip(agreed[0], agreed[-1], strict=True)):
        failures.append("topk: ranks disagree on the reduced gradient")
    for g, m in zip(grads, mean, strict=True):  # sparse: at most half of each rank's entries
        if int((g != 0).sum()) > w * ((m.numel() + 1) // 2):
            failures.append("topk sent more than its ratio")

    # synchronize + clip + skip_synchronize: the clipped reduced gradient is what steps
    m, o, grads = run()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
    clipped = [p.grad.detach().clone() for p in m.parameters()]
    before = _flat(m)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with o.skip_synchronize():
            o.step()
    if caught:
        failures.append(f"skip_synchronize warned: {caught[0].message}")
    stepped = torch.cat([c.reshape(-1) for c in clipped]) * -0.1
    expect("clipped step", [_flat(m) - before], [stepped], 1e-12)
    F.mse_loss(m(x), y).backward()
    o.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o.step()
    if not any("skip_synchronize" in str(c.message) for c in caught):
        failures.append("step() after synchronize() did not warn")

    # Adasum: each rank's update -lr * g, combined by the formula, added to the start
    m = _net(3)
    start = [p.detach().clone() for p in m.parameters()]
    o = hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
        op=hvd.Adasum,
    )
    F.mse_loss(m(x), y).backward()
    o.step()
    want = []
    for i, s in enumerate(start):
        a, b = -0.1 * everyone[0][i], -0.1 * everyone[1][i]
        dot, na, nb = float((a * b).sum()), float((a * a).sum()), float((b * b).sum())
        want.append(s + (1 - dot / (2 * na)) * a + (1 - dot / (2 * nb)) * b)
    expect("adasum", [p.detach() for p in m.parameters()], want, 1e-12)

    # a parameter unused on one rank contributes zeros there (dynamic graphs)
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 3)
            self.b = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            return self.a(x) + (self.b(x) if use_b else 0)

    torch.manual_seed(5)
    net = Branchy().double()
    twin = copy.deepcopy(net)
    o = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                 named_parameters=net.named_parameters())
    F.mse_loss(net(x, r == 0), y).backward()
    o.synchronize()
    F.mse_loss(twin(x, r == 0), y).backward()
    local = [p.grad if p.grad is not None else torch.zeros_like(p) for p in twin.parameters()]
    gathered = hvd.allgather_object(local)
    expect("unused on one rank", [p.grad for p in net.parameters()],
           [sum(g[i] for g in gathered) / w for i in range(len(local))], 1e-12)

    # sparse embedding gradients: all-gathered indices/values, or dense
    for dense in (False, True):
        torch.manual_seed(6)
        emb = nn.Embedding(10, 4, sparse=True).double()
        twin = copy.deepcopy(emb)
        o = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                     named_parameters=emb.named_parameters(), sparse_as_dense=dense)
        idx = torch.tensor([r, 2 * r + 3, 9])
        emb(idx).pow(2).sum().backward()
        o.synchronize()
        twin(idx).pow(2).sum().backward()
        local = hvd.allgather_object(twin.weight.grad.to_dense())
        expect(f"sparse (as dense={dense})", [emb.weight.grad.to_dense()], [sum(local) / w], 1e-12)

    # Horovod's guards
    def check_raises(label: str, exc: type[BaseException], fn, match: str) -> None:
        try:
            fn()
        except exc as err:
            if match not in str(err):
                failures.append(f"{label}: {err}")
        else:
            failures.append(f"{label}: no {exc.__name__}")

    m = _net(3)
    o = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                 named_parameters=m.named_parameters(), backward_passes_per_step=2)
    F.mse_loss(m(x), y).backward()
    check_raises("zero_grad mid-accumulation", AssertionError, o.zero_grad, "zero_grad() was called")
    F.mse_loss(m(x), y).backward()
    check_raises("third backward", AssertionError, lambda: F.mse_loss(m(x), y).backward(),
                 "more than backward_passes_per_step")
    o.synchronize()  # both ranks reduce what was accumulated; state resets
    o.zero_grad()
    check_raises("groups", NotImplementedError,
                 lambda: hvd.DistributedOptimizer(torch.optim.SGD(_net().parameters(), lr=1), groups=2),
                 "groups")
    check_raises("predivide with Sum", ValueError,
                 lambda: hvd.DistributedOptimizer(torch.optim.SGD(_net().parameters(), lr=1),
                                                  op=hvd.Sum, gradient_predivide_factor=2.0),
                 "gradient_predivide_factor")
    check_raises("duplicate names", ValueError,
                 lambda: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1),
                                                  named_parameters=[("w", p) for p in m.parameters()]),
                 "Found duplicates: w")
    wrapped = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1))
    if not isinstance(wrapped, torch.optim.SGD) or type(wrapped).__name__ != "SGD":
        failures.append(f"the wrapper is not an SGD: {type(wrapped).__mro__}")
    return failures


def test_reduced_gradients_match_the_closed_forms():
    for failures in run_distributed(_reduced_gradients, 2, timeout=90):
        assert not failures, "\n".join(failures)


def _state_tensors(opt: torch.optim.Optimizer) -> list[tuple[int, str, torch.Tensor]]:
    sd = opt.state_dict()
    return [(pid, k, v) for pid, s in sorted(sd["state"].items()) for k, v in sorted(s.items())
            if isinstance(v, torch.Tensor)]


def _broadcast_state() -> dict[str, object]:
    hvd.init()
    r = hvd.rank()
    out: dict[str, object] = {}
    cases = {
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1 + r, momentum=0.9, nesterov=True),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3 * (r + 1), betas=(0.8, 0.99)),
        "adamw_wd": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.5),
    }
    for name, make in cases.items():
        for root in (0, 1):
            model = _net(11)
            opt = make(model.parameters())
            if r == root:  # only the root has stepped: the others have no state at all
                for step in range(3):
                    opt.zero_grad()
                    F.mse_loss(model(_batch(step, 0, r)[0]), _batch(step, 0, r)[1]).backward()
                    opt.step()
            params_before = _flat(model)
            hvd.broadcast_optimizer_state(opt, root_rank=root)
            mine = _state_tensors(opt)
            theirs = hvd.broadcast_object(mine, root_rank=root)
            out[f"{name}/root{root}/equal"] = len(mine) == len(theirs) > 0 and all(
                a[:2] == b[:2] and a[2].dtype == b[2].dtype and torch.equal(a[2], b[2])
                for a, b in zip(mine, theirs, strict=True)
            )
            groups = hvd.broadcast_object(opt.state_dict()["param_groups"], root_rank=root)
            out[f"{name}/root{root}/options"] = opt.state_dict()["param_groups"] == groups
            out[f"{name}/root{root}/params_untouched"] = torch.equal(_flat(model), params_before)
            # the states keep evolving together: one more identical step on every rank
            opt.zero_grad()
            x, y = _batch(9, 0, 0)
            hvd.broadcast_parameters(model.state_dict(), root_rank=root)
            F.mse_loss(model(x), y).backward()
            opt.step()
            flats = hvd.allgather_object(_flat(model))
            out[f"{name}/root{root}/next_step_equal"] = torch.equal(flats[0], flats[1])

    # a DistributedOptimizer with no state anywhere: created without a reduction (no hang)
    model = _net(12)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    bufs = [v for _, k, v in _state_tensors(opt) if k == "momentum_buffer"]
    out["distributed/zero_buffers"] = len(bufs) == 4 and all(not b.any() for b in bufs)
    out["distributed/grads_restored"] = all(p.grad is None for p in model.parameters())
    return out


def test_broadcast_optimizer_state_reproduces_the_root_state_exactly():
    for out in run_distributed(_broadcast_state, 2, timeout=90):
        bad = {k: v for k, v in out.items() if v is not True}
        assert not bad, bad
