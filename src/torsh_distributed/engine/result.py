"""What a training run returns, and its summary (the table, the JSON file, the loss curve)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torsh_distributed.engine._memory import for_table
from torsh_distributed.engine.progress import format_summary
from torsh_distributed.monitor.plot import plot_loss_curve

__all__ = ["TrainResult", "print_summary", "report_result", "write_json_atomic"]


@dataclass(kw_only=True, slots=True)
class TrainResult:
    """What a run did; identical on every rank (losses are averaged across ranks)."""

    steps: int
    """Optimizer steps taken (including those before a resume)."""
    losses: list[float] = field(repr=False)
    """Training loss of every step (global batch mean)."""
    initial_loss: float
    """Loss of the first step."""
    final_loss: float
    """Mean loss of the last ``min(10, steps)`` steps (less noisy than the last step alone)."""
    val_loss: float
    """Validation loss at the end (NaN without a validation set)."""
    val_history: list[tuple[int, float]] = field(default_factory=list, repr=False)
    """``(step, validation loss)`` of every evaluation of this process's run (``eval_every``
    and the final one; not those before a resume); empty without a validation set."""
    samples_per_s: float
    """Training samples per second, all ranks together, over the training loop's wall time."""
    tokens_per_s: float
    """``samples_per_s`` times the tokens per sample (0 when the caller did not say)."""
    world_size: int
    """Number of ranks."""
    wall_time_s: float
    """Seconds from start of setup to the end of the final evaluation."""
    first_step_unix_s: float = float("nan")
    """Wall-clock time (``time.time()``, this host's clock) when this process finished its first
    training step: launchers' start-up cost is this minus the moment the job was started."""
    num_params: int
    """Parameters of the model (global sizes: shards count once)."""
    backend: str
    """Process-group backend used."""
    layout: dict = field(default_factory=dict)
    """Parallel degrees: ``{"dp": .., "tp": .., "pp": ..}``."""
    memory: dict = field(default_factory=dict)
    """This rank's memory: measured and predicted model states, peak RSS."""
    compression: dict = field(default_factory=dict)
    """Rank 0's compression totals: method, bytes uncompressed/sent, ratio, seconds."""
    monitor: dict = field(default_factory=dict)
    """Bottleneck report of ``--monitor`` (slowest rank, step time, findings); {} when off."""
    checkpoint: dict = field(default_factory=dict)
    """Checkpoint saves and seconds the loop was blocked by them, restarts and lost steps, all
    totalled over every attempt of an elastic job; the step the last attempt resumed from; one
    entry per attempt (``attempts``); {} when off."""
    precision: dict = field(default_factory=dict)
    """Mixed precision: dtypes, and with fp16 the final loss scale and the skipped steps."""
    moe: dict = field(default_factory=dict)
    """MoE layers: tokens per expert over the run (all ranks), dropped share, load CV; {} without."""
    comm: dict = field(default_factory=dict)
    """``--comm-schedule priority``: ``schedule``, ``zero_stage`` (0 in the trainer),
    ``partition_kb``, ``credit_kb``, ``chunks``,
    ``bandwidth`` (the link measured from the exchange's own all-reduces: ``bandwidth_mbit``,
    ``latency_ms``, ``samples``, ``sizes``) and the ``auto`` ``decisions``; {} with ``fifo``."""
    energy: dict = field(default_factory=dict)
    """The training steps' energy: ``joules``, ``joules_per_step`` / ``_per_sample`` /
    ``_per_token``, ``average_power_w``, ``source`` (``measured`` or ``estimated``), ``meter``
    and why, and every rank's figures (``ranks``); {} with ``--energy.meter off``."""
    carbon: dict = field(default_factory=dict)
    """Emissions of that energy: ``grams`` CO2e, ``intensity_source`` (``constant``, ``series``,
    ``region`` or ``default``), the mean intensity, per rank; {} with ``--energy.meter off``.
    With ``--carbon.max-intensity`` also time shifting's ``pauses`` (``step``, ``start``,
    ``seconds``, ``intensity``), ``paused_s``, ``deadline`` and ``met_deadline``. With
    ``--carbon.scale``, ``scaling``: every segment's world size, steps, joules and grams, the
    decisions and the job's totals (the blocks' other figures are the last segment's)."""
    lr_scaling: dict = field(default_factory=dict)
    """``optim.lr_ref_batch``'s rule: ``rule`` (``none``, ``linear``, ``sqrt``), ``ratio`` (global
    batch / reference), ``factor``, the scaled ``lr`` and ``warmup_steps``, ``reason``; {} without."""
    ft: dict = field(default_factory=dict)
    """Fault-tolerant replica groups (``ft.replica_groups`` > 1): ``replica_groups``,
    ``failures`` (``rank``, ``group``, ``step``, ``restarted_ranks``, ``recovery_s``, ...),
    ``steps`` (the groups present at each step); {} without."""

    def summary(self) -> dict[str, Any]:
        """The summary fields (everything except the per-step and per-evaluation losses)."""
        data = asdict(self)
        data.pop("losses")
        data.pop("val_history")
        return data


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Write ``data`` as JSON through a temporary file and a rename: never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def print_summary(result: TrainResult) -> None:
    """The end-of-run table (the monitor's report and checkpoint lines were printed already;
    compression ``none`` and zero throughput say nothing: the JSON summary keeps all of them).
    After a restart or a resume that lost steps, rows ``checkpoint restarts`` and ``checkpoint
    lost steps`` (every attempt's) and ``checkpoint resumed step`` (the last attempt's)."""
    hidden = {"monitor", "checkpoint", "layout", "lr_scaling"}  # announced at the start
    if result.compression.get("method", "none") == "none":
        hidden.add("compression")
    if not result.tokens_per_s:
        hidden.add("tokens_per_s")
    table = {k: v for k, v in result.summary().items() if k not in hidden}
    checkpoint = result.checkpoint
    if checkpoint.get("restarts") or checkpoint.get("lost_steps"):
        table["checkpoint"] = {
            key: checkpoint[key]
            for key in ("restarts", "lost_steps", "resumed_step")
            if checkpoint.get(key) is not None
        }
    for name, keys in _ENERGY_ROWS.items():  # a few rows; the JSON summary keeps the rest
        block = table.pop(name, None)
        if block:
            table[name] = {k: block[k] for k in keys if block.get(k) is not None}
            if isinstance(block.get("pauses"), list):  # time shifting: the count (list in JSON)
                table[name]["pauses"] = len(block["pauses"])
            scaling = block.get("scaling")
            if isinstance(scaling, dict):  # carbon scaling: every segment's size, the job's grams
                table[name]["scaling_world_sizes"] = " -> ".join(map(str, scaling["world_sizes"]))
                if scaling.get("grams") is not None:
                    table[name]["scaling_grams_all_segments"] = scaling["grams"]
    print(format_summary(for_table(table)), flush=True)


_ENERGY_ROWS = {
    "energy": ("joules", "joules_per_step", "joules_per_token", "average_power_w", "source", "meter"),
    "carbon": ("grams", "intensity_g_per_kwh", "intensity_source", "paused_s", "met_deadline"),
}


def report_result(result: TrainResult, *, summary_json: str = "", plot: str = "", title: str = "") -> None:
    """Rank 0's end-of-run output: the table, then the JSON summary (``summary_json``) and the
    loss curve (``plot``, see :func:`~torsh_distributed.monitor.plot.plot_loss_curve`) when
    their paths are given."""
    print_summary(result)
    if summary_json:
        write_json_atomic(summary_json, result.summary())
    if plot:
        plot_loss_curve(plot, losses=result.losses, val_points=result.val_history, title=title)
        print(f"loss curve written to {plot}", flush=True)
