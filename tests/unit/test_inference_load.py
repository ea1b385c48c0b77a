"""Loading training checkpoints for inference, in one process: choosing the checkpoint (newest
valid, clear errors), the recorded GPT config, the GPT's tensor-parallel qkv order, user models.

Checkpoints here are written by the real :class:`CheckpointManager` (what the engine uses) in a
world of one; tests/distributed/test_inference_checkpoints.py loads checkpoints of real dp /
ZeRO-3 / tp / pp / ep training runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torsh_distributed.checkpoint import CheckpointManager, step_dir_name
from torsh_distributed.inference.load import (
    find_checkpoint,
    load_gpt,
    load_model_state,
    read_gpt_config,
)
from torsh_distributed.models.config import (
    ModelConfig,
    MoESection,
    gpt_config_from_info,
    gpt_model_info,
)
from torsh_distributed.models.gpt import GPT
from torsh_distributed.models.gpt_tp import permute_qkv
from torsh_distributed.testing.models import mlp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CONFIG = ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=16)


def _gpt(seed: int, config: ModelConfig = CONFIG, moe: MoESection | None = None) -> GPT:
    torch.manual_seed(seed)
    return GPT(config, moe=moe)


def _save(
    root: Path,
    steps: dict[int, torch.nn.Module],
    *,
    info: dict | None = None,
    layout: dict | None = None,
) -> None:
    """Save ``steps[step]`` as checkpoint ``step`` (with the trainer's model record ``info``)."""
    manager = CheckpointManager(root, keep_last=0, async_save=False, layout=layout)
    for step, model in steps.items():
        optim = torch.optim.AdamW(model.parameters())
        extra = {"model": info} if info else {}
        manager.save(step, model=model, optimizer=optim, extra=extra)
    manager.close()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(32).reshape(2, 16) % 64)


# --- choosing the checkpoint ----------------------------------------------------------------


def test_newest_valid_checkpoint_is_loaded_and_a_corrupt_newer_one_skipped(tmp_path: Path):
    models = {1: _gpt(1), 2: _gpt(2)}
    _save(tmp_path, models, info=gpt_model_info(CONFIG))
    model, config, info = load_gpt(tmp_path)
    assert config == CONFIG and info.step == 2 and info.path == tmp_path / step_dir_name(2)
    assert _same(model, models[2]) and not model.training and not info.skipped
    assert info.model["tokenizer"] == {"kind": "bytes"}

    shard = next((tmp_path / step_dir_name(2)).glob("*.distcp"))
    with open(shard, "r+b") as fp:  # truncate the newest checkpoint's data
        fp.truncate(os.path.getsize(shard) // 2)
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step_00000002.*truncated"):
        assert find_checkpoint(tmp_path) == tmp_path / step_dir_name(1)
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        model, _, info = load_gpt(tmp_path)
    assert info.step == 1 and _same(model, models[1])
    assert len(info.skipped) == 1 and shard.name in info.skipped[0]
    # the step directory itself, named explicitly, is refused with the file and the reason
    with pytest.raises(ValueError, match=rf"step_00000002: INVALID \({shard.name}\): size"):
        load_gpt(tmp_path / step_dir_name(2))
    assert _same(load_gpt(tmp_path / step_dir_name(1))[0], models[1])


def test_every_checkpoint_invalid_is_an_error_listing_each(tmp_path: Path):
    _save(tmp_path, {1: _gpt(1), 2: _gpt(2)}, info=gpt_model_info(CONFIG))
    for step in (1, 2):
        meta = tmp_path / step_dir_name(step) / "meta.json"
        meta.write_text(meta.read_text().replace('"step"', '"stap"'))
    with pytest.raises(
        ValueError,
        match=r"(?s)no valid checkpoint in .*failed verification:\n.*step_00000002.*\n.*step_00000001",
    ):
        find_checkpoint(tmp_path)


def test_paths_that_hold_no_checkpoint_say_why(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory: .*nowhere"):
        find_checkpoint(tmp_path / "nowhere")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="notes.txt is a file, not a checkpoint directory"):
        load_gpt(tmp_path / "notes.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: it holds no step_XXXXXXXX"):
        load_gpt(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="holds no step_XXXXXXXX"):
        find_checkpoint(tmp_path)  # a directory of other things
    (tmp_path / "run" / ".tmp-step_00000005").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"only unfinished saves \(.tmp-step_00000005\)"):
        find_checkpoint(tmp_path / "run")
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "plain_dcp"), no_dist=True)
    with pytest.raises(ValueError, match="without the manifest .* cannot be verified"):
        find_checkpoint(tmp_path / "plain_dcp")  # torch's own DCP directory: not verifiable


