"""Replica groups' configuration, fault specs, the pickle-free state codec and the refusals
(issue 38); the multi-process behaviour is in tests/distributed/test_ft_replica_groups.py."""

from __future__ import annotations

import pytest
import torch

from torsh_distributed.engine.config import EngineConfig, OptimConfig
from torsh_distributed.ft.config import FTConfig
from torsh_distributed.parallel.config import ParallelConfig


def test_defaults_are_off_and_round_trip() -> None:
    assert not EngineConfig().ft.enabled
    cfg = EngineConfig(ft=FTConfig(replica_groups=2, max_restarts=5, min_groups=2))
    assert EngineConfig.from_dict(cfg.to_dict()).ft == cfg.ft


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"replica_groups": 0}, r"ft.replica_groups must be > 0"),
        ({"replica_groups": 2, "min_groups": 3}, r"ft.min_groups \(3\) cannot exceed"),
        ({"max_restarts": -1}, r"ft.max_restarts must be >= 0"),
        ({"backoff_s": -0.5}, r"ft.backoff_s must be >= 0"),
        ({"heartbeat_timeout_s": 0}, r"ft.heartbeat_timeout_s must be > 0"),
        ({"lighthouse": "raft"}, r"ft.lighthouse must be one of launcher, torchft, got 'raft'"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FTConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"parallel": ParallelConfig(pp=2)}, r"cannot run with --pp 2"),
        (
            {"optim": OptimConfig(optimizer="onebit_adam")},
            r"does not support --optimizer onebit_adam",
        ),
        ({"batch_size": 33}, r"batch_size 33 is not divisible by ft.replica_groups 2"),
    ],
)
def test_layouts_replica_groups_cannot_serve_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(ft=FTConfig(replica_groups=2), **kwargs)


def test_fault_specs() -> None:
    from torsh_distributed.ft.replica import parse_faults

    kill, hold = parse_faults("kill:rank=3:step=20:attempt=1, hold:rank=0:step=25:group=1")
    assert (kill.kind, kill.rank, kill.step, kill.attempt) == ("kill", 3, 20, 1)
    assert (hold.kind, hold.group, hold.attempt) == ("hold", 1, 0)
    with pytest.raises(ValueError, match=r"hold:rank=R:step=S:group=G"):
        parse_faults("hold:rank=0:step=3")
    with pytest.raises(ValueError, match=r"bad 'step=x'"):
        parse_faults("kill:rank=0:step=x")


def test_state_codec_round_trips_without_pickle() -> None:
    pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[ft]')")
    from torsh_distributed.ft._transport import decode, encode

    state = {
        "model": {"w": torch.randn(3, 4), "b": torch.zeros(0), "h": torch.ones(2).bfloat16()},
        "optim": {0: {"step": torch.tensor(5.0), "momentum_buffer": torch.randn(4)}},
        "groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1], "name": None}],
        "losses": [1.5, 0.25],
    }
    header, blobs = encode(state)
    assert b"__tensor__" in header and len(blobs) == 5
    back = decode(header, blobs)
    assert back["model"]["w"].equal(state["model"]["w"])
    assert back["model"]["h"].dtype == torch.bfloat16 and back["model"]["b"].shape == (0,)
    assert back["optim"][0]["momentum_buffer"].equal(state["optim"][0]["momentum_buffer"])
    assert back["groups"][0]["betas"] == [0.9, 0.95] and back["losses"] == [1.5, 0.25]
    with pytest.raises(TypeError, match=r"cannot send a object"):
        encode({"x": object()})


def test_a_run_not_started_by_the_launcher_is_refused() -> None:
    from torsh_distributed.ft.replica import ReplicaGroups

    with pytest.raises(ValueError, match=r"needs the replica-group launcher .* missing"):
        ReplicaGroups(FTConfig(replica_groups=2), group_rank=0, group_size=1, env={})
    env = {
        k: "0"
        for k in (
            "TORSH_FT_GROUP",
            "TORSH_FT_RANK",
            "TORSH_FT_LIGHTHOUSE",
            "TORSH_FT_STORE",
            "TORSH_FT_DIR",
        )
    }
    with pytest.raises(ValueError, match=r"ft.replica_groups is 2 but the launcher started 3"):
        ReplicaGroups(
            FTConfig(replica_groups=2),
            group_rank=0,
            group_size=1,
            env={**env, "TORSH_FT_GROUPS": "3"},
        )


