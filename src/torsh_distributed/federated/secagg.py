"""Secure aggregation of a round's updates with Flower's SecAgg+: the server learns only their sum.

The protocol is Flower's own (``flwr.server.workflow.SecAggPlusWorkflow`` on the server,
``flwr.client.mod.secaggplus_mod`` on the clients, Bell et al., CCS 2020), run for ONE round
from our round loop by :func:`secagg_round`, which drives the workflow's four stages itself:

1. ``setup``: the sampled clients get the protocol's parameters and answer with two public keys;
2. ``share_keys``: each client gets its neighbours' keys and sends them (encrypted for each
   neighbour, through the server) Shamir shares of its mask seed and of its first secret key;
3. ``collect_masked_vectors``: each client trains (our ``train_round``) and sends its update,
   quantised, weighted, and masked: plus a private mask, plus or minus a pairwise mask per
   neighbour. The server adds the masked vectors; the pairwise masks of two live clients cancel;
4. ``unmask``: the survivors send shares of the live clients' mask seeds and of the dropped
   clients' keys; the server removes the remaining masks and is left with the sum.

Before the first stage every node gets a start-up probe (a ``query.startup`` message, which
:data:`secagg_client_app` answers at once): a SuperNode starts a ClientApp process per message,
and the time until the last node answered is added to every stage's timeout, so that a stage
never closes on live clients that were still starting (a 2-core host took 15-20 s for five).
The host may slow down after the probe (another job starts): a stage also never closes sooner
than ``timeout`` after its first answer, since every ClientApp of the stage then starts late,
and a stage nobody answered by its deadline waits up to the probe's ``start_timeout`` more for a
first answer before it closes empty.

A client that dies after ``share_keys`` is tolerated while every client keeps at least
``reconstruction_threshold`` live neighbours. A client that dies *during* ``setup`` or
``share_keys`` never gave out shares; Flower 1.42's workflow would still ask its neighbours for
them and halt, so :func:`secagg_round` takes such clients out of the protocol after
``share_keys`` (no live client masked against them, so nothing is lost).

**What is summed, and weighting.** The client handler (:data:`secagg_client_app`) returns its
update ``d_k = w_k - w_global`` (float64), not its weights: updates are small, so a small
``clipping_range`` (hence a fine quantisation step) suffices. ``secaggplus_mod`` multiplies it
by ``a_k = q_k / Q`` with ``q_k = round(n_k Q / W)`` (``n_k`` the client's examples, ``W`` =
``max_weight``, ``Q`` = ``quantization_range``), and appends ``q_k`` to the masked vector; the
workflow divides the unmasked sum by ``sum q_k``. The result is the example-weighted mean
update, which :func:`secagg_round` adds to the global weights: FedAvg's aggregate. ``W``
defaults to the smallest power of two holding the largest client share; with ``Q`` a power of
two (required) and ``W <= Q``, ``a_k = n_k / W`` exactly, so the weights are exactly FedAvg's.
The server cannot take one update out of the sum, so a straggler under ``straggler_policy``
``drop`` takes part with weight 0, which adds exactly nothing.

**Quantisation bound.** Per coordinate the mod sends
``y_k = SR((clip(a_k d_k, -c, c) + c) * Q / (2c))`` in ``{0, ..., Q}`` (step ``2c/Q``, not
``2c/(Q-1)``: ``Q + 1`` levels), where ``c`` = ``clipping_range`` and ``SR`` is stochastic
rounding (``|SR(v) - v| < 1``, unbiased). The server gets ``Y = sum y_k`` exactly (mod
``M = 2**32``, hence ``N * Q < M`` is required for ``N`` clients) and returns
``(Y * 2c/Q - N c) / sum a_k``. So, when no coordinate was clipped (``|a_k d_k| <= c``; the
clients count clipped coordinates and :class:`SecAggResult` reports them), every coordinate of
the aggregated update is within

    ``bound = 2 c N / (Q sum a_k) = 2 c N W / (Q sum n_k)``  (``N`` = clients that completed)

of the exact weighted mean, plus the float32 rounding of the new weights. For ``N`` equal
shares and ``W < 2 n`` this is below ``4 c / Q``: ``7.6e-6`` with Flower's defaults
``c = 8``, ``Q = 2**22``. :func:`quantization_bound` computes it; ``SecAggResult.error_bound``
holds it for the round.

**What the server still sees.** Per client: its number of examples, training loss, steps, time,
partition id and clipped-coordinate count (Flower's ``FitRes`` metrics travel in the clear; the
weights ``n_k`` are public in FedAvg anyway), and the masked vectors, which are uniform modulo
``2**32``. Flower seeds its mask generator with 32 bits folded from each 32-byte secret
(``secaggplus_utils.pseudo_rand_gen``), which is weaker than the 256 bits the protocol means.

**Deployment.** The ``ClientApp`` component is
``torsh_distributed.federated.secagg:secagg_client_app``; the ServerApp calls
:func:`secagg_round` instead of sending plain train messages. Each round's message carries the
run's config JSON (``spec``), ``server-round``, ``proximal-mu`` and the tensor ``names``.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flwr.app import Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp

from torsh_distributed.federated import _secagg_driver
from torsh_distributed.federated.config import FederatedConfig

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "DEFAULT_CLIPPING_RANGE",
    "DEFAULT_QUANTIZATION_RANGE",
    "DEFAULT_START_TIMEOUT",
    "MODULUS_RANGE",
    "SecAggResult",
    "check_secagg",
    "default_max_weight",
    "quantization_bound",
    "secagg_client_app",
    "secagg_round",
]

MODULUS_RANGE = 2**32
"""Masks and sums live modulo this (Flower's default; its largest allowed value)."""
DEFAULT_QUANTIZATION_RANGE = 2**22
"""Flower's default ``Q``: up to 1023 clients fit under :data:`MODULUS_RANGE`."""
DEFAULT_CLIPPING_RANGE = 8.0
"""Flower's default ``c``; a weighted update coordinate beyond it is clipped."""
DEFAULT_START_TIMEOUT = 120.0
"""Longest wait for the nodes' start-up probe (at load 20 on 2 cores, five ClientApps took ~50 s
to start)."""

STAGES = ("setup", "share_keys", "collect_masked_vectors", "unmask")
"""The protocol's stages, in order (the names :func:`secagg_round` reports)."""

StateDict = dict[str, "torch.Tensor"]


# --- validation --------------------------------------------------------------------------------


def check_secagg(
    num_clients: int,
    *,
    num_shares: int,
    reconstruction_threshold: int,
    clipping_range: float = DEFAULT_CLIPPING_RANGE,
    quantization_range: int = DEFAULT_QUANTIZATION_RANGE,
    max_weight: float | None = None,
) -> None:
    """Refuse SecAgg+ settings that the workflow refuses, breaks on, or that are unsafe.

    Call it before starting any process (the round calls it again with the round's clients).

    Args:
        num_clients: Clients taking part (a round's sampled clients).
        num_shares: Clients holding shares of each client's secrets, itself included (SecAgg+'s
            neighbourhood): odd, or equal to ``num_clients``; 0 = all. More = more dropouts
            tolerated, but more key agreements and masks per client.
        reconstruction_threshold: Shares needed to rebuild a secret: more than half of
            ``num_shares`` (else a server could collect both a client's mask seed and its key,
            and unmask it alone) and at most ``num_shares``. Each client tolerates
            ``num_shares - reconstruction_threshold`` dropped neighbours.
        clipping_range: ``c``: weighted update coordinates are clipped to ``[-c, c]``; the error
            bound is proportional to it.
        quantization_range: ``Q``, a power of two with ``num_clients * Q < 2**32``; the error
            bound is inversely proportional to it.
        max_weight: ``W`` (``None``: chosen by the round); must be > 0.

    Raises:
        ValueError: naming the setting and what is allowed.
    """
    if num_clients < 2:
        raise ValueError(
            f"secure aggregation needs at least 2 clients (the sum of one update is that "
            f"update), got {num_clients}"
        )
    if not (math.isfinite(clipping_range) and clipping_range > 0):
        raise ValueError(f"secagg clipping_range must be > 0, got {clipping_range}")
    q = quantization_range
    if isinstance(q, bool) or not isinstance(q, int) or q < 2 or q & (q - 1):
        raise ValueError(f"secagg quantization_range must be a power of two >= 2, got {q}")
    if num_clients * q >= MODULUS_RANGE:
        largest = 1 << ((MODULUS_RANGE - 1) // num_clients).bit_length() - 1
        raise ValueError(
            f"secagg quantization_range {q} x {num_clients} clients must be < 2**32 (the masked "
            f"sum would wrap around); use quantization_range <= {largest}"
        )
    shares = num_clients if num_shares == 0 else num_shares
    if shares < 0 or shares > num_clients:
        raise ValueError(
            f"secagg num_shares must be in [0, {num_clients}] (0 = all clients), got {num_shares}"
        )
    if shares < num_clients and (shares < 3 or shares % 2 == 0):
        raise ValueError(
            f"secagg num_shares must be odd and >= 3 when less than the {num_clients} clients "
            f"(a client sits in the middle of its neighbourhood), got {num_shares}"
        )
    t = reconstruction_threshold
    if not shares / 2 < t <= shares:
        raise ValueError(
            f"secagg reconstruction_threshold must be more than half of num_shares ({shares}) "
            f"and at most num_shares, got {t}: a threshold of half or less lets the server "
            "rebuild both secrets of one client"
        )
    if max_weight is not None and not (math.isfinite(max_weight) and max_weight > 0):
        raise ValueError(f"secagg max_weight must be > 0, got {max_weight}")


def quantization_bound(
    num_examples: Sequence[int],
    *,
    clipping_range: float,
    quantization_range: int,
    max_weight: float,
) -> float:
    """Largest error per coordinate of the SecAgg+ weighted mean of updates from clients holding
    ``num_examples``: ``2 c N / sum_k round(n_k Q / W)`` (see the module docstring), valid when
    no coordinate was clipped."""
    q = quantization_range
    total = sum(round(n / max_weight * q) for n in num_examples)
    if total <= 0:
        return math.inf
    return 2.0 * clipping_range * len(num_examples) / total


@functools.lru_cache(maxsize=8)
def _largest_share(spec: str) -> int:
    from torsh_distributed.federated.task import Task

    config = FederatedConfig.from_dict(json.loads(spec))
    task = Task(config)
    return max(len(task.client_data(pid).dataset) for pid in range(config.clients))


def default_max_weight(config: FederatedConfig) -> int:
    """The smallest power of two holding every client's share (built from the config's data
    split, once per config): exact FedAvg weights and the tightest bound for that exactness."""
    largest = _largest_share(config.to_json())
    return 1 << max(0, (largest - 1).bit_length())


# --- the server's round ------------------------------------------------------------------------


@dataclass(slots=True)
class SecAggResult:
    """One SecAgg+ round: the new global weights and what the protocol let the server see."""

    state: StateDict | None = field(repr=False)
    """Global weights plus the example-weighted mean update of the clients that completed;
    ``None`` when the protocol halted (too many dropouts): keep the old model."""
    sampled: int
    """Clients the round started with."""
    completed: int
    """Clients whose masked update is in the sum."""
    dropped: int
    """``sampled - completed``."""
    active: dict[str, int]
    """Clients still in the protocol after each stage that ran (keys: :data:`STAGES`)."""
    clients: list[dict[str, Any]]
    """Per completed client: ``partition_id``, ``examples``, ``weight`` (its FedAvg weight:
    ``examples``, or 0 for a straggler under ``straggler_policy`` drop), ``loss``, ``steps``,
    ``seconds``, ``straggler``, ``clipped`` (coordinates clipped to ``c``) and ``bytes`` (what
    it sent)."""
    bytes: dict[str, int]
    """Record bytes of every message of the round: ``down`` (server to clients), ``up``,
    ``total``."""
    stage_bytes: dict[str, dict[str, int]]
    """The same per stage."""
    stage_seconds: dict[str, float]
    """Wall time of each stage."""
    seconds: float
    """Wall time of the round."""
    error_bound: float
    """Bound on the error per coordinate of the aggregated update (``inf`` when halted)."""
    clipped: int
    """Coordinates clipped over all clients: > 0 means the bound does not cover them."""
    max_weight: float
    num_shares: int
    reconstruction_threshold: int
    failed_stage: str | None = None
    """The stage at which the protocol halted, or ``None``."""
    errors: list[str] = field(default_factory=list)
    """The first error replies' reasons (a client that raised, e.g. over ``max_weight``)."""
    startup_seconds: float = 0.0
    """Until the last node answered the start-up probe: added to every stage's timeout."""

    @property
    def ok(self) -> bool:
        return self.state is not None


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    return tensor.numpy()


def secagg_round(
    grid: Any,
    *,
    config: FederatedConfig,
    server_round: int,
    global_state: StateDict,
    node_ids: Sequence[int],
    timeout: float,
    num_shares: int,
    reconstruction_threshold: int,
    clipping_range: float = DEFAULT_CLIPPING_RANGE,
    quantization_range: int = DEFAULT_QUANTIZATION_RANGE,
    max_weight: float | None = None,
    proximal_mu: float = 0.0,
    start_timeout: float = DEFAULT_START_TIMEOUT,
    on_stage: Callable[[str, list[int]], None] | None = None,
) -> SecAggResult:
    """Run one round of SecAgg+ over ``node_ids``: they train from ``global_state`` and the
    server learns only the weighted sum of their updates.

    Args:
        grid: Flower's ``Grid`` (inside a ``ServerApp``) whose nodes run
            :data:`secagg_client_app`.
        config: The run; sent to the clients as JSON (``spec``) for ``train_round``.
        server_round: The round number the clients train for (seeds their batches).
        global_state: The global weights (CPU state dict); the result has the same keys/dtypes.
        node_ids: The round's sampled nodes (at least 2).
        timeout: Seconds each of the four stages waits for answers beyond the nodes' measured
            start-up (see ``start_timeout``), and at least this long after the stage's first
            answer (a host that slowed down after the probe): a dead client costs one wait.
            Training happens in the third.
        num_shares: See :func:`check_secagg` (0 = all; more than the round's clients = all).
        reconstruction_threshold: See :func:`check_secagg`.
        clipping_range: ``c``; see the module docstring's bound.
        quantization_range: ``Q``; see the module docstring's bound.
        max_weight: ``W``; ``None`` = :func:`default_max_weight` (exact FedAvg weights). A
            client holding more examples refuses to answer (it would overflow).
        proximal_mu: FedProx's mu, sent to the clients as ``proximal-mu``.
        start_timeout: Longest wait for the start-up probe, which every node answers as soon
            as its SuperNode has started a ClientApp (one process per message, on the first
            message of a run also the app's install). The time until the last answer is the
            start-up that every stage adds to ``timeout``, so that a slow start (several nodes
            sharing a few cores, a loaded host) does not close a stage before a live client
            could answer. A node that never answers costs this wait once.
        on_stage: Called after each stage with its name and the node ids still in.

    Returns:
        The new weights (or ``None`` when too many clients dropped), counts, per-client
        metrics, bytes and times; see :class:`SecAggResult`.

    Raises:
        ValueError: settings :func:`check_secagg` refuses for ``len(node_ids)`` clients.
    """
    from flwr.app import ConfigRecord, RecordDict
    from flwr.common import FitIns, ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey
    from flwr.server.workflow.secure_aggregation.secaggplus_workflow import (
        SecAggPlusWorkflow,
        WorkflowState,
    )

    num = len(node_ids)
    shares = num if num_shares == 0 or num_shares >= num else num_shares
    check_secagg(
        num, num_shares=shares, reconstruction_threshold=reconstruction_threshold,
        clipping_range=clipping_range, quantization_range=quantization_range, max_weight=max_weight,
    )  # fmt: skip
    started = time.perf_counter()
    startup, probed = _secagg_driver.probe(grid, node_ids, timeout=start_timeout)
    weight = float(max_weight if max_weight is not None else default_max_weight(config))
    names = list(global_state)
    parameters = ndarrays_to_parameters([_to_numpy(global_state[k]) for k in names])
    fit_config = {
        "spec": config.to_json(),
        "server-round": int(server_round),
        "proximal-mu": float(proximal_mu),
        "names": json.dumps(names),
    }
    strategy = _secagg_driver.OneRound(FitIns(parameters, fit_config), node_ids, grid)
    base = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    context = LegacyContext(base, strategy=strategy)  # type: ignore[arg-type]
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
        {WorkflowKey.CURRENT_ROUND: server_round}
    )
    context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        parameters, keep_input=True
    )
    # fractions of the sampled clients: the workflow turns them back into these exact integers
    # without its integer checks (which refuse a threshold equal to the shares)
    workflow = SecAggPlusWorkflow(
        num_shares=shares / num, reconstruction_threshold=reconstruction_threshold / shares,
        max_weight=weight, clipping_range=float(clipping_range),
        quantization_range=quantization_range, modulus_range=MODULUS_RANGE,
        timeout=timeout + startup,
    )  # fmt: skip
    steps = (workflow.setup_stage, workflow.share_keys_stage)
    steps += (workflow.collect_masked_vectors_stage, workflow.unmask_stage)
    stages = dict(zip(STAGES, steps, strict=True))
    state = WorkflowState()
    counting = _secagg_driver.CountingGrid(grid, after_first=timeout, silent_grace=start_timeout)
    active: dict[str, int] = {}
    stage_seconds: dict[str, float] = {}
    completed_ids: set[int] = set()
    failed: str | None = None
    for name, stage in stages.items():
        counting.stage = name
        began = time.perf_counter()
        try:
            ok = stage(counting, context, state)
        except ZeroDivisionError:  # every summed weight was 0 (all dropped stragglers)
            state.failures.append(Exception("every completed client had weight 0"))
            ok = False
        stage_seconds[name] = time.perf_counter() - began
        if name == "share_keys":
            _secagg_driver.forget_silent(state)
        if name == "collect_masked_vectors":
            completed_ids = set(state.active_node_ids)
        active[name] = len(state.active_node_ids)
        if on_stage is not None:
            on_stage(name, sorted(state.active_node_ids))
        if not ok:
            failed = name
            break
    if failed is None and strategy.aggregate is None:
        failed = "unmask"
    seconds = time.perf_counter() - started

    clients = [
        _client_record(proxy.node_id, res, counting.node_up) for proxy, res in strategy.results
    ]
    clients.sort(key=lambda c: c["partition_id"])
    new_state = None
    bound = math.inf
    if failed is None:
        assert strategy.aggregate is not None
        new_state = _apply(global_state, names, strategy.aggregate)
        bound = quantization_bound(
            [c["weight"] for c in clients], clipping_range=clipping_range,
            quantization_range=quantization_range, max_weight=weight,
        )  # fmt: skip
    down = sum(s["down"] for s in counting.stage_bytes.values())
    up = sum(s["up"] for s in counting.stage_bytes.values())
    completed = len(completed_ids) if failed is None else 0
    return SecAggResult(
        state=new_state,
        sampled=num,
        completed=completed,
        dropped=num - completed,
        active=active,
        clients=clients,
        bytes={"down": down, "up": up, "total": down + up},
        stage_bytes=counting.stage_bytes,
        stage_seconds=stage_seconds,
        seconds=seconds,
        error_bound=bound,
        clipped=sum(c["clipped"] for c in clients),
        max_weight=weight,
        num_shares=shares,
        reconstruction_threshold=reconstruction_threshold,
        failed_stage=failed,
        errors=_reasons([*_probe_failures(probed), *state.failures]),
        startup_seconds=startup,
    )


