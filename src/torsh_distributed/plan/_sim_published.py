"""Published large training runs: the simulator's calibration and validation data, with sources.

Each :class:`PublishedRun` holds what a paper states (model shape, batch, devices, layout,
per-GPU TFLOP/s) and, in ``assumed``, what it does not and we had to choose. Per-GPU TFLOP/s
are the papers' own: Megatron-LM, MT-NLG and BLOOM count with Megatron-LM's eq. 3, the
recomputed forward included (as :attr:`~.simulate.SimResult.flops` does); Llama 3 reports model
FLOPs (MFU x peak, as :attr:`~.simulate.SimResult.model_flops`).

:data:`CALIBRATION` names the (at most two) rows the device model's two free parameters
(``gemm_eff``, ``mem_eff``) are fitted on; :func:`calibrate` refits them and
``_sim_device.CALIBRATED`` holds the result; every other row is a prediction (:func:`validate`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torsh_distributed.plan._strategy_config import StrategyConfig
    from torsh_distributed.plan.simulate import SimLayout, SimResult

__all__ = [
    "A100_80GB",
    "CALIBRATION",
    "H100_80GB",
    "RUNS",
    "ZERO3_CHECKS",
    "PublishedRun",
    "achieved",
    "calibrate",
    "predict",
    "validate",
]

_MEGATRON = (
    "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using "
    "Megatron-LM, SC '21 (arXiv:2104.04473), Table 1"
)
_SELENE = (
    "Selene: DGX A100 80GB, 8 GPUs per node on NVSwitch (300 GB/s per direction), 8 HDR "
    "InfiniBand 200 Gb/s NICs per node (paper, section 5)"
)
_MEGATRON_ASSUMED = (
    "micro-batch not published (the simulator's fastest fitting choice of 1, 2, 4, 8); "
    "the interleaved schedule where pp > 2 (section 5.1: 'we use the interleaved pipeline "
    "schedule with the scatter/gather optimization enabled'; Megatron-LM interleaves only with "
    "more than 2 stages), its chunks per rank not published (the simulator's fastest of the "
    "divisors > 1 of the layers per stage), non-interleaved 1F1B where pp <= 2; "
    "full recomputation (the paper's FLOP count includes it); "
    "scatter/gather of pipeline sends (section 4.1); gradients all-reduced after the pipeline "
    "flush, not overlapped; fp16 mixed precision as 2-byte gradients"
)


_MIB = 2**20
A100_80GB = 81920 * _MIB
"""An A100 80GB's memory as ``nvidia-smi`` reports it (81920 MiB = 85.9e9 bytes): NVIDIA's
"80GB" is 80 GiB of HBM2e (modal-labs/modal-client#2797 lists nvidia-smi totals per part)."""
H100_80GB = 81559 * _MIB
"""An H100 SXM 80GB's memory as ``nvidia-smi`` reports it (81559 MiB = 85.5e9 bytes;
modal-labs/modal-client#2797, NVIDIA/nccl#1264's nvidia-smi output). The simulator's 1 GB
``reserve`` stands for the CUDA context and the communication buffers within it."""


@dataclass(frozen=True, slots=True)
class PublishedRun:
    """One published run: inputs, layout and the per-GPU TFLOP/s it reached."""

    name: str
    source: str
    params: float
    layers: int
    hidden: int
    heads: int
    global_batch: int
    devices: int
    tp: int
    pp: int
    tflops: float
    """Published achieved TFLOP/s per GPU."""
    seq_len: int = 2048
    vocab: int = 51200
    device: str = "a100"
    device_memory: float = A100_80GB
    """Bytes per device: the part's whole memory (it was 80e9 until 2026-11-30: a GB-for-GiB slip)."""
    devices_per_node: int = 8
    intra_bw: float = 300e9
    inter_bw: float = 1600e9 / 8
    micro_batch: int = 0
    """0 = not published (the simulator picks its fastest fitting micro-batch of 1, 2, 4, 8)."""
    zero_stage: int = 0
    recomputes: tuple[str, ...] = ("full",)
    """Recomputation; several = not published (the simulator's fastest fitting choice)."""
    interleaves: tuple[int, ...] = (1,)
    """Model chunks per pipeline rank; several = not published (fastest fitting choice)."""
    sequence_parallel: bool = False
    dp_overlap: bool = False
    flash_attention: bool = False
    dropout: bool = True
    scatter_gather: bool = True
    """Pipeline sends split over the tp ranks (Megatron-LM 2021, section 4.1)."""
    schedule: str = "1f1b"
    """The pipeline software's schedule: Megatron-LM's 1F1B (interleaved with ``interleaves``
    > 1) or ``deepspeed`` (DeepSpeed's pipeline engine: Megatron-DeepSpeed)."""
    fit_memory: bool = True
    """Drop choices that do not fit by the simulator's memory model; False where the paper says
    its layout ran (our memory model is not theirs)."""
    kv_heads: int = 0
    ffn_hidden: int = 0
    gated_mlp: bool = False
    counts_recompute: bool = True
    """The published TFLOP/s count the recomputed forward (Megatron's eq. 3); False: model
    FLOPs (MFU x peak)."""
    cluster: str = _SELENE
    assumed: str = _MEGATRON_ASSUMED

    def config(self) -> StrategyConfig:
        from torsh_distributed.plan._strategy_config import StrategyConfig

        return StrategyConfig(
            params=self.params,
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            devices=self.devices,
            nodes=self.devices // self.devices_per_node,
            device_memory=self.device_memory,
            intra_bw=self.intra_bw,
            inter_bw=self.inter_bw,
            seq_len=self.seq_len,
            vocab=self.vocab,
            global_batch=self.global_batch,
            device=self.device,
            flash_attention=self.flash_attention,
            dropout=self.dropout,
            pp_scatter_gather=self.scatter_gather,
        )

    def layout(self, micro_batch: int, interleave: int, recompute: str) -> SimLayout:
        from torsh_distributed.plan.simulate import SimLayout

        return SimLayout(
            tp=self.tp,
            pp=self.pp,
            zero_stage=self.zero_stage,
            micro_batch=micro_batch,
            recompute=recompute,
            interleave=interleave,
            schedule=self.schedule if interleave == 1 else "interleaved",
            sequence_parallel=self.sequence_parallel,
            dp_overlap=self.dp_overlap,
            kv_heads=self.kv_heads,
            ffn_hidden=self.ffn_hidden,
            gated_mlp=self.gated_mlp,
        )


def _megatron(
    params: float,
    heads: int,
    hidden: int,
    layers: int,
    tp: int,
    pp: int,
    gpus: int,
    batch: int,
    tflops: float,
) -> PublishedRun:
    return PublishedRun(
        name=f"Megatron-LM {params:g}B",
        source=_MEGATRON,
        params=params * 1e9,
        layers=layers,
        hidden=hidden,
        heads=heads,
        global_batch=batch,
        devices=gpus,
        tp=tp,
        pp=pp,
        tflops=tflops,
        interleaves=_megatron_chunks(layers, pp),
    )


def _megatron_chunks(layers: int, pp: int) -> tuple[int, ...]:
    """Chunks per pipeline rank a Megatron-LM 2021 row may have used: section 5.1 runs the
    interleaved schedule, which Megatron-LM allows only with more than 2 stages; the count is not
    published, so every divisor > 1 of the layers per stage is a candidate."""
    if pp <= 2:
        return (1,)
    per_stage = layers // pp
    return tuple(v for v in range(2, per_stage + 1) if per_stage % v == 0) or (1,)


_MTNLG = (
    "Smith et al., Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B "
    "(arXiv:2201.11990), section 2.4: iteration 60.1 / 50.2 / 44.4 s at batch 1920"
)
_MTNLG_ASSUMED = (
    "micro-batch 1; ZeRO-1 (DeepSpeed's data parallelism) assumed; full recomputation (the "
    "published TFLOP/s match Megatron's count with it); the vocabulary 50272 (GPT-2's, padded); "
    "Selene's network as for Megatron-LM; DeepSpeed's pipeline engine (the paper: DeepSpeed's "
    "pipeline and data parallelism, Megatron's tensor slicing): its TrainSchedule with blocking "
    "paired sends of the whole activation from every tp rank (no scatter/gather)"
)
_BLOOM = (
    "BigScience, BLOOM: A 176B-Parameter Open-Access Multilingual Language Model "
    "(arXiv:2211.05100), section 3.4, and the BigScience 176B training page "
    "(bigscience.notion.site): 'training throughput: about 150 TFLOPs'"
)
_BLOOM_ASSUMED = (
    "full recomputation (Megatron-DeepSpeed's --checkpoint-activations) assumed; Jean Zay's "
    "A100 nodes taken as 300 GB/s NVLink per GPU (not stated as NVSwitch); 4 Omni-Path 100 Gb/s "
    "per node = 400 Gb/s; 'about 150' taken as 150; DeepSpeed's pipeline engine "
    "(Megatron-DeepSpeed) as for MT-NLG"
)

_LLAMA = (
    "Llama Team, AI @ Meta, The Llama 3 Herd of Models (arXiv:2407.21783), Table 4 (8K-context "
    "rows: TFLOPs/GPU and BF16 MFU) and section 3.3 (H100 80GB at 700 W, 8 per server on NVLink, "
    "400 Gb/s RoCE per GPU)"
)
_LLAMA_ASSUMED = (
    "section 3.3.2: an interleaved schedule, V chunks per rank not stated but implied: one "
    "layer fewer on the first and last stages leaves 'the first model chunk on the first stage "
    "[with] only the embedding' and the last with only the head, so a chunk is one layer and "
    "V = (126 + 2) / 16 = 8; no activation "
    "recomputation at 8K context; the layout ran, so our memory model does not filter it; "
    "micro-batch the simulator's fastest; sequence parallelism; ZeRO-2 (section 3.3.2: 'FSDP "
    "... shards optimizer states and gradients, but for model shards we do not reshard after "
    "forward'): each chunk's gradients reduce-scattered after its backward, overlapped (in bf16: "
    "the paper reduces them in fp32, twice the bytes); NVLink 450 GB/s per direction; 8 x 400 "
    "Gb/s per node on a non-blocking rail network (the paper's 1:7 oversubscription above the "
    "pods not modelled); published TFLOP/s taken as model FLOPs (MFU x 989), attention counted "
    "in full (not causal-halved)"
)

RUNS: tuple[PublishedRun, ...] = (
    _megatron(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    _megatron(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    _megatron(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    _megatron(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    _megatron(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _megatron(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _megatron(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _megatron(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _megatron(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
    *(
        PublishedRun(
            name=f"MT-NLG 530B, {gpus} GPUs",
            source=_MTNLG,
            params=530e9,
            layers=105,
            hidden=20480,
            heads=128,
            vocab=50272,
            global_batch=1920,
            devices=gpus,
            tp=8,
            pp=35,
            micro_batch=1,
            zero_stage=1,
            schedule="deepspeed",
            scatter_gather=False,
            tflops=tflops,
            assumed=_MTNLG_ASSUMED,
        )
        for gpus, tflops in ((2240, 126), (2800, 121), (3360, 113))
    ),
    PublishedRun(
        name="BLOOM 176B",
        source=_BLOOM,
        params=176.2e9,
        layers=70,
        hidden=14336,
        heads=112,
        vocab=250880,
        global_batch=2048,
        devices=384,
        tp=4,
        pp=12,
        micro_batch=2,
        zero_stage=1,
        schedule="deepspeed",
        scatter_gather=False,
        inter_bw=400e9 / 8,
        tflops=150,
        cluster="Jean Zay: 48 nodes of 8 A100 80GB, NVLink inside a node, 4 Omni-Path 100 Gb/s",
        assumed=_BLOOM_ASSUMED,
    ),
    *(
        PublishedRun(
            name=f"Llama 3 405B, {gpus} H100",
            source=_LLAMA,
            params=405e9,
            layers=126,
            hidden=16384,
            heads=128,
            kv_heads=8,
            ffn_hidden=53248,
            gated_mlp=True,
            vocab=128256,
            seq_len=8192,
            global_batch=2048,
            devices=gpus,
            tp=8,
            pp=16,
            device="h100",
            device_memory=H100_80GB,
            intra_bw=450e9,
            inter_bw=3200e9 / 8,
            zero_stage=2,
            dp_overlap=True,
            sequence_parallel=True,
            flash_attention=True,
            dropout=False,
            scatter_gather=False,
            interleaves=(8,),
            recomputes=("none",),
            fit_memory=False,
            counts_recompute=False,
            tflops=tflops,
            cluster="Meta's RoCE cluster: H100 80GB, 8 per server on NVLink, 400 Gb/s per GPU",
            assumed=_LLAMA_ASSUMED,
        )
        for gpus, tflops in ((8192, 430), (16384, 400))
    ),
)
"""The validation set: Megatron-LM's weak-scaling table (1.7B-1T on 32-3072 A100), MT-NLG 530B
at three scales, BLOOM 176B, Llama 3 405B on 8192 and 16384 H100 (8K context)."""

_ZERO3 = (
    "Narayanan et al., SC '21 (arXiv:2104.04473), Table 2: ZeRO-3 (DeepSpeed) without model "
    "parallelism, global batch fixed as the GPUs double"
)
_ZERO3_ASSUMED = (
    "full recomputation (the paper's eq. 3 count); ZeRO-3 as the simulator plays it: one "
    "coalesced all-gather per layer and pass, prefetched under the previous layer, on NCCL rings "
    "over all 8 NICs of a node (DeepSpeed's 2021 ZeRO-3 gathered module by module); the layout "
    "ran, so our memory model does not filter it"
)

ZERO3_CHECKS: tuple[PublishedRun, ...] = tuple(
    replace(
        _megatron(params, heads, hidden, layers, 1, 1, gpus, batch, tflops),
        name=f"ZeRO-3 {params:g}B, {gpus} GPUs, mb{micro}",
        source=_ZERO3,
        micro_batch=micro,
        zero_stage=3,
        fit_memory=False,
        assumed=_ZERO3_ASSUMED,
    )
    for params, heads, hidden, layers, rows in (
        (174.6, 96, 12288, 96, ((384, 1536, 4, 144), (768, 1536, 2, 88), (1536, 1536, 1, 44))),
        (529.6, 128, 20480, 105, ((640, 2560, 4, 138), (1120, 2240, 2, 98), (2240, 2240, 1, 48))),
    )
    for gpus, batch, micro, tflops in rows
)
"""Outside the validation set: DeepSpeed's ZeRO-3 without model parallelism from the same paper.
The simulator predicts these 27 % to 4x too fast (docs/benchmarks.md, "Step simulator"): it
plays ZeRO-3 as FSDP does, not as DeepSpeed's 2021 implementation ran."""

CALIBRATION = ("Megatron-LM 1.7B", "Megatron-LM 145.6B")
"""The rows the device model is fitted on: the smallest model (small GEMMs, a large share of
element-wise and softmax traffic: pins ``mem_eff``) and a mid-size pipelined one (large GEMMs:
pins ``gemm_eff``)."""


def predict(run: PublishedRun, **efficiencies: float) -> SimResult:
    """The simulator's prediction for ``run``: its micro-batch, chunks and recomputation, or,
    where the paper does not say, the fastest fitting choice (an optimistic assumption)."""
    from torsh_distributed.plan._sim_device import device_model
    from torsh_distributed.plan.simulate import simulate

    cfg = run.config()
    dev = device_model(run.device, **efficiencies)
    micro_batches = (run.micro_batch,) if run.micro_batch else (1, 2, 4, 8)
    results = []
    for micro in micro_batches:
        for interleave in run.interleaves:
            for recompute in run.recomputes:
                try:
                    res = simulate(cfg, run.layout(micro, interleave, recompute), device=dev)
                except ValueError:  # e.g. micro-batches not a multiple of pp for interleaving
                    continue
                results.append(res)
    fitting = results
    if run.fit_memory:
        fitting = [r for r in results if r.memory["total"] <= cfg.device_memory] or results
    return min(fitting, key=lambda r: r.step_s)


def achieved(run: PublishedRun, res: SimResult) -> float:
    """Predicted TFLOP/s per GPU, counted as ``run``'s paper counts them."""
    flops = res.flops if run.counts_recompute else res.model_flops
    return flops / res.step_s / res.devices / 1e12


def calibrate(
    names: tuple[str, ...] = CALIBRATION, runs: tuple[PublishedRun, ...] = RUNS
) -> dict[str, float]:
    """Least-squares fit of ``gemm_eff`` and ``mem_eff`` (log error of per-GPU TFLOP/s) on the
    named rows of ``runs``: a grid, then two refinements around the best point."""
    runs = tuple(r for r in runs if r.name in names)
    assert len(runs) == len(names) <= 2, names

    def loss(g: float, mm: float) -> float:
        import math

        return sum(
            math.log(achieved(r, predict(r, gemm_eff=g, mem_eff=mm)) / r.tflops) ** 2 for r in runs
        )

    best = (0.8, 0.7)
    step = (0.1, 0.1)
    for _ in range(3):
        grid = [
            (best[0] + i * step[0], best[1] + j * step[1])
            for i in range(-3, 4)
            for j in range(-3, 4)
        ]
        grid = [(g, mm) for g, mm in grid if 0.2 <= g <= 1.0 and 0.1 <= mm <= 1.0]
        best = min(grid, key=lambda gm: loss(*gm))
        step = (step[0] / 4, step[1] / 4)
    return {"gemm_eff": round(best[0], 3), "mem_eff": round(best[1], 3)}


def validate(runs: tuple[PublishedRun, ...] = RUNS, **efficiencies: float) -> list[dict[str, Any]]:
    """Every row: published and predicted per-GPU TFLOP/s, the error, whether it was fitted
    (``efficiencies``: ``gemm_eff``/``mem_eff`` other than the calibrated ones)."""
    rows = []
    for run in runs:
        res = predict(run, **efficiencies)
        lay = res.layout
        extra = (f" v{lay.interleave}" if lay.interleave > 1 else "") + (
            f" rc {lay.recompute}" if len(run.recomputes) > 1 else ""
        )
        rows.append(
            {
                "name": run.name,
                "layout": f"tp{run.tp} pp{run.pp} dp{res.dp} mb{lay.micro_batch}{extra}",
                "published_tflops": run.tflops,
                "predicted_tflops": achieved(run, res),
                "error": achieved(run, res) / run.tflops - 1,
                "calibration": run.name in CALIBRATION,
                "step_s": res.step_s,
                "memory_gb": res.memory["total"] / 1e9,
                "source": run.source,
            }
        )
    return rows
