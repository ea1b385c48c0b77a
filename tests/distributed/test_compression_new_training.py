"""The new compressors train the built-in model on 2 ranks within their documented bounds
(docs/compression.md): natural and the zstd stage under AdamW within 3 % of uncompressed AdamW;
bimodal and sketch (biased, error feedback) within 3 % of uncompressed SGD, the setting of error
feedback's proofs. One process launch, 40 steps per run (CI budget)."""

from __future__ import annotations

import pytest

from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train

STEPS = 40
SGD_LR = 0.5
# Measured validation-loss gaps (2 ranks, tiny preset, seed 1234), 40 / 200 steps: natural +0.46 /
# +0.4 % (AdamW); bimodal -0.80 / -2.9 %, sketch:0.1 +1.32 / +0.3 % (SGD; +2.08 % at 60 steps);
# zstd:<spec> trains exactly as <spec>. Under AdamW bimodal (+12.5 % at 200) and sketch:0.1 (+16.0 %) lag like the
# other error-feedback methods (sign, topk; see docs/compression.md).
RUNS = ["none", "natural", "zstd:natural", "sgd/none", "sgd/bimodal", "sgd/sketch:0.1"]


def _config(method: str, optimizer: str) -> dict:
    cfg = preset("tiny")
    cfg.max_steps, cfg.batch_size, cfg.progress, cfg.eval_batches = STEPS, 8, False, 8
    cfg.compression.method = method
    if optimizer == "sgd":
        cfg.optim.optimizer, cfg.optim.lr = "sgd", SGD_LR
    return cfg.to_dict()


def _train_all(runs: list[str]) -> dict[str, dict]:
    out = {}
    for run in runs:
        optimizer, _, method = run.rpartition("/")
        result = train(TrainConfig.from_dict(_config(method, optimizer or "adamw")))
        out[run] = {"loss": result.val_loss, "compression": result.compression}
    return out


@pytest.mark.slow
def test_new_compressors_train_within_their_bounds():
    r = run_distributed(_train_all, 2, args=(RUNS,), timeout=300)[0]
    base = {"": r["none"]["loss"], "sgd": r["sgd/none"]["loss"]}
    gaps = {}
    for run, result in r.items():
        optimizer, _, method = run.rpartition("/")
        if method == "none":
            continue
        gaps[run] = (result["loss"] - base[optimizer]) / base[optimizer]
        c = result["compression"]
        assert c["method"] == method and c["bytes_sent"] < c["bytes_uncompressed"], (run, c)
    failed = {m: f"{g:+.2%}" for m, g in gaps.items() if g > 0.03}
    assert not failed, f"loss gap > 3 % vs none with the same optimizer ({base}): {failed}"
    ratios = {run: r[run]["compression"]["ratio"] for run in gaps}
    assert ratios["natural"] == pytest.approx(4.0, rel=0.01)  # one byte per entry
    assert ratios["zstd:natural"] > 4.0  # natural's 4x, then the lossless stage on top
    assert ratios["sgd/bimodal"] == pytest.approx(25.6, rel=0.02)  # 1.25 bits per entry
    assert ratios["sgd/sketch:0.1"] == pytest.approx(10.0, rel=0.05)