def _probe_failures(replies: list[Message]) -> list[Exception]:
    """Error replies to the start-up probe (e.g. a node whose ClientApp lacks the handler)."""
    return [Exception(r.error) for r in replies if r.has_error()]


def _reasons(failures: list[Exception]) -> list[str]:
    """The distinct reasons of the error replies (the workflow wraps each ``Error``)."""
    reasons = (str(getattr(e.args[0], "reason", e)) if e.args else str(e) for e in failures)
    return list(dict.fromkeys(reasons))[:5]


def _client_record(node_id: int, res: Any, node_up: dict[int, int]) -> dict[str, Any]:
    metrics = res.metrics
    return {
        "partition_id": int(metrics.get("partition-id", -1)),
        "examples": int(metrics.get("num-examples", res.num_examples)),
        "weight": int(res.num_examples),
        "loss": float(metrics.get("loss", math.nan)),
        "steps": int(metrics.get("steps", 0)),
        "seconds": float(metrics.get("seconds", 0.0)),
        "straggler": bool(metrics.get("straggler", 0)),
        "clipped": int(metrics.get("secagg-clipped", 0)),
        "bytes": node_up.get(node_id, 0),
    }


def _apply(global_state: StateDict, names: list[str], mean_update: list[np.ndarray]) -> StateDict:
    """``global + mean update``, in float64, cast back to each tensor's dtype."""
    import torch

    out: StateDict = {}
    for name, delta in zip(names, mean_update, strict=True):
        old = global_state[name].detach().cpu()
        new = old.double() + torch.from_numpy(delta.astype("float64", copy=False)).reshape(
            old.shape
        )
        if not (old.is_floating_point() or old.is_complex()):
            new = new.round()
        out[name] = new.to(old.dtype)
    return out


