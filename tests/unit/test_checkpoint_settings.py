"""What a checkpoint's stored settings tell a resuming run, and the attempts progress.json keeps."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from torsh_distributed.checkpoint._settings import changed_settings, check_settings
from torsh_distributed.checkpoint.progress import (
    attempt_entry,
    carried_attempts,
    read_progress,
    record_progress,
)

SAVED = {"optim": {"lr": 0.003, "schedule": "cosine"}, "max_steps": 100, "batch_size": 8}


def _meta(settings: dict) -> dict:
    from torsh_distributed.checkpoint._settings import flatten_settings

    return {"config_hash": "old", "settings": flatten_settings(settings)}


def test_changed_settings_are_flattened_and_name_both_values():
    now = {"optim": {"lr": 0.01, "schedule": "cosine"}, "max_steps": 200, "seed": 1}
    assert changed_settings(_meta(SAVED)["settings"], now) == {
        "batch_size": (8, "<unset>"),
        "max_steps": (100, 200),
        "optim.lr": (0.003, 0.01),
        "seed": ("<unset>", 1),
    }


def test_the_warning_names_every_setting_that_differs():
    now = {**SAVED, "optim": {"lr": 0.01, "schedule": "cosine"}, "max_steps": 200}
    with pytest.warns(UserWarning, match=r"different configuration: max_steps 100 -> 200, optim.lr 0.003 -> 0.01$"):
        changes = check_settings(
            _meta(SAVED), path=Path("c"), config_hash="new", settings=now, expected={"max_steps"}
        )
    assert set(changes) == {"max_steps", "optim.lr"}


def test_only_an_expected_change_is_returned_without_a_warning():
    now = {**SAVED, "max_steps": 200}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        changes = check_settings(
            _meta(SAVED), path=Path("c"), config_hash="new", settings=now, expected={"max_steps"}
        )
    assert changes == {"max_steps": (100, 200)}


def test_a_checkpoint_without_settings_can_only_name_the_hashes():
    with pytest.warns(UserWarning, match="hash old vs new; it does not store its settings"):
        check_settings({"config_hash": "old"}, path=Path("c"), config_hash="new", settings=SAVED)


def test_attempts_carry_over_within_a_job_and_not_into_the_next(tmp_path):
    first = attempt_entry(0, resumed_step=0, lost_steps=0)
    record_progress(tmp_path, step=7, world_size=2, members=[], job="j", attempt=0, attempts=[first])
    previous = read_progress(tmp_path)
    carried = carried_attempts(previous, job="j", attempt=1)
    assert [(a["attempt"], a["reached_step"]) for a in carried] == [(0, 7)]
    assert carried_attempts(previous, job="j", attempt=0) == []  # the same command run again
    assert carried_attempts(previous, job="other", attempt=1) == []
    assert carried_attempts(None, job="j", attempt=1) == []
