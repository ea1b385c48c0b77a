"""The configuration of :class:`~torsh_distributed.inference.server.InferenceServer`: address,
token, TLS and batching, validated at construction without torch (so ``torsh-dist serve`` refuses
a bad setting before anything loads). Re-exported by :mod:`~torsh_distributed.inference.server`.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["MIN_TOKEN_LENGTH", "SCHEDULERS", "ServerConfig", "is_loopback", "read_token"]

MIN_TOKEN_LENGTH = 16
SCHEDULERS = ("continuous", "static")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _positive(name: str, value: object, *, kind: type = int, zero: bool = False) -> None:
    ok = isinstance(value, kind) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value < 0 or (value == 0 and not zero):  # type: ignore[operator]
        bound = ">= 0" if zero else "> 0"
        raise ValueError(
            f"server.{name} must be {'an int' if kind is int else 'a number'} "
            f"{bound}, got {value!r}"
        )


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    """Where the server listens, who may call it, over what, and how it batches."""

    host: str = "127.0.0.1"
    """Bind address. Loopback by default; any other address (``0.0.0.0``, a LAN address)
    requires :attr:`token`, since then other machines can send requests, and TLS
    (:attr:`tls_cert`) unless :attr:`insecure`, since the token would cross the network."""
    port: int = 0
    """TCP port; 0 = a free port chosen by the OS (see :attr:`InferenceServer.port`)."""
    token: str | None = field(default=None, repr=False)
    """Shared secret: every request but ``/health`` must send ``Authorization: Bearer
    <token>``. At least 16 characters (``python -c 'import secrets;
    print(secrets.token_urlsafe(32))'``). ``None`` = no authentication (loopback only)."""
    tls_cert: str | None = None
    """PEM certificate (chain) to serve HTTPS with, given with :attr:`tls_key`; clients verify
    it against the CA that signed it (the official client: ``OpenAI(base_url="https://...",
    http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=CA)))``).
    TLS adds a handshake per connection and encryption of every byte; without it, the token,
    prompts and completions are readable on the network. ``None`` = plain HTTP."""
    tls_key: str | None = None
    """The certificate's PEM private key (unencrypted; ``chmod 600``)."""
    insecure: bool = False
    """Serve plain HTTP with a token on a non-loopback address anyway (refused otherwise): for a
    server behind a TLS-terminating proxy or on a network you trust. Ignored with TLS or on
    loopback (a warning says so)."""
    model_name: str = "torsh-gpt"
    """The model's id in ``GET /v1/models`` and in answers; a request naming another is 404."""
    scheduler: Literal["continuous", "static"] = "continuous"
    """``continuous``: rows join and leave the running batch between decoding steps;
    ``static``: a batch runs until its longest row ends (see the module doc)."""
    max_batch_size: int = 8
    """Rows (choices) decoded together at most. Larger batches raise throughput (each step's
    weight reads are shared) at the cost of KV-cache memory (continuous batching reserves
    ``max_batch_size x context`` slots per layer) and of each step's time."""
    max_batch_tokens: int = 2048
    """Continuous batching: tokens one step may feed (one per running row plus the prompts of
    the rows joining). Lower bounds the delay a long prompt joining adds to the running rows'
    next token; higher lets more rows join at once. A lone row always fits."""
    batch_wait_ms: float = 5.0
    """Static batching: after a request arrives, how long the worker waits for others to join
    its batch: higher batches more under light load at the cost of that much added latency;
    0 = take what is queued."""
    max_new_tokens_limit: int = 256
    """The largest ``max_tokens`` a request may ask for (400 above it)."""
    max_total_tokens: int | None = None
    """Prompt plus ``max_tokens`` at most (400 above it); ``None`` = no limit beyond the
    model's context, where generation stops with ``finish_reason == "length"``."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted (413 above it)."""
    max_queued_requests: int = 256
    """Rows (choices) waiting at most; more are refused with 503 rather than queued without
    bound. Also the most choices one request may ask for (prompts x ``n``)."""
    request_timeout_s: float = 600.0
    """A request not answered within this many seconds gets 504."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise ValueError(f"server.host must be a host name or address, got {self.host!r}")
        if (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not 0 <= self.port <= 65535
        ):
            raise ValueError(f"server.port must be an int in [0, 65535], got {self.port!r}")
        if self.token is not None:
            if not isinstance(self.token, str) or len(self.token) < MIN_TOKEN_LENGTH:
                raise ValueError(
                    f"server.token must be a string of at least {MIN_TOKEN_LENGTH} characters "
                    "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
                )
            if any(c.isspace() or not c.isprintable() for c in self.token):
                raise ValueError("server.token must not contain whitespace or control characters")
        elif not is_loopback(self.host):
            raise ValueError(
                f"server.host {self.host!r} is not a loopback address: other machines could send "
                "requests, so a token is required (--token-env VAR or --token-file FILE); bind "
                "127.0.0.1 to serve this machine only"
            )
        self._check_tls()
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise ValueError(
                f"server.model_name must be a non-empty string, got {self.model_name!r}"
            )
        if self.scheduler not in SCHEDULERS:
            raise ValueError(
                f"server.scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}"
            )
        for name in (
            "max_batch_size",
            "max_batch_tokens",
            "max_new_tokens_limit",
            "max_body_bytes",
            "max_queued_requests",
        ):
            _positive(name, getattr(self, name))
        if self.max_total_tokens is not None:
            _positive("max_total_tokens", self.max_total_tokens)
        _positive("batch_wait_ms", self.batch_wait_ms, kind=float, zero=True)
        _positive("request_timeout_s", self.request_timeout_s, kind=float)

    def _check_tls(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("server.tls_cert and server.tls_key go together (--tls-cert FILE --tls-key FILE)")
        if not isinstance(self.insecure, bool):
            raise ValueError(f"server.insecure must be a bool, got {self.insecure!r}")
        if self.tls_cert is not None and self.tls_key is not None:
            from torsh_distributed.runtime.tls import server_context

            server_context(self.tls_cert, self.tls_key)  # a bad pair fails here, in one line
            if self.insecure:
                warnings.warn("server.insecure is ignored: the server speaks TLS", stacklevel=4)
        elif is_loopback(self.host):
            if self.insecure:
                warnings.warn("server.insecure is ignored on a loopback address", stacklevel=4)
        elif not self.insecure:
            raise ValueError(
                f"server.host {self.host!r} is not a loopback address and the server has no TLS: "
                "the token and every prompt would cross the network in clear text; give "
                "--tls-cert FILE --tls-key FILE, or --insecure to serve plain HTTP anyway (behind "
                "a TLS-terminating proxy or on a trusted network)"
            )


def read_token(*, env: str | None = None, file: str | os.PathLike[str] | None = None) -> str | None:
    """The server token from the environment variable ``env`` or the file ``file`` (its first
    line, surrounding whitespace removed); ``None`` when neither is given.

    Raises:
        ValueError: both given; the variable is unset or empty; the file is empty.
        FileNotFoundError: the file does not exist.
    """
    if env and file:
        raise ValueError("give the token one way: --token-env VAR or --token-file FILE, not both")
    if env:
        value = os.environ.get(env, "").strip()
        if not value:
            raise ValueError(f"--token-env {env}: the environment variable {env} is unset or empty")
        return value
    if file:
        path = Path(file)
        if not path.is_file():
            raise FileNotFoundError(f"--token-file {path}: no such file")
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            warnings.warn(
                f"--token-file {path} is readable by other users (chmod 600 it)", stacklevel=2
            )
        lines = path.read_text(encoding="utf-8").strip().splitlines()
        if not lines or not lines[0].strip():
            raise ValueError(f"--token-file {path} is empty")
        return lines[0].strip()
    return None