def test_group_share_of_the_global_batch(tmp_path) -> None:
    from torsh_distributed.ft.replica import ReplicaGroups

    env = {
        "TORSH_FT_GROUP": "1",
        "TORSH_FT_GROUPS": "2",
        "TORSH_FT_RANK": "2",
        "TORSH_FT_LIGHTHOUSE": "x",
        "TORSH_FT_STORE": "127.0.0.1:1",
        "TORSH_FT_DIR": str(tmp_path),  # its event log: not the working directory
    }
    groups = ReplicaGroups(FTConfig(replica_groups=2), group_rank=0, group_size=2, env=env)
    assert groups.shard(torch.arange(8)).tolist() == [4, 5, 6, 7]


def test_the_degrees_and_the_batch_split_one_groups_ranks() -> None:
    """With replica groups the CLI checks one group's world (``--nproc-per-node`` / R): TP 2 x
    DP 1 in each of 2 groups of 2 ranks is accepted (it was refused against the whole world of
    4), and the batch must split over R x the group's data-parallel ranks (TP ranks share)."""
    from torsh_distributed.cli._train_checks import launch_world, precheck_world
    from torsh_distributed.train.config import TrainConfig

    cfg = TrainConfig(
        ft=FTConfig(replica_groups=2), parallel=ParallelConfig(tp=2, dp=1), batch_size=2
    )
    assert launch_world(cfg, 4) == 2
    precheck_world(cfg, launch_world(cfg, 4))  # 2 groups x 1 data rank: 1 sample each
    assert launch_world(TrainConfig(), 4) == 4
    with pytest.raises(ValueError, match=r"not a multiple of ft.replica_groups 2"):
        launch_world(cfg, 3)
    two_dp = TrainConfig(ft=FTConfig(replica_groups=2), parallel=ParallelConfig(tp=2, dp=2))
    with pytest.raises(ValueError, match=r"!= world size 2.*\(one of 2 replica groups' ranks\)"):
        precheck_world(two_dp, launch_world(two_dp, 4))
    ft = FTConfig(replica_groups=2)
    assert ft.check_batch(8, data_ranks=2, grad_accum=2) == 2
    with pytest.raises(ValueError, match=r"batch_size 6 is not divisible by the 4 data-parallel"):
        ft.check_batch(6, data_ranks=2)
    with pytest.raises(ValueError, match=r"grad_accum 4 must divide the per-rank batch 2"):
        ft.check_batch(8, data_ranks=2, grad_accum=4)


@pytest.mark.parametrize(
    ("codes", "cause"),
    [
        ([None, None, None, None], None),
        ([None, 0, None, 0], None),
        # rank 3 SIGKILLed; its TP peer rank 2 exited on the closed socket: one poll sees both
        ([None, None, 1, -9], 3),
        ([None, 1, None, None], 1),
        ([2, 1, None, None], 0),
        ([1, -11, -9, None], 1),
    ],
)
def test_the_cause_of_a_groups_failure_is_the_signalled_rank(
    codes: list[int | None], cause: int | None
) -> None:
    from torsh_distributed.ft.launch import _cause

    assert _cause(codes) == cause


@pytest.mark.parametrize(("groups", "dp", "per_rank"), [(1, 2, 16), (2, 1, 16), (2, 2, 8), (4, 2, 4)])
def test_the_plans_per_rank_batch_splits_over_the_groups_first(
    groups: int, dp: int, per_rank: int
) -> None:
    """The per-rank batch the run announces, samples/s counts and the memory estimate uses:
    ``batch_size / (replica_groups x dp)``; ``world_size`` is one group's."""
    from torsh_distributed.engine._plan import plan_run

    cfg = EngineConfig(batch_size=32, ft=FTConfig(replica_groups=groups))
    assert plan_run(cfg, world_size=dp, tp_plan=None).per_dp == per_rank
