"""Tensor parallelism on CUDA tensors with one GPU: two ranks share ``cuda:0`` over Gloo (NCCL
refuses two ranks on one device), the GPT's TP plan applied on a ``cuda`` device mesh, trained
against the unsharded model on the same GPU. The plan's collectives (row-parallel all-reduces,
the gathered logits, the partial gradients of replicated parameters) then run on CUDA tensors.
Skipped without CUDA; ``_tp_vs_one_process`` runs on the CPU too (checked there when written).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torsh_distributed.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)"),
]

MODEL = {"n_layer": 2, "n_head": 4, "d_model": 64, "block_size": 16, "vocab_size": 256}


def _tp_vs_one_process(device: str, steps: int = 6) -> dict:
    """Losses of the TP GPT (logits gathered, no sequence parallelism) and of the unsharded GPT
    on the same batches, AdamW, on ``device``; and which parameters became DTensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from torsh_distributed.models.config import ModelConfig
    from torsh_distributed.models.gpt import GPT
    from torsh_distributed.models.gpt_tp import gpt_tp_plan
    from torsh_distributed.parallel.tensor import reduce_partial_grads
    from torsh_distributed.parallel.tp_plan import apply_tp_plan

    dev = torch.device(device)
    cfg = ModelConfig(**MODEL)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    torch.manual_seed(0)
    ref = GPT(cfg).to(dev)
    torch.manual_seed(0)
    tp = apply_tp_plan(GPT(cfg).to(dev), mesh,
                       gpt_tp_plan(sequence_parallel=False, loss_parallel=False))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (ref, tp)]
    gen = torch.Generator().manual_seed(1)
    losses: dict[str, list[float]] = {"ref": [], "tp": []}
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=gen)
        y = (7 * x + 3) % cfg.vocab_size
        x, y = x.to(dev), y.to(dev)
        for name, model, opt in (("ref", ref, opts[0]), ("tp", tp, opts[1])):
            opt.zero_grad()
            logits = model(x)
            logits = logits[0] if isinstance(logits, tuple) else logits
            logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            loss.backward()
            if name == "tp":
                reduce_partial_grads(list(tp.parameters()))
            opt.step()
            losses[name].append(float(loss.detach()))
    devices = {p.device.type for p in tp.parameters()}
    dtensors = sum(isinstance(p, DTensor) for p in tp.parameters())
    return {"losses": losses, "devices": sorted(devices), "dtensors": dtensors}


def test_tp2_on_cuda_tensors_over_gloo_equals_one_process():
    results = run_distributed(_tp_vs_one_process, 2, args=("cuda:0",), backend="gloo", timeout=240)
    for out in results:
        assert out["devices"] == ["cuda"] and out["dtensors"] > 0, out
        ref, tp = out["losses"]["ref"], out["losses"]["tp"]
        assert tp == pytest.approx(ref, rel=1e-4), out["losses"]
        assert tp[-1] < tp[0], out["losses"]  # it learns (the target is a map of the input)
    assert results[0]["losses"] == results[1]["losses"]
