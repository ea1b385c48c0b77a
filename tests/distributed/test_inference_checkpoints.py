"""Checkpoints of real training runs in every layout load for inference.

The built-in GPT trains 4 steps on 2 ranks as dp2 (DDP), ZeRO-3 (FSDP2, with activation
checkpointing: wrapped module names), tp2 (qkv rows saved in tensor-parallel order), pp2 (1F1B,
each stage saving its part) and an MoE GPT at ep2 (experts sharded over the ranks). Each
checkpoint is then loaded into a plain model in this process by :func:`load_gpt`, from the
config the trainer recorded, and its validation loss on the run's own validation batch must
equal the loss the run reported after its last step: the weights are the ones the run ended
with. The same ranks also load the dp2 and tp2 checkpoints into a tensor-parallel GPT (tp2, the
GPT's plan), whose logits must equal the plain model's, and into an FSDP2-sharded GPT, whose
gathered weights must equal the plain model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torsh_distributed.testing import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2": {},
    "zero3": {"zero_stage": 3, "activation_checkpointing": "full"},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2, "pp_schedule": "1f1b", "microbatches": 2},
    "ep2": {"ep": 2},
}
MOE = {"num_experts": 4, "top_k": 2}
TOKENS = torch.arange(64).reshape(2, 32) * 7 % 256


def _config(directory: str, name: str) -> Any:
    from torsh_distributed.testing.configs import small_config, with_checkpoints
    from torsh_distributed.train import TrainConfig

    data = with_checkpoints(small_config(4), directory, every=2).to_dict()
    data["parallel"].update(LAYOUTS[name])
    if name == "ep2":
        data["moe"].update(MOE)
    if name == "dp2":
        data["eval_every"] = 2  # an evaluation inside the run too (it changes no weight)
    return TrainConfig.from_dict(data)


def _train_then_load_sharded(root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from torsh_distributed.inference.load import load_gpt
    from torsh_distributed.train import train

    out: dict[str, Any] = {}
    for name in LAYOUTS:
        result = train(_config(f"{root}/{name}", name))
        out[name] = {"val_loss": result.val_loss, "val_history": result.val_history}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for name in ("dp2", "tp2"):
        model, _, info = load_gpt(f"{root}/{name}", tp_mesh=mesh)
        assert model.blocks[0].attn.qkv.weight.to_local().shape[0] == 48  # 3 * 32 / tp rows
        with torch.no_grad():
            out[name]["tp_logits"] = model(TOKENS)
        out[name]["fsdp_state"] = _into_fsdp(f"{root}/{name}")
    return out


def _into_fsdp(path: str) -> dict[str, torch.Tensor]:
    """Load into a GPT sharded by FSDP2 on its default (unnamed 1-D) mesh: its row shards must
    not be taken for tensor parallelism. Returns the full state (gathered)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from torsh_distributed.inference.load import load_model_state, read_gpt_config
    from torsh_distributed.models.gpt import GPT

    config, moe = read_gpt_config(path)
    model = GPT(config, moe=moe)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    load_model_state(model, path)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("inference-load")
    ranks = run_distributed(_train_then_load_sharded, 2, args=(str(root),), timeout=240)
    for name in ("dp2", "tp2"):
        assert torch.equal(ranks[0][name]["tp_logits"], ranks[1][name]["tp_logits"]), name
    return root, ranks[0]


def _val_loss(model: torch.nn.Module, name: str) -> float:
    """The engine's end-of-run validation loss (one batch: ``eval_batches`` is 1), recomputed."""
    from torsh_distributed.data.corpus import TokenWindows, load_corpus
    from torsh_distributed.data.sampler import ReplacementSampler, fetch
    from torsh_distributed.engine.engine import EVAL_STEP_BASE
    from torsh_distributed.models.gpt import lm_loss

    cfg = _config("unused", name)
    assert cfg.eval_batches == 1
    data = TokenWindows(load_corpus(cfg.data).val, cfg.model.block_size)
    sampler = ReplacementSampler(len(data), global_batch=cfg.batch_size, seed=cfg.seed)
    x, y = fetch(data, sampler.indices(EVAL_STEP_BASE))
    with torch.no_grad():
        return float(lm_loss(model(x), y))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_layout_loads_the_weights_the_run_ended_with(runs, name: str):
    from torsh_distributed.inference.load import load_gpt

    root, results = runs
    model, config, info = load_gpt(root / name)
    cfg = _config("unused", name)
    assert config == cfg.model and info.step == 4 and info.world_size == 2
    assert (model.moe is not None) == (name == "ep2")
    assert info.layout == ({"tp": 2} if name == "tp2" else {})
    assert _val_loss(model, name) == pytest.approx(results[name]["val_loss"], rel=1e-5)
    history = results[name]["val_history"]  # (step, loss) of every evaluation, the final last
    assert [step for step, _ in history] == ([2, 4] if name == "dp2" else [4])
    assert history[-1][1] == results[name]["val_loss"]
    assert name != "dp2" or history[0][1] > history[1][1]  # the loss at step 2 was higher


def test_tp_order_matters_and_layouts_agree(runs):
    from torsh_distributed.inference.load import load_gpt, load_model_state

    root, results = runs
    plain = {name: load_gpt(root / name)[0] for name in ("dp2", "zero3", "tp2", "pp2")}
    # the dense layouts train the same model (to reduction-order noise)
    reference = plain["dp2"].state_dict()
    for name, model in plain.items():
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, reference[key], atol=1e-4, rtol=1e-4, msg=name)
    # rows left in tp order (the model said to be in that layout) give another model
    scrambled = load_gpt(root / "dp2")[0]
    load_model_state(scrambled, root / "tp2", layout={"tp": 2})
    assert abs(_val_loss(scrambled, "tp2") - results["tp2"]["val_loss"]) > 1e-3
    # tensor-parallel and FSDP2-sharded models loaded from a plain and a tp-ordered checkpoint
    for name in ("dp2", "tp2"):
        with torch.no_grad():
            expected = plain[name](TOKENS)
        torch.testing.assert_close(results[name]["tp_logits"], expected, atol=1e-5, rtol=1e-5)
        fsdp = results[name]["fsdp_state"]
        assert fsdp.keys() == plain[name].state_dict().keys()
        for key, value in plain[name].state_dict().items():
            assert torch.equal(fsdp[key], value), (name, key)
