"""``torsh-dist federated``: federated rounds on Flower, the clients training with the engine.

Flags are generated from :class:`~torsh_distributed.federated.config.FederatedConfig` and its
sections: ``--clients 3``, ``--client.local-steps 20`` (also ``--local-steps`` where the name is
unique), ``--model``/``--dataset`` for the user's own factories. Everything is validated before
any process starts. ``torsh-dist federated-node`` joins a federation from another host.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from torsh_distributed._checks import factory_spec
from torsh_distributed.federated.config import ClientConfig, FederatedConfig, TaskConfig
from torsh_distributed.federated.privacy import PrivacyConfig

__all__ = ["config_from_args", "register"]

_EPILOG = """\
examples:
  # the built-in GPT on Python's standard library, split by package among 3 clients
  torsh-dist federated --clients 3 --rounds 3 --summary-json runs/fl.json
  # your own model and data, Dirichlet(0.1) label skew, FedProx, 30 % stragglers
  torsh-dist federated --model examples/federated_digits.py:make_model \\
      --dataset examples/federated_digits.py:train_set --val-dataset examples/federated_digits.py:test_set \\
      --partition dirichlet --alpha 0.1 --strategy fedprox --stragglers 0.3 --clients 10 --rounds 20
  # each client is itself a 2-rank data-parallel job (DDP; --client-zero-stage 2 for ZeRO-2)
  torsh-dist federated --clients 2 --client-nproc 2
  # a federation over hosts: the SuperLink here, listening on 10.0.0.1 ...
  export TORSH_FL_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
  torsh-dist federated --superlink-host 10.0.0.1 --superlink-port 9092 --remote-nodes \
      --clients 2 --token-env TORSH_FL_TOKEN
  # ... and on each client host (the same token):
  torsh-dist federated-node --superlink 10.0.0.1:9092 --partition-id 0 --num-partitions 2 \
      --token-env TORSH_FL_TOKEN
  # your own Strategy (MODULE:FUNCTION returning a Flower Strategy); clients evaluate too
  torsh-dist federated --model m.py:net --dataset m.py:data --partition iid \
      --strategy my_strategies.py:trimmed_mean --fraction-evaluate 1.0
  # your own Flower app (ServerApp of yours, the engine's ClientApp) on 2 local SuperNodes
  torsh-dist federated --clients 2 --app examples/flower_app --app-config 'num-server-rounds=3'
"""

_ALIASES = {"client.nproc": "--client-nproc", "client.zero_stage": "--client-zero-stage"}


def _sections() -> list[tuple[str, type]]:
    return [("", FederatedConfig), ("client", ClientConfig), ("task", TaskConfig), ("privacy", PrivacyConfig)]


def _scalar_fields(cls: type) -> list[dataclasses.Field[Any]]:
    from torsh_distributed.cli.train import type_hints

    hints = type_hints(cls)
    return [
        f for f in dataclasses.fields(cls)
        if hints[f.name] in (int, float, str, bool) and not f.metadata.get("internal")
    ]


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    from torsh_distributed.cli.train import _field_docs, _type_of, type_hints

    counts: dict[str, int] = {}
    for _, cls in _sections():
        for f in _scalar_fields(cls):
            counts[f.name] = counts.get(f.name, 0) + 1
    titles = {
        "": "rounds",
        "client": "each client's local training",
        "task": "model and data",
        "privacy": "client-level differential privacy (DP-FedAvg; on with --noise-multiplier > 0)",
    }
    for section, cls in _sections():
        group = parser.add_argument_group(titles[section])
        docs = _field_docs(cls)
        for f in _scalar_fields(cls):
            dest = f"{section}.{f.name}" if section else f.name
            dashed = f.name.replace("_", "-")
            flags = [f"--{section}.{dashed}"] if section else [f"--{dashed}"]
            if dest in _ALIASES:
                flags.append(_ALIASES[dest])
            elif section and counts[f.name] == 1:
                flags.append(f"--{dashed}")
            if type_hints(cls)[f.name] is bool:  # --secagg / --no-secagg
                group.add_argument(*flags, dest=dest, default=None, action=argparse.BooleanOptionalAction,
                                   help=docs.get(f.name, ""))  # fmt: skip
                continue
            group.add_argument(
                *flags, dest=dest, type=_type_of(cls, f), default=None, metavar=f.name.upper(),
                help=docs.get(f.name, ""),
            )  # fmt: skip


def config_from_args(args: argparse.Namespace) -> FederatedConfig:
    """The config of the given flags (defaults elsewhere), validated."""
    data: dict[str, Any] = {"client": {}, "task": {}, "privacy": {}}
    for key, value in vars(args).items():
        if value is None:
            continue
        section, _, name = key.rpartition(".")
        if section in data:
            data[section][name] = value
        elif not section and key in {f.name for f in dataclasses.fields(FederatedConfig)}:
            data[key] = value
    task = data["task"]
    for key in ("model", "dataset", "val_dataset", "loss"):
        if task.get(key):
            task[key] = _absolute(task[key])
    if ":" in data.get("strategy", ""):  # your own Strategy: MODULE:FUNCTION
        data["strategy"] = _absolute(data["strategy"])
    if "partition" not in data and task.get("model"):
        data["partition"] = "iid"
    return FederatedConfig.from_dict(data)


def resolved_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``--print-config``: the command line's settings with every field of the resolved
    :class:`FederatedConfig` (defaults included)."""
    from torsh_distributed.cli._config_file import settings_of

    config = config_from_args(args)
    names = {f.name for f in dataclasses.fields(FederatedConfig)}
    shown = {k: v for k, v in settings_of(args).items()
             if k.partition(".")[0] not in ("client", "task", "privacy") and k not in names}
    for section, cls in _sections():
        owner = getattr(config, section) if section else config
        for f in _scalar_fields(cls):
            shown[f"{section}.{f.name}" if section else f.name] = getattr(owner, f.name)
    return shown


