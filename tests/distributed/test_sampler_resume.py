"""A user's own DataLoader loop resumes its data stream at another world size.

4 ranks run K steps and save the sampler state; 2 ranks load it and run on, across an epoch
boundary. The global batches (each rank's indices gathered in rank order) of both halves must
equal those of one uninterrupted single-rank run: no sample lost, repeated or reordered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from torsh_distributed.data import DistributedBatchSampler
from torsh_distributed.testing import run_distributed

NUM_SAMPLES = 44  # 5 steps per epoch at a global batch of 8; 4 samples dropped per epoch
GLOBAL_BATCH = 8
SEED = 3
K = 3  # steps before the "checkpoint": mid-epoch
MORE = 6  # steps after it: finishes epoch 0 and runs into epoch 1


def _user_loop(num_steps: int, state: dict[str, Any] | None) -> dict[str, Any]:
    """What a user writes: a DataLoader over their dataset, an epoch loop, a saved state."""
    dataset = TensorDataset(torch.arange(NUM_SAMPLES) * 10)  # values != indices: fetch is real
    batch_sampler = DistributedBatchSampler(
        dataset_len=NUM_SAMPLES, global_batch=GLOBAL_BATCH, seed=SEED
    )  # rank and num_ranks from the process group
    if state is not None:
        batch_sampler.load_state_dict(state)
    loader = DataLoader(dataset, batch_sampler=batch_sampler)
    global_batches: list[list[int]] = []
    epoch_lengths: list[int] = []
    while len(global_batches) < num_steps:
        epoch_lengths.append(len(loader))
        for (values,) in loader:
            mine = (values // 10).tolist()
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            global_batches.append([i for share in gathered for i in share])
            if len(global_batches) == num_steps:
                break
    return {
        "batches": global_batches,
        "state": batch_sampler.state_dict(),
        "world": (batch_sampler.rank, batch_sampler.num_ranks),
        "epoch_lengths": epoch_lengths,
    }


def test_resume_on_another_world_size_continues_the_global_stream():
    straight = run_distributed(_user_loop, 1, args=(K + MORE, None), timeout=120)[0]
    first = run_distributed(_user_loop, 4, args=(K, None), timeout=120)
    assert [r["world"] for r in first] == [(r, 4) for r in range(4)]
    state = first[0]["state"]
    assert state["step"] == K
    assert all(r["state"] == state for r in first)  # the state does not depend on the rank

    rest = run_distributed(_user_loop, 2, args=(MORE, state), timeout=120)
    assert [r["world"] for r in rest] == [(0, 2), (1, 2)]
    assert rest[0]["batches"] == rest[1]["batches"]
    assert rest[0]["state"]["step"] == K + MORE
    assert rest[0]["epoch_lengths"] == [5 - K, 5]  # rest of epoch 0, then a full epoch 1

    assert first[0]["batches"] == straight["batches"][:K]
    assert rest[0]["batches"] == straight["batches"][K:]
    for batch in straight["batches"]:
        assert len(batch) == GLOBAL_BATCH
    epoch0 = [i for batch in straight["batches"][:5] for i in batch]
    assert len(set(epoch0)) == 5 * GLOBAL_BATCH  # without replacement within an epoch
