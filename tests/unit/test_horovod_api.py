"""The Horovod API in one process: names, errors, compression, Adasum's formula, the
horovodrun mapping, a world of one, and the elastic state's commit / restore / resume."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torsh_distributed.compat.horovod.torch as hvd
from torsh_distributed.cli.main import main
from torsh_distributed.compat.horovod._adasum import adasum_pair, check_adasum_world
from torsh_distributed.compat.horovod._runner import (
    parse_hostfile,
    parse_hosts,
    plan_horovodrun,
    split_command,
)

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                  "TORCHELASTIC_MAX_RESTARTS", "TORSH_HOROVOD_ELASTIC_DIR")


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch):
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    hvd.init()
    try:
        yield
    finally:
        hvd.shutdown()


# -- names and errors ---------------------------------------------------------------------------
def test_the_issue_name_is_the_same_module():
    import torsh_distributed.horovod.torch.elastic as alias_elastic

    import torsh_distributed.horovod.torch as alias

    assert alias is hvd and alias_elastic is hvd.elastic


@pytest.mark.parametrize("name", ["SyncBatchNorm", "start_timeline", "add_process_set"])
def test_unsupported_horovod_names_say_so(name: str):
    with pytest.raises(NotImplementedError, match=rf"Horovod's {name} is not supported"):
        getattr(hvd, name)
    assert not hasattr(hvd, name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_api'"):
        hvd.no_such_api  # noqa: B018


def test_calls_before_init_fail_like_horovod():
    with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)"):
        hvd.rank()
    with pytest.raises(NotImplementedError, match="MPI communicators|no MPI"):
        hvd.init(comm=[0, 1])


def test_ops_and_flags_are_horovods():
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert hvd.mpi_built() is False and hvd.ddl_built() is False and hvd.ccl_built() is False
    assert hvd.gloo_built() is torch.distributed.is_gloo_available()
    assert hvd.nccl_built() is torch.distributed.is_nccl_available()


# -- compression ----------------------------------------------------------------------------------
def test_fp16_compression_round_trip_keeps_dtype_and_leaves_integers():
    x = torch.tensor([1.0, 2.5, -3.25], dtype=torch.float64)
    sent, ctx = hvd.Compression.fp16.compress(x)
    assert sent.dtype == torch.float16
    assert torch.equal(hvd.Compression.fp16.decompress(sent, ctx), x)
    ints = torch.arange(3)
    sent, ctx = hvd.Compression.fp16.compress(ints)
    assert sent is ints and hvd.Compression.fp16.decompress(sent, ctx) is ints


def test_our_compressors_through_compression_torsh():
    topk = hvd.Compression.torsh("topk:0.01")
    assert isinstance(topk, hvd.TorshCompression) and topk.name == "topk:0.01"
    with pytest.raises(ValueError, match="'auto' is not available"):
        hvd.Compression.torsh("auto")
    with pytest.raises(ValueError, match="unknown compression spec"):
        hvd.Compression.torsh("zip")
    with pytest.raises(TypeError, match="pass it to hvd.DistributedOptimizer"):
        topk.compress(torch.ones(3))


# -- Adasum ---------------------------------------------------------------------------------------
def test_adasum_pair_follows_the_formula():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    assert torch.equal(adasum_pair(a, b), a + b)  # orthogonal: sum
    assert torch.allclose(adasum_pair(a, a), a)  # parallel and equal: the average
    zero = torch.zeros(2)
    assert torch.equal(adasum_pair(zero, b), b)  # a zero norm keeps coefficient 1
    a, b = torch.tensor([3.0, 1.0]), torch.tensor([1.0, 2.0])
    dot = 5.0
    want = (1 - dot / 20) * a + (1 - dot / 10) * b
    assert torch.allclose(adasum_pair(a, b), want, atol=1e-7)
    with pytest.raises(NotImplementedError, match="power-of-two number of ranks.*got 3"):
        check_adasum_world(3)


# -- horovodrun mapping ---------------------------------------------------------------------------
def test_hosts_and_hostfiles(tmp_path: Path):
    assert parse_hosts("localhost:4") == [("localhost", 4)]
    assert parse_hosts("a:2, b") == [("a", 2), ("b", 1)]
    with pytest.raises(ValueError, match="slots >= 1"):
        parse_hosts("a:0")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nlocalhost slots=3\n")
    assert parse_hostfile(str(hostfile)) == [("localhost", 3)]


def test_commands():
    assert split_command(["python", "-u", "train.py", "--lr", "1"]) == ("train.py", None, ["--lr", "1"])
    assert split_command(["python3.11", "-m", "pkg.train", "-x"]) == (None, "pkg.train", ["-x"])
    assert split_command(["train.py"]) == ("train.py", None, [])
    with pytest.raises(ValueError, match="not other programs"):
        split_command(["bash", "run.sh"])


def test_plan_maps_onto_the_launcher(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TORSH_HOROVOD_ELASTIC_DIR", raising=False)
    plan = plan_horovodrun(np=2, hosts="localhost:4", command=["python", "t.py", "--a"],
                           network_interface="lo", elastic_dir="/tmp/x", ignored=["--cycle-time-ms"])
    assert (plan.options.nproc_per_node, plan.options.max_restarts) == (2, 0)
    assert (plan.script, plan.module, plan.args) == ("t.py", None, ["--a"])
    assert plan.options.env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
                                "TORSH_HOROVOD_ELASTIC_DIR": "/tmp/x"}
    assert plan.notes == ["--cycle-time-ms has no effect here (Horovod tuning of its own engine)"]
    elastic = plan_horovodrun(np=2, min_np=1, max_np=4, command=["t.py"])
    assert elastic.options.max_restarts == 3
    assert "ignored on one host" in elastic.notes[0]
    assert plan_horovodrun(np=2, reset_limit=5, command=["t.py"]).options.max_restarts == 5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-np", "4", "-H", "localhost:2", "python", "x.py"], "larger than the 2 slot(s)"),
        (["-np", "4", "-H", "node-a:2,node-b:2", "python", "x.py"],
         "on node-b: torsh-dist run --nnodes 2 --node-rank 1 --nproc-per-node 2 "
         "--master-addr node-a --master-port 29500 python x.py"),
        (["-np", "2", "--mpi", "python", "x.py"], "--mpi is not supported"),
        (["-np", "2", "--host-discovery-script", "d.sh", "python", "x.py"],
         "--host-discovery-script is not supported"),
        (["-np", "2", "bash", "run.sh"], "not other programs"),
        (["-np", "2", "--reset-limit", "1", "--max-restarts", "2", "python", "x.py"],
         "the same setting"),
    ],
)
def test_horovodrun_refuses_what_it_cannot_launch(argv, message, capsys):
    assert main(["horovodrun", *argv]) == 2
    assert message in capsys.readouterr().err


# -- a world of one -------------------------------------------------------------------------------
def test_a_world_of_one_runs_a_horovod_step(world_of_one):
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_initialized()) == (0, 1, True)
    x = torch.arange(4.0)
    assert torch.equal(hvd.allreduce(x), x)
    assert torch.equal(hvd.allgather(x), x)
    assert hvd.broadcast_object({"a": 1}) == {"a": 1}
    assert hvd.join() == 0
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(plain, root_rank=0)  # creates the momentum buffers
    assert all(not s["momentum_buffer"].any() for s in plain.state.values())
    opt = hvd.DistributedOptimizer(plain, named_parameters=model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    F.mse_loss(model(torch.ones(2, 3)), torch.zeros(2, 1)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        assert torch.allclose(p.detach(), b - 0.1 * g)


# -- elastic state --------------------------------------------------------------------------------
def _state() -> tuple[nn.Module, torch.optim.Optimizer, hvd.elastic.TorchState]:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, hvd.elastic.TorchState(model, opt, epoch=0, batch=0)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()


def test_commit_restore_and_resume_after_a_restart(world_of_one, tmp_path, monkeypatch):
    monkeypatch.setenv("TORSH_HOROVOD_ELASTIC_DIR", str(tmp_path))
    model, opt, state = _state()
    _step(model, opt)
    state.batch = 3
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    assert (tmp_path / "commit.pt").is_file()
    _step(model, opt)
    state.batch = 4
    state.restore()  # back to the commit, momentum included
    assert state.batch == 3
    assert all(torch.equal(p, c) for p, c in zip(model.parameters(), committed, strict=True))
    _step(model, opt)
    after_one_more = [p.detach().clone() for p in model.parameters()]

    # a restarted process: fresh objects, the commit comes from the file
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    model2, opt2, state2 = _state()
    resets = []
    state2.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def resume(s):
        _step(s.model, s.optimizer)
        return s.batch

    assert resume(state2) == 3 and resets == [1]
    assert all(torch.equal(p, a) for p, a in zip(model2.parameters(), after_one_more, strict=True))


def test_run_reraises_internal_errors_and_retries_on_host_updates(world_of_one, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    model, opt, state = _state()
    calls, resets = [], []
    state.register_reset_callbacks([lambda: resets.append(True)])

    @hvd.elastic.run
    def train(s):
        calls.append(s.batch)
        s.batch = 7 + len(calls)
        if len(calls) == 1:
            raise hvd.HostsUpdatedInterrupt(skip_sync=True)  # keeps the values: no sync
        if len(calls) == 2:
            raise hvd.HostsUpdatedInterrupt(skip_sync=False)  # sync: back to the saved values
        raise hvd.HorovodInternalError("peer died")

    with pytest.raises(hvd.HorovodInternalError, match="peer died"):
        train(state)
    assert calls == [0, 8, 0] and resets == [True, True]
    assert state.batch == 0  # restored to the last commit (the constructor's values)


def test_memory_only_commits_warn_under_an_agent_with_restarts(world_of_one, monkeypatch):
    import torsh_distributed.compat.horovod._elastic as impl

    monkeypatch.setattr(impl, "_warned_memory_only", False)
    monkeypatch.delenv("TORSH_HOROVOD_ELASTIC_DIR", raising=False)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    _, _, state = _state()
    with pytest.warns(UserWarning, match="commits are kept in memory only"):
        state.commit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state.commit()  # warned once


def test_elastic_sampler_skips_processed_samples(world_of_one):
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    assert list(sampler) == list(range(10))
    sampler.record_batch(0, 4)
    sampler.load_state_dict(sampler.state_dict())
    assert list(sampler) == list(range(4, 10)) and len(sampler) == 6
    sampler.set_epoch(1)
    assert len(sampler) == 10


def test_examples_import_only_the_compat_module():
    examples = Path(__file__).resolve().parents[2] / "examples" / "horovod"
    for script in sorted(examples.glob("*.py")):
        text = script.read_text()
        assert "import torsh_distributed.compat.horovod.torch as hvd" in text, script
        others = [line for line in text.splitlines()
                  if "torsh_distributed" in line and line.startswith(("import", "from"))]
        assert len(others) == 1, (script, others)