def _absolute(spec: str) -> str:
    """``file.py:fn`` with the file made absolute: clients run in other directories."""
    module, sep, attr = spec.rpartition(":")
    if sep and (module.endswith(".py") or os.sep in module):
        return f"{Path(module).resolve()}:{attr}"
    return spec


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "federated",
        help="federated rounds on Flower (SuperLink + SuperNodes); clients train with the engine",
        description=(
            "Run a federated job on Flower's deployment engine: a SuperLink (the server), one "
            "SuperNode per client (this host, or --remote-nodes started by torsh-dist "
            "federated-node), rounds of a Flower strategy whose clients train the model with the "
            "engine on their own share of the data. Without --model: the built-in GPT on "
            "Python's standard library split by package. The server checkpoints every round into "
            "--run-dir and a rerun resumes there (--resume never: start afresh)."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_flags(parser)
    out = parser.add_argument_group("output and deployment")
    out.add_argument("--summary-json", metavar="FILE", help="also write the summary (rounds, clients, bytes) here")
    out.add_argument("--plot", metavar="PNG", help="plot loss (and accuracy) per round to this PNG")
    out.add_argument("--superlink-host", default="127.0.0.1", metavar="ADDR",
                     help="address the SuperLink listens on (default 127.0.0.1: this machine only)")
    out.add_argument("--superlink-port", type=int, default=0, metavar="PORT", help="its port (0 = a free one)")
    out.add_argument("--remote-nodes", action="store_true",
                     help="start no SuperNode here: clients join with torsh-dist federated-node")
    out.add_argument("--timeout", type=float, default=3600.0, metavar="S",
                     help="stop the whole run after this many seconds (default 3600)")
    out.add_argument("--app", metavar="DIR",
                     help="run your own Flower app (its pyproject.toml names a ServerApp and a ClientApp, "
                     "e.g. the engine's torsh_distributed.federated.apps:client_app) on the SuperLink and "
                     "--clients SuperNodes started here; see examples/flower_app")
    out.add_argument("--app-config", default="", metavar="'K=V ...'",
                     help="with --app: overrides of the app's [tool.flwr.app.config] (flwr run --run-config)")
    out.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver",
                     help="how each SuperNode starts its ClientApps, one process per Flower message: forked "
                     "from one process the local SuperNodes share, that imported torch and Flower once "
                     "(forkserver, the default), or a fresh interpreter each (spawn: Flower's own SuperExec)")
    _add_poll_flag(out)
    _add_token_flags(out)
    from torsh_distributed.cli._config_file import add_config_file_arguments

    add_config_file_arguments(parser, resolver=resolved_settings)
    parser.set_defaults(handler=main)

    node = sub.add_parser(
        "federated-node",
        help="join a federation as one client (a Flower SuperNode with its partition id)",
        description="Start a Flower SuperNode for client PARTITION_ID of a torsh-dist federated run.",
    )
    node.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the SuperLink's address")
    node.add_argument("--partition-id", type=int, required=True, help="this client's index (0-based)")
    node.add_argument("--num-partitions", type=int, required=True, help="number of clients of the run")
    node.add_argument("--host", default="127.0.0.1", help="address of this node's ClientApp API")
    node.add_argument("--port", type=int, default=0, help="its port (0 = a free one)")
    node.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver",
                     help="how each SuperNode starts its ClientApps, one process per Flower message: forked "
                     "from a process per node that imported torch and Flower once (forkserver, the default), "
                     "or a fresh interpreter each (spawn: Flower's own SuperExec)")
    _add_poll_flag(node)
    _add_token_flags(node, node=True)
    add_config_file_arguments(node)
    node.set_defaults(handler=node_main)


