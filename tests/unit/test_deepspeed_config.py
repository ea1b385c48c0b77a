"""DeepSpeed JSON configs on the engine: every key of a corpus of 25 public-shaped configs is
classified, values land where they should, "auto" resolves by Hugging Face's rules, and bad
batch triples, contradictions and (with strict) unsupported keys are refused with the numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from torsh_distributed.compat.deepspeed import import_deepspeed, load_deepspeed_json
from torsh_distributed.engine.config import EngineConfig
from torsh_distributed.train.config import preset

CORPUS = sorted((Path(__file__).parent.parent / "data" / "deepspeed").glob("*.json"))


def _leaves(data: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        out.extend(_leaves(value, path + ".") if isinstance(value, dict) and value else [path])
    return out


def test_the_corpus_is_large_enough():
    assert len(CORPUS) >= 20


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_every_key_is_classified_once(path: Path):
    data = json.loads(path.read_text())
    config, report = import_deepspeed(path, preset("tiny"), world_size=2, hidden_size=64)
    keys = [e.key for e in report.entries if not e.key.endswith("(derived)")]
    assert len(keys) == len(set(keys)), "a key reported twice"
    for leaf in _leaves(data):  # covered by its own entry or by an unknown parent's
        assert any(leaf == k or leaf.startswith(k + ".") for k in keys), leaf
    assert {e.status for e in report.entries} <= {"applied", "mapped", "unsupported", "default", "ignored"}
    assert all(e.note for e in report.entries if e.status != "applied")
    assert config.batch_size >= 1


def _import(ds: dict[str, Any], world_size: int = 2, **kw: Any) -> tuple[EngineConfig, Any]:
    return import_deepspeed(ds, EngineConfig(batch_size=32, grad_accum=1), world_size=world_size, **kw)


def test_values_land_on_our_settings():
    config, report = _import(
        {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 7, "total_num_steps": 50, "cos_min_ratio": 0.2}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "bf16": {"enabled": True},
        }
    )
    assert (config.batch_size, config.grad_accum) == (16, 2)  # 4 x 2 x 2 ranks
    o = config.optim
    assert (o.lr, o.beta1, o.beta2, o.eps, o.grad_clip) == (3e-4, 0.8, 0.99, 1e-6, 0.5)
    assert (o.schedule, o.warmup_steps, o.min_lr_ratio, config.max_steps) == ("cosine", 7, 0.2, 50)
    p = config.parallel
    assert (p.zero_stage, p.offload, p.param_dtype) == (3, "cpu", "bf16")
    assert not report.unsupported


def test_auto_resolves_like_hugging_face():
    base = EngineConfig(batch_size=32, grad_accum=2)
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "gradient_clipping": "auto"}
    config, _ = import_deepspeed(ds, base, world_size=4)
    assert (config.batch_size, config.grad_accum) == (32, 2)  # micro 4 x accum 2 x 4 ranks
    assert config.optim.lr == base.optim.lr and config.optim.grad_clip == base.optim.grad_clip
    # micro given, total "auto", accumulation absent (DeepSpeed's default 1): micro x 1 x world
    config, _ = import_deepspeed({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 3}, base, world_size=4)
    assert (config.batch_size, config.grad_accum) == (12, 1)


def test_batch_triples_are_checked_with_the_numbers():
    with pytest.raises(ValueError, match=r"train_batch_size 32 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x 2 data-parallel ranks = 16"):
        _import({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    with pytest.raises(ValueError, match=r"train_batch_size 30 is not a multiple of train_micro_batch_size_per_gpu 4 x 2 data-parallel ranks = 8"):
        _import({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})
    config, report = _import({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8})
    assert config.grad_accum == 4
    assert any(e.key == "gradient_accumulation_steps (derived)" and e.value == 4 for e in report.entries)


def test_misspellings_get_a_suggestion_and_strict_refuses_them():
    _, report = _import({"gradient_accumulation_step": 2, "zero_optimisation": {"stage": 2}, "fp16": {"enable": True}})
    notes = {e.key: e.note for e in report.unsupported}
    assert "did you mean 'gradient_accumulation_steps'" in notes["gradient_accumulation_step"]
    assert "did you mean 'zero_optimization'" in notes["zero_optimisation"]
    assert "did you mean 'fp16.enabled'" in notes["fp16.enable"]
    with pytest.raises(ValueError, match=r"--strict: unsupported DeepSpeed config keys: .*gradient_accumulation_step"):
        _import({"gradient_accumulation_step": 2}, strict=True)


def test_unsupported_features_are_named():
    _, report = _import({"fp16": {"enabled": True, "hysteresis": 2}, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}},
                         "optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3}}})
    notes = {e.key: e.note for e in report.unsupported}
    assert "halves on every overflow" in notes["fp16.hysteresis"]
    assert "NVMe" in notes["zero_optimization.offload_param.device"]
    assert "only Adam, AdamW, SGD, OneBitAdam and ZeroOneAdam" in notes["optimizer.type"]


def test_contradicting_an_explicit_flag_is_refused():
    with pytest.raises(ValueError, match=r"--optim.lr 0.001 vs 0.0003 from the DeepSpeed config"):
        _import({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}, explicit={"optim.lr": 1e-3})
    _import({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, explicit={"optim.lr": 1e-3})  # auto: no conflict


def test_bad_files_and_values(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_deepspeed_json(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_deepspeed_json(bad)
    with pytest.raises(ValueError, match="zero_optimization.stage must be 0-3"):
        _import({"zero_optimization": {"stage": 4}})
    with pytest.raises(ValueError, match='train_batch_size must be an integer or "auto"'):
        _import({"train_batch_size": "32"})


def test_the_legacy_bfloat16_section_is_read_exactly_like_bf16():
    legacy, legacy_report = _import({"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    modern, _ = _import({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    assert legacy.parallel.param_dtype == "bf16"
    assert legacy.to_dict() == modern.to_dict()
    [entry] = [e for e in legacy_report.entries if e.key == "bfloat16.enabled"]
    assert (entry.status, entry.target) == ("applied", "parallel.param_dtype")
    assert "legacy name of bf16.enabled" in entry.note
    off, _ = _import({"bfloat16": {"enabled": False}})
    assert off.parallel.param_dtype == "fp32"
    # With both sections DeepSpeed reads bf16 only: bfloat16 is listed as ignored, not applied.
    both, report = _import({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}}, strict=True)
    assert both.parallel.param_dtype == "fp32"
    [shadowed] = [e for e in report.entries if e.key == "bfloat16.enabled"]
    assert shadowed.status == "ignored" and "reads the 'bf16' section" in shadowed.note
    _, report = _import({"bfloat16": {"enable": True}})
    assert "did you mean 'bf16.enabled'" in report.unsupported[0].note


def test_low_precision_master_state_is_reported_honestly():
    _, report = _import({"bf16": {"enabled": True, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}}, strict=True)
    assert not report.unsupported
    config, report = _import({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}})
    notes = {e.key: e.note for e in report.unsupported}
    assert "master weights and gradients stay fp32 here" in notes["bf16.bf16_master_weights_and_grads"]
    assert "optimizer states stay fp32 here" in notes["bf16.bf16_optimizer_states"]
    assert config.parallel.param_dtype == "bf16"


def test_compile_maps_to_torch_compile_of_each_block():
    config, report = _import({"compile": {"enabled": True, "backend": "inductor", "kwargs": {}}}, strict=True)
    assert config.parallel.compile is True
    [enabled] = [e for e in report.entries if e.key == "compile.enabled"]
    assert (enabled.status, enabled.target) == ("mapped", "parallel.compile")
    config, _ = _import({"compile": {"enabled": False}})
    assert config.parallel.compile is False
    config, report = _import({"compile": {"enabled": True, "backend": "eager", "kwargs": {"mode": "max-autotune"}}})
    notes = {e.key: e.note for e in report.unsupported}
    assert "blocks compile with inductor here" in notes["compile.backend"]
    assert "not configurable here" in notes["compile.kwargs"]
    # DeepCompile (newer releases) is not built; its settings matter only when it is on.
    _, report = _import({"compile": {"deepcompile": False, "offload_activation": False}}, strict=True)
    assert {e.status for e in report.entries if e.key in ("compile.deepcompile", "compile.offload_activation")} == {"applied", "mapped"}
    _, report = _import({"compile": {"deepcompile": True, "offload_activation": True}})
    notes = {e.key: e.note for e in report.unsupported}
    assert "DeepCompile" in notes["compile.deepcompile"] and "not built" in notes["compile.offload_activation"]
    with pytest.raises(ValueError, match="compile.enabled must be true or false"):
        _import({"compile": {"enabled": "yes"}})


def test_autotp_size_is_the_tensor_parallel_degree():
    config, report = _import({"tensor_parallel": {"autotp_size": 2}, "train_micro_batch_size_per_gpu": 4}, world_size=4)
    assert config.parallel.tp == 2
    assert config.batch_size == 8  # micro 4 x accumulation 1 x (4 ranks / tp 2)
    [entry] = [e for e in report.entries if e.key == "tensor_parallel.autotp_size"]
    assert (entry.status, entry.target) == ("mapped", "parallel.tp") and "TP plan" in entry.note
    config, _ = _import({"tensor_parallel": {"autotp_size": 0}})
    assert config.parallel.tp == 1
    with pytest.raises(ValueError, match=r"autotp_size 3 \(x pp 1\) does not divide the 4 ranks"):
        _import({"tensor_parallel": {"autotp_size": 3}}, world_size=4)
    with pytest.raises(ValueError, match="autotp_size must be an integer >= 0"):
        _import({"tensor_parallel": {"autotp_size": "2"}})
    _, report = _import({"tensor_parallel": {"autotp_size": 2, "tp_grain_size": 64}})
    assert [e.key for e in report.unsupported] == ["tensor_parallel.tp_grain_size"]


def test_comment_keys_are_listed_as_ignored_at_any_level_and_never_refused():
    ds = {"_comment": "ZeRO-2 for 8 GPUs", "_notes": {"author": "x"},
          "zero_optimization": {"stage": 2, "_comment": "keep buckets small"},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "_why": "sweep"}},
          "tensorboard": {"enabled": False, "_comment": "off"}}
    config, report = _import(ds, strict=True)
    ignored = {e.key for e in report.by_status("ignored")}
    assert ignored == {"_comment", "_notes", "zero_optimization._comment", "optimizer.params._why", "tensorboard._comment"}
    assert not any("did you mean" in e.note for e in report.entries)
    assert config.parallel.zero_stage == 2 and config.optim.lr == 1e-3
    assert report.format().splitlines()[0].endswith(", 5 ignored")


def test_activation_checkpointing_keys_alone_do_not_turn_recomputation_on():
    section = {"partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
               "number_checkpoints": 4, "synchronize_checkpoint_boundary": False, "profile": False}
    config, report = _import({"activation_checkpointing": section}, strict=True)
    assert config.parallel.activation_checkpointing == "none"
    entries = [e for e in report.entries if e.key.startswith("activation_checkpointing.")]
    assert len(entries) == 6
    assert all(e.status == "mapped" and e.target == "" and "section alone recomputes nothing" in e.note for e in entries)
    # recomputation chosen on our side stays as chosen
    base = EngineConfig(batch_size=32)
    base.parallel.activation_checkpointing = "every-2"
    config, _ = import_deepspeed({"activation_checkpointing": section}, base, world_size=2)
    assert config.parallel.activation_checkpointing == "every-2"
    _, report = _import({"activation_checkpointing": {"cpu_checkpointing": True, "partition_activations": True}})
    notes = {e.key: e.note for e in report.unsupported}
    assert "offloading checkpoints to the host" in notes["activation_checkpointing.cpu_checkpointing"]
    assert "partitioning checkpointed activations" in notes["activation_checkpointing.partition_activations"]


def _entry(report: Any, key: str) -> Any:
    [entry] = [e for e in report.entries if e.key == key]
    return entry


def test_omitted_keys_take_deepspeeds_defaults_not_the_presets():
    # the preset's own values differ from DeepSpeed's on every line checked here
    base = preset("tiny")
    assert (base.optim.beta2, base.optim.weight_decay, base.optim.grad_clip, base.optim.schedule) == (0.95, 0.01, 1.0, "cosine")
    config, report = import_deepspeed({"train_batch_size": 32, "optimizer": {"type": "OneBitAdam", "params": {"lr": 4e-4}}},
                                      base, world_size=2)
    o = config.optim
    assert (o.beta1, o.beta2, o.eps, o.weight_decay, o.freeze_step) == (0.9, 0.999, 1e-8, 0.0, 100000)
    assert (o.grad_clip, o.schedule, o.warmup_steps, o.lr) == (0.0, "constant", 0, 4e-4)
    for key, value, target in [("optimizer.params.betas", [0.9, 0.999], "optim.beta1/beta2"),
                               ("optimizer.params.weight_decay", 0.0, "optim.weight_decay"),
                               ("optimizer.params.freeze_step", 100000, "optim.freeze_step"),
                               ("gradient_clipping", 0.0, "optim.grad_clip"),
                               ("scheduler", None, "optim.schedule/warmup_steps"),
                               ("gradient_accumulation_steps", 1, "batch_size / grad_accum")]:
        e = _entry(report, key)
        assert (e.status, e.value, e.target) == ("default", value, target), e
        assert "omitted: DeepSpeed's default" in e.note
    assert "keeps the optimizer's lr constant" in _entry(report, "scheduler").note
    assert report.format().splitlines()[0].endswith(f"{len(report.by_status('default'))} default")


def test_scheduler_and_fp16_defaults_are_deepspeeds():
    ds = {"train_batch_size": 32, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
          "scheduler": {"type": "WarmupLR"}, "fp16": {"enabled": True}}
    config, report = _import(ds)
    # WarmupLR's warmup_max_lr (0.001) replaces the optimizer's lr, over 1000 log warm-up steps
    assert (config.optim.lr, config.optim.warmup_steps, config.optim.schedule) == (1e-3, 1000, "constant")
    assert (config.parallel.loss_scale_init, config.parallel.loss_scale_growth_interval) == (2.0**16, 1000)
    assert _entry(report, "scheduler.params.warmup_type").status == "default"
    # DeepSpeed's hysteresis 2 is not built: an omitted key we cannot honour is unsupported, and --strict says so
    assert "omitted: DeepSpeed's default" in _entry(report, "fp16.hysteresis").note
    assert [e.key for e in report.unsupported] == ["fp16.hysteresis"]
    with pytest.raises(ValueError, match=r"--strict: unsupported DeepSpeed config keys: fp16.hysteresis \(omitted"):
        _import(ds, strict=True)
    config, _ = _import({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 40}}})
    assert (config.optim.warmup_steps, config.optim.min_lr_ratio, config.max_steps) == (1000, 0.0001, 40)
    # precision, ZeRO and compile omitted: fp32, stage 0, no compile, whatever the base said
    base = EngineConfig(batch_size=32)
    base.parallel.param_dtype, base.parallel.zero_stage, base.parallel.compile = "bf16", 2, True
    config, _ = import_deepspeed({"train_batch_size": 32}, base, world_size=2)
    assert (config.parallel.param_dtype, config.parallel.zero_stage, config.parallel.compile) == ("fp32", 0, False)


def test_a_flag_given_on_the_command_line_wins_over_a_default():
    config, report = _import({"optimizer": {"type": "AdamW"}}, explicit={"optim.lr": 0.02, "optim.grad_clip": 0.5})
    assert (config.optim.lr, config.optim.beta2) == (EngineConfig().optim.lr, 0.999)
    assert "--optim.lr 0.02 kept (given on the command line)" in _entry(report, "optimizer.params.lr").note
    assert config.optim.grad_clip == EngineConfig().optim.grad_clip


def test_the_legacy_compile_disable_key_turns_torch_compile_on():
    config, report = _import({"compile": {"disable": False, "backend": "inductor"}}, strict=True)
    assert config.parallel.compile is True
    assert _entry(report, "compile.disable").target == "parallel.compile"
    config, _ = _import({"compile": {"disable": True}})
    assert config.parallel.compile is False
    with pytest.raises(ValueError, match="compile.enabled true contradicts the legacy compile.disable true"):
        _import({"compile": {"disable": True, "enabled": True}})
