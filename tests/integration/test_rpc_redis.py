"""RPC workers that rendezvous through a real redis-server (password and key prefix in the URL)."""

from __future__ import annotations

import os
import uuid

import torch

from torsh_distributed import rpc
from torsh_distributed.testing import run_distributed


def _redis_body(url: str) -> float:
    rank = int(os.environ["RANK"])
    with rpc.init(name=f"w{rank}", rank=rank, world_size=2, store_url=url, rendezvous_timeout=30):
        peer = f"w{1 - rank}"
        value = rpc.rpc_sync(peer, torch.mul, args=(torch.full((2,), float(rank + 1)), 10))
        assert rpc.shutdown() is True
    return float(value.sum())


def test_rpc_rendezvous_through_redis(redis_server_auth, redis_password) -> None:
    host, port = redis_server_auth
    url = f"redis://:{redis_password}@{host}:{port}/0?prefix=rpc-{uuid.uuid4().hex}/"
    assert run_distributed(_redis_body, 2, args=(url,), init=False, timeout=60) == [20.0, 40.0]
