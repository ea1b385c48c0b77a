"""Configuration of a federated run (torch-free, so that the CLI validates before any process).

Two sections: :class:`ClientConfig` (what one client does in a round: local steps, batch,
optimizer, its own data-parallel width) and :class:`FederatedConfig` (the rounds: how many
clients, which strategy, sampling, the data split, the deadline, where state goes). Both are
sent to the clients as JSON inside Flower's messages, so a client on another host needs no file.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from torsh_distributed._checks import positive as _positive
from torsh_distributed.federated.privacy import PrivacyConfig

__all__ = ["ClientConfig", "FederatedConfig", "PARTITIONS", "STRATEGIES", "TaskConfig"]

STRATEGIES = ("fedavg", "fedprox", "fedadam", "fedyogi", "fedadagrad", "fedavgm")
"""Flower strategies a run can use (``flwr.serverapp.strategy``)."""

PARTITIONS = ("package", "iid", "dirichlet", "shards")
"""How the data is split among clients; ``package`` only for the built-in corpus."""

OPTIMIZERS = ("sgd", "adamw")


@dataclass(kw_only=True, slots=True)
class ClientConfig:
    """One client's local training in a round (the engine's loop on the client's data)."""

    local_steps: int = 10
    """Optimizer steps per round (with ``local_epochs`` 0). More steps = fewer rounds to a
    loss, but more client drift on non-IID data (FedProx's proximal term counters it)."""
    local_epochs: float = 0.0
    """Passes over the client's data per round instead of ``local_steps`` (0 = use steps)."""
    batch_size: int = 16
    """Global batch of the client's job (split among its ``nproc`` ranks)."""
    optimizer: str = "sgd"
    """``sgd`` (FedAvg's client optimizer; plain SGD makes FedAvg parity-testable) or
    ``adamw`` (fresh state each round)."""
    lr: float = 0.05
    """Client learning rate (``eta_l``)."""
    momentum: float = 0.0
    """SGD momentum (0 = plain SGD)."""
    nproc: int = 1
    """Ranks of each client's own data-parallel job (> 1: a local torchrun-style job per round,
    DDP or ZeRO; its update equals a 1-rank client's on the same data)."""
    zero_stage: int = 0
    """0 = DDP; 1, 2, 3 = ZeRO inside the client job (with ``nproc`` > 1)."""
    def __post_init__(self) -> None:
        for name in ("local_steps", "batch_size", "nproc"):
            _positive("client", name, getattr(self, name))
        if not (math.isfinite(self.local_epochs) and self.local_epochs >= 0):
            raise ValueError(f"client.local_epochs must be >= 0, got {self.local_epochs}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"client.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        _positive("client", "lr", self.lr)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"client.momentum must be in [0, 1), got {self.momentum}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"client.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.zero_stage and self.nproc == 1:
            raise ValueError("client.zero_stage > 0 shards over the client's ranks: set client.nproc > 1")
        if self.batch_size % self.nproc:
            raise ValueError(
                f"client.batch_size {self.batch_size} is split among the client's {self.nproc} "
                f"ranks (client.nproc): choose a multiple of {self.nproc}"
            )


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """What is trained: the built-in GPT on the corpus, or the user's model, data and loss."""

    model: str = ""
    """``MODULE:FUNCTION`` returning the ``nn.Module``; empty = the built-in byte-level GPT on the
    standard library's source (``--dataset`` must then be empty too)."""
    dataset: str = ""
    """``MODULE:FUNCTION`` returning the map-style training set of ``(input, target)`` pairs;
    the clients split it by ``partition``."""
    val_dataset: str = ""
    """``MODULE:FUNCTION`` returning the held-out set the server evaluates the global model on
    after each round (empty: no server-side loss for user data)."""
    loss: str = ""
    """``MODULE:FUNCTION`` ``(output, target) -> scalar``; empty = cross-entropy."""
    max_bytes: int = 240_000
    """Built-in corpus: bytes of standard-library source per client (whole packages)."""
    block_size: int = 64
    """Built-in GPT: context length in bytes."""

    def __post_init__(self) -> None:
        if bool(self.model) != bool(self.dataset):
            raise ValueError("--model and --dataset go together (both empty = the built-in GPT)")
        if not self.model and (self.val_dataset or self.loss):
            raise ValueError("--val-dataset and --loss need --model and --dataset")
        _positive("task", "max_bytes", self.max_bytes)
        _positive("task", "block_size", self.block_size)

    @property
    def builtin(self) -> bool:
        return not self.model


@dataclass(kw_only=True, slots=True)
class FederatedConfig:
    """The federated run: clients, rounds, strategy, data split, deadline and state."""

    clients: int = 3
    """Number of clients (Flower SuperNodes), each with its own share of the data."""
    rounds: int = 3
    """Federated rounds to run (a resumed run continues to this number)."""
    strategy: str = "fedavg"
    """fedavg | fedprox | fedadam | fedyogi | fedadagrad | fedavgm (Flower's strategies), or
    MODULE:FUNCTION returning your own Flower ``Strategy`` (called with those of
    ``fraction_train``, ``fraction_evaluate``, ``min_train_nodes``, ``min_evaluate_nodes``,
    ``min_available_nodes``, ``weighted_by_key`` it accepts)."""
    fraction: float = 1.0
    """Fraction of the connected clients sampled per round (at least ``min_clients``)."""
    fraction_evaluate: float = 0.0
    """Fraction of the clients that evaluate the new global model on their own data after each
    round (Flower's client-side evaluation; per-client loss in ``rounds[].evaluate``); 0 = only
    the server evaluates, on the held-out set."""
    min_clients: int = 1
    """A round needs this many answers by its deadline to update the model; fewer = the round
    is recorded as failed and the model is kept."""
    proximal_mu: float = 0.01
    """FedProx's proximal weight mu: the client minimises loss + mu/2 ||w - w_global||^2."""
    server_lr: float = 0.1
    """Server learning rate eta of FedAdam/FedYogi/FedAdagrad (and FedAvgM's, as 1.0 default
    would be plain FedAvg: FedAvgM uses ``server_lr`` only when set explicitly)."""
    server_momentum: float = 0.9
    """FedAvgM's server momentum."""
    tau: float = 1e-3
    """Adaptivity of FedAdam/FedYogi/FedAdagrad (their epsilon)."""
    partition: str = "package"
    """package (the built-in corpus split by standard-library package: natural non-IID) | iid |
    dirichlet (label skew, ``alpha``) | shards (two label shards per client)."""
    alpha: float = 0.5
    """Dirichlet concentration: small = each client sees few labels (0.1 is strongly non-IID)."""
    stragglers: float = 0.0
    """Fraction of the clients that, in a round, do only part of their local steps (a uniform
    draw in 1..steps; who and how much seeded per round, among all clients, so with
    ``fraction`` < 1 the sampled share varies): the FedProx paper's systems heterogeneity."""
    straggler_policy: str = "keep"
    """keep = aggregate the stragglers' partial work (FedProx) | drop = discard their updates
    (FedAvg as that paper runs it)."""
    round_timeout: float = 300.0
    """Seconds a round waits for answers: a dead or silent client never stalls a round."""
    seed: int = 1234
    """Seeds the split, client sampling, the model and the clients' batches."""
    run_dir: str = "runs/federated"
    """Server state (checkpoint per round), the summary and the processes' logs go here."""
    resume: str = "auto"
    """auto = continue from ``run_dir``'s checkpoint when there is one; never = start afresh."""
    compression: str = "none"
    """Client-to-server updates: none | fp16 | bf16 | int8 | topk:R | sign | powersgd:RANK (the
    toolkit's compressors on w_client - w_global; bytes per round fall, the update gets noisier)
    | adaptive (each client's method follows its measured link time, see ``link_budget``)."""
    link_budget: float = 10.0
    """``adaptive``: seconds of link time (turnaround minus training) per client and round above
    which that client compresses more next round (below a quarter of it: less)."""
    error_feedback: bool = True
    """Each client keeps what compression did not send and adds it to its next update."""
    secagg: bool = False
    """Secure aggregation with Flower's SecAgg+ (Bell et al. 2020): clients send quantised,
    masked updates and the server learns only their weighted sum; tolerates clients dropping out
    after key sharing. Costs 4 message exchanges per round and int64 vectors (docs/federated.md)."""
    secagg_shares: int = 0
    """SecAgg+: clients holding shares of each client's secrets (odd, >= 3; 0 = all)."""
    secagg_threshold: int = 0
    """SecAgg+: shares needed to rebuild a secret (> half of the shares; 0 = a majority)."""
    secagg_clip: float = 8.0
    """SecAgg+: each weighted update coordinate is clipped to [-c, c] before quantisation."""
    secagg_quantization: int = 2**22
    """SecAgg+: quantisation levels Q (a power of two); the aggregate's error per coordinate is
    below 2 c N W / (Q sum n_k) (docs/federated.md)."""
    regions: int = 0
    """Two-level aggregation (edge -> region -> server): 0 = every client reports to the server;
    R = the clients are dealt to R regions in contiguous blocks of partition ids, each region has
    its own SuperLink whose aggregator (FedAvg over its clients, weighted by samples) reports one
    update to the server, where ``strategy`` combines the regions."""
    nodes: int = field(default=0, metadata={"internal": True})
    """(Internal) nodes the server waits for; 0 = ``regions`` or else ``clients``."""
    round_offset: int = field(default=0, metadata={"internal": True})
    """(Internal) added to Flower's round number for the clients' seeds: a region's one-round run
    inside round k of the top level trains exactly like round k of a flat run."""
    initial_state: str = field(default="", metadata={"internal": True})
    """(Internal) weights (``torch.save``, loaded ``weights_only``) a fresh run starts from instead
    of the seeded model: the global model a region receives."""
    metrics_port: int = 0
    """Serve per-round and per-client Prometheus gauges (torsh_federated_*) on 127.0.0.1:PORT
    of the server's host (0 = off)."""
    dashboard_port: int = 0
    """Serve the live dashboard (loss, bytes and time per round, each client's time) on
    127.0.0.1:PORT of the server's host (0 = off)."""
    client: ClientConfig = field(default_factory=ClientConfig)
    """Local training of each client."""
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    """Client-level differential privacy (off unless ``noise_multiplier`` > 0)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The model, data and loss."""

    def __post_init__(self) -> None:
        for name in ("clients", "rounds", "min_clients", "round_timeout"):
            _positive("federated", name, getattr(self, name))
        if self.strategy not in STRATEGIES and not self.user_strategy:
            raise ValueError(
                f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)} "
                "or MODULE:FUNCTION (your own Flower Strategy)"
            )
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"federated.fraction must be in (0, 1], got {self.fraction}")
        if not 0.0 <= self.fraction_evaluate <= 1.0:
            raise ValueError(f"federated.fraction_evaluate must be in [0, 1], got {self.fraction_evaluate}")
        if self.fraction_evaluate and (self.privacy.enabled or self.regions):
            raise ValueError(
                "fraction_evaluate (client-side evaluation) does not combine with "
                + ("DP: the accountant does not count the clients' evaluation results"
                   if self.privacy.enabled else "regions: a regional aggregator holds no data to evaluate")
            )
        if self.min_clients > self.clients:
            raise ValueError(
                f"min_clients ({self.min_clients}) is more than the {self.clients} clients"
            )
        if self.partition not in PARTITIONS:
            raise ValueError(
                f"unknown partition {self.partition!r}; choose one of {', '.join(PARTITIONS)}"
            )
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"federated.alpha (Dirichlet concentration) must be > 0, got {self.alpha}")
        if self.proximal_mu < 0:
            raise ValueError(f"federated.proximal_mu must be >= 0, got {self.proximal_mu}")
        _positive("federated", "server_lr", self.server_lr)
        _positive("federated", "tau", self.tau)
        if not 0.0 <= self.server_momentum < 1.0:
            raise ValueError(f"federated.server_momentum must be in [0, 1), got {self.server_momentum}")
        if not 0.0 <= self.stragglers < 1.0:
            raise ValueError(f"federated.stragglers must be in [0, 1), got {self.stragglers}")
        if self.straggler_policy not in ("keep", "drop"):
            raise ValueError(
                f"federated.straggler_policy must be keep or drop, got {self.straggler_policy!r}"
            )
        if self.secagg:
            if self.clients < 2:
                raise ValueError("secure aggregation needs at least 2 clients (the sum of one update is that update)")
            for what, bad in (
                (f"strategy {self.strategy} (secagg sums masked updates itself: fedavg or fedprox; "
                 "a strategy of your own never sees the clients' updates)", self.strategy not in ("fedavg", "fedprox")),
                (f"compression {self.compression} (secagg quantises the updates itself)", self.compression != "none"),
                ("DP noise (client-side clipping + server noise with secagg is not built)", self.privacy.enabled),
                ("regions", bool(self.regions)),
            ):
                if bad:
                    raise ValueError(f"secagg does not combine with {what}")
        if not 0 <= self.regions <= self.clients:
            raise ValueError(f"federated.regions must be in [0, clients={self.clients}], got {self.regions}")
        if self.regions and self.regions < self.min_clients:
            raise ValueError(
                f"with {self.regions} regions the server hears {self.regions} updates per round: "
                f"min_clients ({self.min_clients}) must be <= regions"
            )
        for name in ("metrics_port", "dashboard_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"federated.{name} must be a TCP port (0 = off), got {getattr(self, name)}")
        if self.resume not in ("auto", "never"):
            raise ValueError(f"federated.resume must be auto or never, got {self.resume!r}")
        _positive("federated", "link_budget", self.link_budget)
        if self.compression != "none":
            from torsh_distributed.federated.updates import check_method

            check_method(self.compression)
        if self.privacy.enabled and self.strategy not in ("fedavg", "fedprox"):
            raise ValueError(
                f"DP accounting needs a FedAvg-style aggregation (fedavg or fedprox), not {self.strategy}"
                + (" (the accountant cannot bound what your own strategy does with the updates)"
                   if self.user_strategy else "")
            )
        if self.client.zero_stage and self.strategy == "fedprox":
            raise ValueError("FedProx's proximal term needs DDP clients (client.zero_stage 0)")
        if self.partition == "package" and not self.task.builtin:
            raise ValueError("partition 'package' splits the built-in corpus; for --dataset use iid, dirichlet or shards")
        if self.task.builtin and self.partition != "package":
            if self.partition != "iid":
                raise ValueError(
                    f"partition {self.partition!r} needs class labels; the built-in corpus splits by package or iid"
                )

    @property
    def user_strategy(self) -> bool:
        """``strategy`` names the user's factory (MODULE:FUNCTION), not one of Flower's."""
        return ":" in self.strategy

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FederatedConfig:
        data = dict(data)
        client = ClientConfig(**data.pop("client", {}))
        task = TaskConfig(**data.pop("task", {}))
        privacy = PrivacyConfig(**data.pop("privacy", {}))
        return cls(client=client, task=task, privacy=privacy, **data)

    def secagg_plan(self, num_clients: int) -> tuple[int, int]:
        """SecAgg+'s (shares, threshold) for a round of ``num_clients``: ``secagg_shares`` (all
        when 0 or more than the round's clients) and ``secagg_threshold`` (a majority when 0)."""
        shares = num_clients if not self.secagg_shares or self.secagg_shares >= num_clients else self.secagg_shares
        return shares, self.secagg_threshold or shares // 2 + 1

    @property
    def expected_nodes(self) -> int:
        """Nodes the server's SuperLink should see: regions, or clients."""
        return self.nodes or self.regions or self.clients

    def region_members(self, region: int) -> list[int]:
        """Partition ids of region ``region`` (contiguous blocks, sizes differ by at most 1)."""
        base, extra = divmod(self.clients, self.regions)
        start = region * base + min(region, extra)
        return list(range(start, start + base + (region < extra)))

    @property
    def sampled_per_round(self) -> int:
        """Clients sampled each round when all are connected (Flower's rule)."""
        return max(int(self.clients * self.fraction), self.min_clients)
