"""RPCConfig validation, the name registry and the error types (no processes started)."""

from __future__ import annotations

import pickle

import pytest

from torsh_distributed import rpc
from torsh_distributed.rpc.registry import _Failure, _invoke
from torsh_distributed.runtime.errors import DistributedTimeoutError


def _cfg(**overrides: object) -> rpc.RPCConfig:
    fields: dict[str, object] = {"name": "w0", "rank": 0, "world_size": 2, "master_port": 29500}
    fields.update(overrides)
    return rpc.RPCConfig(**fields)  # type: ignore[arg-type]


def test_defaults_are_loopback_and_need_no_token() -> None:
    cfg = _cfg()
    assert cfg.interface == "lo" and cfg.master_addr == "127.0.0.1" and not cfg.exposed
    assert "s3cret" not in repr(_cfg(token="s3cret"))  # secrets stay out of logs


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"name": "bad name"}, ValueError, "name must be"),
        ({"rank": 2}, ValueError, r"rank must be in \[0, 2\)"),
        ({"world_size": 0}, ValueError, "world_size must be >= 1"),
        ({"rank": True}, TypeError, "rank must be an int"),
        ({"timeout": 0}, ValueError, "timeout must be a positive"),
        ({"shutdown_timeout": float("inf")}, ValueError, "shutdown_timeout must be a positive"),
        ({"master_port": None}, ValueError, "pass store_url or master_port"),
        ({"master_port": 70000}, ValueError, "master_port must be in 1-65535"),
        ({"store_url": "memory://"}, ValueError, "visible to one process only"),
        ({"interface": "eth0"}, ValueError, "token is required"),
        ({"master_addr": "10.1.2.3"}, ValueError, "token is required"),
        ({"store_url": "redis://10.1.2.3:6379"}, ValueError, "token is required"),
        ({"token": ""}, ValueError, "token must be a non-empty str"),
    ],
)
def test_bad_settings_are_refused(overrides: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _cfg(**overrides)


def test_exposed_with_token_is_accepted() -> None:
    assert _cfg(interface="eth0", token="t").exposed
    assert not _cfg(store_url="file:///tmp/x").exposed


def test_init_refuses_config_and_fields_together() -> None:
    with pytest.raises(TypeError, match="not both"):
        rpc.init(_cfg(), name="w1")


def test_calls_need_init() -> None:
    with pytest.raises(RuntimeError, match="not initialized"):
        rpc.rpc_sync("w1", max, args=(1, 2))
    assert rpc.shutdown() is True  # nothing running: a no-op


def test_registry_names_and_duplicates() -> None:
    def f() -> int:
        return 1

    def g() -> int:
        return 2

    try:
        rpc.register("unit.f")(f)
        rpc.register("unit.f")(f)  # the same function again: fine
        assert "unit.f" in rpc.registered_names()
        with pytest.raises(ValueError, match="already registered"):
            rpc.register("unit.f")(g)
        assert _invoke("unit.f", (), {}) == 1
        missing = _invoke("unit.none", (), {})
        assert isinstance(missing, _Failure) and "unit.f" in missing.registered
    finally:
        rpc.unregister("unit.f")
    assert "unit.f" not in rpc.registered_names()


def test_error_types_and_pickling() -> None:
    assert issubclass(rpc.RPCTimeoutError, DistributedTimeoutError)
    assert issubclass(rpc.RPCTimeoutError, TimeoutError)
    assert issubclass(rpc.UnknownFunctionError, ValueError)
    err = rpc.RemoteError("f raised", peer="w1", function="f", remote_traceback="Traceback: x")
    back = pickle.loads(pickle.dumps(err))
    assert back.peer == "w1" and "--- traceback on w1 ---" in str(back)
