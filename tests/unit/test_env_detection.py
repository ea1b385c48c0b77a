"""Layout detection from torchrun, SLURM and Open MPI variables."""

from __future__ import annotations

import pytest

from torsh_distributed.runtime.env import (
    MPIEnvironment,
    SlurmEnvironment,
    TorchrunEnvironment,
    detect_environment,
    expand_slurm_nodelist,
)
from torsh_distributed.runtime.errors import ConfigurationError, RankOutOfRangeError


def test_nothing_set_is_not_distributed():
    assert detect_environment({}) is None


def test_torchrun_variables():
    env = {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
    }
    info = detect_environment(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 4)
    assert (info.node_rank, info.master_addr, info.master_port) == (1, "10.0.0.1", 29400)
    assert info.source == "torchrun"


def test_torchrun_node_rank_derived_when_missing():
    info = TorchrunEnvironment().world_info(
        {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}
    )
    assert info.node_rank == 1


def test_slurm_variables_and_master_from_nodelist():
    env = {
        "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242",
    }
    info = detect_environment(env)
    assert info.source == "slurm"
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert info.node_rank == 1
    assert info.master_addr == "gpu07"
    assert info.master_port == 15000 + 4242 % 20000


def test_slurm_uneven_tasks_per_node():
    env = {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
           "SLURM_TASKS_PER_NODE": "2(x2),1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
    info = SlurmEnvironment().world_info(env)
    assert info.local_world_size == 1
    assert (info.master_addr, info.master_port) == ("h0", 1234)


def test_torchrun_wins_over_slurm():
    env = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert detect_environment(env).source == "torchrun"


def test_openmpi_variables():
    env = {
        "OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "MASTER_ADDR": "node0",
    }
    info = detect_environment(env)
    assert info.source == "mpi"
    assert (info.rank, info.world_size, info.local_rank, info.node_rank) == (6, 8, 2, 1)
    assert info.master_addr == "node0" and info.master_port is None


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("a[1-2],b5", ["a1", "a2", "b5"]),
        ("rack[9-11]-ib", ["rack9-ib", "rack10-ib", "rack11-ib"]),
    ],
)
def test_expand_slurm_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


def test_rank_beyond_world_from_env_is_rejected():
    with pytest.raises(RankOutOfRangeError, match="rank 4 is out of range for world_size 4"):
        detect_environment({"RANK": "4", "WORLD_SIZE": "4"})


def test_non_integer_variable_names_the_variable():
    with pytest.raises(ConfigurationError, match="WORLD_SIZE='two' is not an integer"):
        detect_environment({"RANK": "0", "WORLD_SIZE": "two"})


def test_bad_master_port():
    with pytest.raises(ConfigurationError, match="MASTER_PORT=70000 is not a valid TCP port"):
        TorchrunEnvironment().world_info({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"})


def test_bad_slurm_tasks_per_node():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "two"}
    with pytest.raises(ConfigurationError, match="cannot parse SLURM_TASKS_PER_NODE"):
        SlurmEnvironment().world_info(env)


def test_mpi_requires_rank_and_size_to_detect():
    assert not MPIEnvironment().detect({"OMPI_COMM_WORLD_RANK": "0"})
