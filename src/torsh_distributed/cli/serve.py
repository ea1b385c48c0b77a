"""``torsh-dist serve``: an OpenAI-compatible HTTP server for a training checkpoint.

Parses the flags into a :class:`~torsh_distributed.inference.server.ServerConfig` (validated
here, before anything loads) and runs
:func:`~torsh_distributed.inference.serve.serve_checkpoint` in this process, or with ``--tp N``
on N local ranks through the same launcher as ``torsh-dist train --nproc-per-node``: the ranks
run ``python -m torsh_distributed.cli.serve --worker-json ...``. The token itself never goes on
a command line: the ranks re-read it from the same variable or file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torsh_distributed.checkpoint.catalog import check_loadable_path

__all__ = ["register", "main"]

_EPILOG = """\
examples:
  torsh-dist serve --checkpoint runs/ckpt --port 8000
  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "ckpt", "prompt": "def main():", "max_tokens": 32, "temperature": 0}'
  curl -sN localhost:8000/v1/completions -d '{"prompt": "import ", "stream": true}'   # SSE
  # the official client: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="EMPTY")
  # two tensor-parallel ranks; up to 16 rows decoded together
  torsh-dist serve --checkpoint runs/ckpt --port 8000 --tp 2 --max-batch-size 16
  # reachable from other machines: a token is required (the client's api_key)
  export TORSH_SERVE_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
  torsh-dist serve --checkpoint runs/ckpt --host 0.0.0.0 --port 8000 --token-env TORSH_SERVE_TOKEN
  curl -s -H "Authorization: Bearer $TORSH_SERVE_TOKEN" HOST:8000/metrics
  # the same over HTTPS (a token over plain HTTP off loopback needs --insecure)
  torsh-dist serve --checkpoint runs/ckpt --host 0.0.0.0 --port 8443 --token-env TORSH_SERVE_TOKEN \\
      --tls-cert server.pem --tls-key server.key
  curl -s --cacert ca.pem -H "Authorization: Bearer $TORSH_SERVE_TOKEN" https://HOST:8443/v1/models
  # OpenAI(base_url="https://HOST:8443/v1", api_key=TOKEN, http_client=openai.DefaultHttpxClient(
  #     verify=ssl.create_default_context(cafile="ca.pem")))

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics (Prometheus text). See docs/inference.md and docs/security.md.
"""

_DTYPES = ("float32", "bfloat16", "float64")
_FORWARDED = (
    "checkpoint",
    "tp",
    "host",
    "port",
    "token_env",
    "token_file",
    "tls_cert",
    "tls_key",
    "insecure",
    "model_name",
    "scheduler",
    "max_batch_size",
    "max_batch_tokens",
    "batch_wait_ms",
    "max_new_tokens_limit",
    "max_total_tokens",
    "max_body_bytes",
    "max_queued_requests",
    "request_timeout_s",
    "dtype",
)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a training run's --checkpoint-dir (its newest valid step) or one "
        "step_XXXXXXXX directory; also a Hugging Face model directory or a --model hf: run's "
        "checkpoint (--tp 1, docs/huggingface.md)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel degree: N local ranks share the model (Gloo on CPU); "
        "rank 0 serves HTTP. Default: 1",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address; any non-loopback address needs a token, and TLS (--tls-cert, "
        "--tls-key) or --insecure. Default: 127.0.0.1",
    )
    parser.add_argument(
        "--port",
        type=int,
        required=True,
        metavar="P",
        help="TCP port (0: any free port, printed when ready)",
    )
    token = parser.add_mutually_exclusive_group()
    token.add_argument(
        "--token-env",
        metavar="VAR",
        help="require 'Authorization: Bearer <token>', the token read from "
        "environment variable VAR",
    )
    token.add_argument(
        "--token-file",
        metavar="FILE",
        help="same, the token read from the first line of FILE (chmod 600)",
    )
    parser.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="serve HTTPS with this PEM certificate (chain); clients verify it against the CA "
        "that signed it. Needs --tls-key",
    )
    parser.add_argument(
        "--tls-key",
        metavar="FILE",
        help="the certificate's PEM private key, unencrypted (chmod 600)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow a token over plain HTTP on a non-loopback --host (refused otherwise): only "
        "behind a TLS-terminating proxy or on a network you trust",
    )
    parser.add_argument(
        "--model-name",
        default=None,
        metavar="NAME",
        help="the model's id in /v1/models and in requests' \"model\". Default: the name of "
        "the --checkpoint directory",
    )
    parser.add_argument(
        "--scheduler",
        choices=("continuous", "static"),
        default="continuous",
        help="continuous: requests join and leave the running batch between decoding steps; "
        "static: a batch runs until its longest request ends. Default: continuous",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=8,
        metavar="B",
        help="rows (requests x n) decoded together at most. Default: 8",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        metavar="T",
        help="continuous: tokens one decoding step may feed (running rows + joining prompts). "
        "Default: 2048",
    )
    parser.add_argument(
        "--batch-wait-ms",
        type=float,
        default=5.0,
        metavar="W",
        help="static: after a request arrives, wait up to W ms for others to join its batch. "
        "Default: 5",
    )
    parser.add_argument(
        "--max-new-tokens-limit",
        type=int,
        default=256,
        metavar="L",
        help="largest max_tokens a request may ask for. Default: 256",
    )
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        metavar="T",
        help="refuse prompt + max_tokens above T. Default: no limit beyond the model's context",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        metavar="BYTES",
        help="largest request body (413 above). Default: 1048576",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        metavar="Q",
        help="rows waiting at most (503 above). Default: 256",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        metavar="S",
        help="answer 504 to a request not completed within S seconds. Default: 600",
    )
    parser.add_argument(
        "--dtype",
        choices=_DTYPES,
        default="float32",
        help="weights' dtype (bfloat16 halves memory). Default: float32",
    )


def _config(args: argparse.Namespace) -> Any:
    from torsh_distributed.inference._server_config import ServerConfig, read_token

    path = Path(args.checkpoint)
    if path.name.startswith("step_"):  # one step of a run: the run's name
        path = path.parent
    name = args.model_name or path.name or "torsh-gpt"
    return ServerConfig(
        host=args.host,
        port=args.port,
        token=read_token(env=args.token_env, file=args.token_file),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        insecure=args.insecure,
        model_name=name,
        scheduler=args.scheduler,
        max_batch_size=args.max_batch_size,
        max_batch_tokens=args.max_batch_tokens,
        batch_wait_ms=args.batch_wait_ms,
        max_new_tokens_limit=args.max_new_tokens_limit,
        max_total_tokens=args.max_total_tokens,
        max_body_bytes=args.max_body_bytes,
        max_queued_requests=args.max_queued_requests,
        request_timeout_s=args.request_timeout_s,
    )


def _run_here(args: argparse.Namespace, config: Any) -> int:
    import torch

    from torsh_distributed.inference.serve import serve_checkpoint

    dtype = None if args.dtype == "float32" else getattr(torch, args.dtype)
    return serve_checkpoint(args.checkpoint, config, tp=args.tp, dtype=dtype)


def _handle(args: argparse.Namespace) -> int:
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"torsh-dist serve needs {' and '.join(missing)}: pip install 'torsh-distributed[serve]'"
        )
    with warnings.catch_warnings(record=True) as caught:  # imports nothing heavy: torch comes after
        warnings.simplefilter("always")
        config = _config(args)  # refuses a public address without a token, before loading
    for warning in caught:
        print(f"torsh-dist serve: warning: {warning.message}", file=sys.stderr)
    if not (Path(args.checkpoint) / "config.json").is_file():  # a Hugging Face directory: at load
        check_loadable_path(args.checkpoint)  # a missing or empty directory: before torch, too
    if args.tp == 1:
        return _run_here(args, config)
    from torsh_distributed.inference.serve import check_checkpoint

    # before any rank starts; and every rank then loads this very step
    args.checkpoint = str(check_checkpoint(args.checkpoint, tp=args.tp))
    from torsh_distributed.elastic.launch import LaunchOptions, launch

    worker = json.dumps({k: getattr(args, k) for k in _FORWARDED})
    return launch(
        LaunchOptions(nproc_per_node=args.tp),
        module="torsh_distributed.cli.serve",
        args=["--worker-json", worker],
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    parser = sub.add_parser(
        "serve",
        help="serve a checkpoint over the OpenAI API: completions, chat, streaming, metrics",
        description=(
            "Serve the built-in GPT of a training checkpoint over OpenAI's HTTP API (FastAPI on "
            "uvicorn): GET /v1/models, POST /v1/completions, POST /v1/chat/completions (JSON, "
            'or server-sent events with "stream": true), GET /health, GET /metrics. Requests '
            "join and leave the running batch between decoding steps (continuous batching). "
            "Binds 127.0.0.1 unless --host says otherwise; a non-loopback address requires a "
            "token, and HTTPS (--tls-cert/--tls-key) unless --insecure is given. Stops cleanly "
            "on SIGTERM or Ctrl-C."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    from torsh_distributed.cli._config_file import add_config_file_arguments

    add_config_file_arguments(parser)
    parser.set_defaults(handler=_handle)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each rank of ``torsh-dist serve --tp N`` (started by the launcher)."""
    parser = argparse.ArgumentParser(prog="python -m torsh_distributed.cli.serve")
    parser.add_argument("--worker-json", required=True, help=argparse.SUPPRESS)
    args = argparse.Namespace(**json.loads(parser.parse_args(argv).worker_json))
    return _run_here(args, _config(args))


if __name__ == "__main__":
    sys.exit(main())
