"""One rank of an N-rank federated client job (``torsh-dist run --nproc-per-node N -m
torsh_distributed.federated._client_worker WORKDIR``).

Reads ``WORKDIR/spec.json`` and the global weights ``WORKDIR/global.pt`` (``weights_only``),
trains with the engine on the client's share (every rank builds the same share; the engine
splits each global batch among the ranks), gathers the unsharded weights and, on rank 0, writes
``state.pt`` and then ``result.json`` (the parent reads the result only after a zero exit).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main(workdir: str) -> None:
    from torsh_distributed.federated.client import _full_state, local_train
    from torsh_distributed.federated.config import FederatedConfig
    from torsh_distributed.federated.task import Task
    from torsh_distributed.runtime import world

    work = Path(workdir)
    spec = json.loads((work / "spec.json").read_text())
    config = FederatedConfig.from_dict(spec["config"])
    task = Task(config)
    data = task.client_data(int(spec["partition_id"]))
    model = task.model()
    model.load_state_dict(torch.load(work / "global.pt", weights_only=True))
    runtime = world.init(backend="gloo")  # owned here, so the weights can be gathered after fit
    try:
        loss, steps = local_train(
            task, model, data.dataset, steps=int(spec["steps"]), seed=int(spec["seed"]),
            proximal_mu=float(spec["proximal_mu"]),
        )  # fmt: skip
        state = _full_state(model)
        if runtime.is_main:
            tmp = work / "state.pt.tmp"
            torch.save(state, tmp)
            os.replace(tmp, work / "state.pt")
            (work / "result.json").write_text(json.dumps({"loss": loss, "steps": steps}))
    finally:
        world.shutdown()


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        import traceback

        rank = os.environ.get("RANK", "0")
        (Path(sys.argv[1]) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