def _add_poll_flag(parser: argparse.ArgumentParser) -> None:
    from torsh_distributed.federated._flower_polls import DEFAULT_POLL_S

    parser.add_argument("--poll", type=float, default=DEFAULT_POLL_S, metavar="S",
                        help="seconds between the polls of an idle Flower SuperNode (for a message), "
                        "ServerApp (for a round's replies) and SuperExec (for a process to start); Flower "
                        f"sleeps 3 s there, most of a short round (default {DEFAULT_POLL_S:g}; 3 = Flower's own)")


def _add_token_flags(group: Any, *, node: bool = False) -> None:
    group.add_argument("--token-env", metavar="VAR",
                       help="environment variable holding the federation's shared token (required "
                       "when the SuperLink is exposed beyond loopback; nodes need the same)")
    group.add_argument("--token-file", metavar="FILE", help="file whose first line is the token (chmod 600)")
    group.add_argument("--tls-ca", metavar="PEM",
                       help="the federation's CA certificate: " + ("the head's certificate must be signed by it"
                       if node else "nodes must present a certificate it signed (mutual TLS)"))
    group.add_argument("--tls-cert", metavar="PEM", help=(
        "this node's certificate (signed by the federation's CA)" if node else
        "the head's certificate (signed by --tls-ca, valid for --superlink-host); without --tls-* an "
        "exposed federation makes its own CA and node certificates in RUN_DIR/tls"))
    group.add_argument("--tls-key", metavar="PEM", help="its private key (chmod 600)")
    group.add_argument("--insecure", action="store_true",
                       help="off loopback without TLS: weights and updates cross the network in the clear "
                       "(the token is still proved, never sent)")


def _tls(args: argparse.Namespace) -> Any:
    from torsh_distributed.runtime.tls import tls_files

    files = tls_files(args.tls_ca, args.tls_cert, args.tls_key)
    if files is not None and args.insecure:
        raise ValueError("give --tls-ca/--tls-cert/--tls-key or --insecure, not both")
    return files


def _quick_start_tls(config: FederatedConfig, host: str) -> Any:
    """A CA for this federation in RUN_DIR/tls: the head's certificate for ``host`` (every
    address of this machine for 0.0.0.0 / ::) and one certificate per client, with the lines
    that say what to copy where."""
    import ipaddress

    from torsh_distributed.runtime.tls import quick_start

    hosts = [host]
    if _is_ip(host) and ipaddress.ip_address(host).is_unspecified:  # 0.0.0.0 / ::: every address here
        import psutil

        hosts = [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family.name in ("AF_INET", "AF_INET6")]  # fmt: skip
    directory = Path(config.run_dir) / "tls"
    server, clients = quick_start(directory, hosts=hosts, parties=[f"node-{i}" for i in range(config.clients)])
    print(f"federated: TLS with a new CA for this federation: {server.ca}. Copy ca.pem, node-I.pem and "
          f"node-I.key from {directory} to client I's host (the .key files are secrets) and start it with "
          "torsh-dist federated-node ... --tls-ca ca.pem --tls-cert node-I.pem --tls-key node-I.key", flush=True)
    del clients
    return server


