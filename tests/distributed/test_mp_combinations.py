"""Mixed precision, activation checkpointing and meta-device init together with tp/pp (refused
before the one engine): each trains, and matches one process where the computation is the same."""

from __future__ import annotations

from typing import Any

import pytest

from torsh_distributed.testing import run_distributed
from torsh_distributed.testing.configs import small_config


def _losses(cases: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    from torsh_distributed.train import TrainConfig, train

    out = {}
    for name, overrides in cases.items():
        data = small_config(steps=6).to_dict()
        data["parallel"].update(overrides)
        out[name] = train(TrainConfig.from_dict(data)).losses
    return out


CASES = {
    "pp2 ac": {"pp": 2, "activation_checkpointing": "full"},
    "tp2 ac": {"tp": 2, "activation_checkpointing": "every-2"},
    "tp2 bf16": {"tp": 2, "param_dtype": "bf16"},
    "pp2 bf16": {"pp": 2, "param_dtype": "bf16"},
    "pp2 meta": {"pp": 2, "meta_init": True},
}


@pytest.mark.slow
def test_precision_checkpointing_and_meta_init_with_tp_and_pp():
    reference = run_distributed(_losses, 1, args=({"fp32": {}},), timeout=120)[0]["fp32"]
    results = run_distributed(_losses, 2, args=(CASES,), timeout=300)
    assert results[0] == results[1], "ranks disagree"
    got = results[0]
    for name in ("pp2 ac", "tp2 ac"):  # recomputation changes nothing
        assert got[name] == pytest.approx(reference, rel=1e-5), name
    for name in ("tp2 bf16", "pp2 bf16"):  # bf16 matmuls: close, not equal
        assert got[name] == pytest.approx(reference, rel=1e-2), name
        assert got[name] != reference, f"{name}: bf16 did not change the computation"
    for name in ("pp2 meta",):  # a fresh initial draw: trains, differs from fp32's
        assert got[name] != reference and got[name][-1] < got[name][0], name


def _refused() -> str:
    try:
        _losses({"tp2 meta": {"tp": 2, "meta_init": True}})
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_meta_init_with_tp_is_refused_on_cpu():
    for msg in run_distributed(_refused, 2, timeout=60):
        assert "parallel.meta_init with tp > 1 needs DTensor's distributed random numbers" in msg