# --- the model's config ----------------------------------------------------------------------


def test_the_recorded_moe_config_rebuilds_the_moe_gpt(tmp_path: Path):
    moe = MoESection(num_experts=4, top_k=2)
    trained = _gpt(3, moe=moe)
    _save(tmp_path, {5: trained}, info=gpt_model_info(CONFIG, moe))
    assert read_gpt_config(tmp_path) == (CONFIG, moe)
    model, _, _ = load_gpt(tmp_path, dtype=torch.bfloat16)
    assert model.moe == moe and model.tok_emb.weight.dtype == torch.bfloat16
    assert torch.equal(model.tok_emb.weight, trained.tok_emb.weight.to(torch.bfloat16))


def test_a_checkpoint_without_config_needs_one_and_loads_with_it(tmp_path: Path):
    trained = _gpt(4)
    _save(tmp_path, {3: trained})  # as written before the trainer recorded the model
    with pytest.raises(
        ValueError, match=r"does not record the model's configuration .*pass config="
    ):
        load_gpt(tmp_path)
    model, config, info = load_gpt(tmp_path, config=CONFIG)
    assert config == CONFIG and info.model == {} and _same(model, trained)
    wrong = ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32)
    with pytest.raises(ValueError, match=r"other shapes than the model: tok_emb.weight \(64, 16\)"):
        load_gpt(tmp_path, config=wrong)


def test_model_info_round_trip_and_unknown_fields():
    moe = MoESection(num_experts=2, top_k=1)
    assert gpt_config_from_info(gpt_model_info(CONFIG, moe)) == (CONFIG, moe)
    assert gpt_config_from_info(gpt_model_info(CONFIG)) == (CONFIG, None)
    info = gpt_model_info(CONFIG)
    info["config"]["rope_theta"] = 1e4
    with pytest.raises(ValueError, match=r"fields \['rope_theta'\] .*newer version"):
        gpt_config_from_info(info)


# --- the GPT's tensor-parallel qkv order -----------------------------------------------------


def test_qkv_rows_saved_in_tp_order_are_put_back(tmp_path: Path):
    trained = _gpt(5)
    permuted = _gpt(5)
    permute_qkv(permuted, 2)  # what a tp=2 run holds (and saves) after the plan's prepare step
    assert not _same(permuted, trained)
    _save(tmp_path, {7: permuted}, info=gpt_model_info(CONFIG), layout={"tp": 2})
    model, _, info = load_gpt(tmp_path)
    assert info.layout == {"tp": 2} and _same(model, trained)
    assert torch.equal(_logits(model), _logits(trained))
    # a model in the same order (layout given) receives the rows as stored
    raw = _gpt(0)
    load_model_state(raw, tmp_path, layout={"tp": 2})
    assert _same(raw, permuted)


# --- user models -----------------------------------------------------------------------------


def test_a_user_model_loads_and_mismatches_are_named(tmp_path: Path):
    torch.manual_seed(0)
    trained = mlp()
    _save(tmp_path, {2: trained}, info={"kind": "factory", "factory": "pkg:make"})
    fresh = mlp()
    info = load_model_state(fresh, tmp_path)
    assert _same(fresh, trained) and info.step == 2 and info.world_size == 1
    with pytest.raises(ValueError, match="a factory model .*pkg:make.*load_model_state"):
        load_gpt(tmp_path)
    bigger = torch.nn.Sequential(*mlp(), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"missing from the checkpoint: 5.weight, 5.bias"):
        load_model_state(bigger, tmp_path)
    info = load_model_state(bigger, tmp_path, strict=False)
    assert info.missing == ("5.weight", "5.bias") and info.unexpected == ()
    assert torch.equal(bigger[0].weight, trained[0].weight)


def test_a_user_models_tp_layout_is_not_guessed(tmp_path: Path):
    torch.manual_seed(0)
    _save(tmp_path, {1: mlp()}, info={"kind": "factory", "factory": "pkg:make"}, layout={"tp": 2})
    with pytest.raises(ValueError, match=r"layout \{'tp': 2\} .*model is in layout plain"):
        load_model_state(mlp(), tmp_path)
    load_model_state(mlp(), tmp_path, layout={"tp": 2})  # the caller says it matches