def _is_ip(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _token(args: argparse.Namespace) -> str:
    from torsh_distributed.inference._server_config import read_token

    return read_token(env=args.token_env, file=args.token_file) or ""


def check_endpoint(host_flag: str, host: str, port_flag: str, port: int) -> None:
    """A port in range and an address this host has (one line each, before any process or
    directory is made).

    Raises:
        ValueError: the port is outside 0..65535, or the host does not resolve or is not one of
            this machine's addresses.
    """
    import socket

    if not 0 <= port <= 65535:
        raise ValueError(f"{port_flag} must be a TCP port in 0..65535 (0 = a free one), got {port}")
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ValueError(f"{host_flag} {host}: not an address or a name that resolves ({reason})") from None
    with socket.socket(family, kind) as probe:
        try:
            probe.bind((address[0], 0))
        except OSError as exc:
            raise ValueError(
                f"{host_flag} {host}: this host has no such address to listen on ({exc.strerror}); "
                "use 127.0.0.1, 0.0.0.0 or one of this machine's addresses"
            ) from None


def main(args: argparse.Namespace) -> int:
    check_endpoint("--superlink-host", args.superlink_host, "--superlink-port", args.superlink_port)
    config = config_from_args(args)  # bad settings are refused before torch and Flower load
    for what in ("model", "dataset", "val_dataset", "loss"):
        if spec := getattr(config.task, what):
            factory_spec(spec, what=what.replace("_", "-"))  # a missing file, too
    from torsh_distributed.federated.deploy import Federation
    from torsh_distributed.federated.task import Task

    if config.user_strategy:  # import and call the factory: its errors come before any process
        from torsh_distributed.federated.strategies import build_strategy

        build_strategy(config)
    if config.secagg:  # the protocol's own limits, for the clients of a round
        from torsh_distributed.federated.secagg import check_secagg

        shares, threshold = config.secagg_plan(config.sampled_per_round)
        check_secagg(
            config.sampled_per_round, num_shares=shares, reconstruction_threshold=threshold,
            clipping_range=config.secagg_clip, quantization_range=config.secagg_quantization,
        )  # fmt: skip
    if config.task.model:  # import and call the factories: their errors come before any process
        import torch

        task = Task(config)
        with torch.device("meta"):
            task.model()
        task.client_data(0)
        if config.task.val_dataset:
            task.val_dataset()
    tls = _tls(args)
    from torsh_distributed.federated.deploy import _is_loopback

    exposed = not _is_loopback(args.superlink_host)
    if tls is not None and not exposed:
        raise ValueError("--tls-* secure the relay of an exposed federation (--superlink-host not loopback); "
                         "on loopback nothing leaves this host")
    quick = exposed and tls is None and not args.insecure
    federation = Federation(  # checks the host and the token before any file is written
        config, host=args.superlink_host, port=args.superlink_port, local_nodes=not args.remote_nodes,
        token=_token(args), tls=tls, insecure=args.insecure or quick, start_method=args.start_method,
        poll_s=args.poll,
    )  # fmt: skip
    if quick:  # TLS by default off loopback: this federation's own CA, made after those checks
        federation.tls, federation.insecure = _quick_start_tls(config, args.superlink_host), False
    app = Path(args.app) if args.app else None
    if app is not None and not (app / "pyproject.toml").is_file():
        raise ValueError(f"--app {args.app}: no pyproject.toml (a Flower app directory has one)")
    if args.app_config and app is None:
        raise ValueError("--app-config applies to --app DIR")
    with federation.running():
        if args.remote_nodes:
            where = federation.public_address
            print(f"federated: SuperLink at {where}; start {config.clients} nodes with "
                  f"torsh-dist federated-node --superlink {where} --partition-id I --num-partitions "
                  f"{config.clients}", flush=True)
        code = federation.submit(timeout=args.timeout, app=app, run_config=args.app_config)
    if app is not None:  # the app writes its own results; ours are for our ServerApp
        return code
    summary_path = federation.run_dir / "summary.json"
    if code != 0 or not summary_path.exists():
        print(f"torsh-dist federated: the run failed (flwr run exit {code}); logs in "
              f"{Path(config.run_dir) / 'logs'}", file=sys.stderr)
        return 1
    summary = json.loads(summary_path.read_text())
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    if args.plot:
        from torsh_distributed.federated.report import plot_rounds

        plot_rounds(summary, args.plot)
        print(f"federated: plot written to {args.plot}")
    return 0


def node_main(args: argparse.Namespace) -> int:
    from torsh_distributed.federated.deploy import join

    check_endpoint("--host", args.host, "--port", args.port)

    return join(
        args.superlink, partition_id=args.partition_id, num_partitions=args.num_partitions,
        token=_token(args), host=args.host, port=args.port, tls=_tls(args), insecure=args.insecure,
        start_method=args.start_method, poll_s=args.poll,
    )  # fmt: skip