# --- the client --------------------------------------------------------------------------------

secagg_client_app = ClientApp(mods=[secaggplus_mod])
"""Flower ``ClientApp`` of a SecAgg+ run (component
``torsh_distributed.federated.secagg:secagg_client_app``): ``secaggplus_mod`` runs the protocol,
its train handler trains with ``train_round`` and hands the mod the update in Flower's legacy
fit format."""


@secagg_client_app.query(_secagg_driver.PROBE_ACTION)
def _startup(msg: Message, context: Context) -> Message:
    """The start-up probe of :func:`secagg_round`: answering it is the whole job."""
    del context
    from flwr.app import RecordDict

    return Message(RecordDict(), reply_to=msg)


@secagg_client_app.train()
def _train(msg: Message, context: Context) -> Message:
    import numpy as np
    import torch
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE
    from flwr.compat.common import recorddict_compat as compat

    from torsh_distributed.federated.client import node_partition, train_round

    fit_ins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    cfg = fit_ins.config
    config = FederatedConfig.from_dict(json.loads(str(cfg["spec"])))
    server_round = int(cfg["server-round"])
    mu = float(cfg.get("proximal-mu", 0.0))
    names = json.loads(str(cfg["names"]))
    pid = node_partition(context.node_config, config.clients)
    arrays = parameters_to_ndarrays(fit_ins.parameters)
    global_state = {
        k: torch.from_numpy(np.array(a, copy=True)) for k, a in zip(names, arrays, strict=True)
    }

    protocol = context.state.config_records[RECORD_KEY_STATE]  # written by the mod's setup stage
    max_weight = float(protocol["max_weight"])  # type: ignore[arg-type]
    clip = float(protocol["clipping_range"])  # type: ignore[arg-type]
    target = int(protocol["target_range"])  # type: ignore[arg-type]

    result = train_round(
        config, global_state, partition_id=pid, server_round=server_round, proximal_mu=mu
    )
    if result.num_examples > max_weight:
        raise ValueError(
            f"client {pid} holds {result.num_examples} examples, more than max_weight "
            f"{max_weight:g}: its weighted update would overflow the masked sum"
        )
    updates = [
        (result.state[k].detach().cpu().double() - global_state[k].double()).numpy() for k in names
    ]
    # A straggler under straggler_policy "drop" takes part with weight 0: the server cannot take
    # one update out of the sum, but with weight 0 it adds exactly Q/2 per coordinate: 0 after
    # the workflow removes the offset.
    drop = config.straggler_policy == "drop" and result.straggler
    weight = 0 if drop else result.num_examples
    scale = round(weight / max_weight * target) / target  # what the mod multiplies the update by
    clipped = sum(int((np.abs(u * scale) > clip).sum()) for u in updates)
    metrics = {
        "partition-id": pid,
        "num-examples": result.num_examples,
        "loss": result.loss,
        "steps": result.steps,
        "seconds": result.seconds,
        "straggler": int(result.straggler),
        "secagg-clipped": clipped,
    }
    res = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters(updates), weight, metrics)
    return Message(content=compat.fitres_to_recorddict(res, keep_input=False), reply_to=msg)
