"""The relay that guards an exposed federation: only peers holding the token get through, both
ends prove it, and an exposed federation without a token is refused before anything starts."""

from __future__ import annotations

import errno
import socket
import ssl
import threading
import time
from typing import Any

import pytest

from torsh_distributed.federated._relay import Relay
from torsh_distributed.federated.config import FederatedConfig
from torsh_distributed.federated.deploy import Federation, join

TOKEN = b"a-token-of-sixteen-plus"


@pytest.fixture
def echo() -> int:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(4096):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def _roundtrip(port: int, payload: bytes) -> bytes:
    """What comes back for ``payload``. A relay that refuses drops the connection, sometimes
    before the payload is sent or shut (ENOTCONN, ECONNRESET, EPIPE): then nothing came back. A
    drop on an accepted path still fails its test, which compares the whole echo."""
    chunks = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while data := sock.recv(4096):
                chunks.append(data)
        except OSError as exc:
            if exc.errno not in (errno.ENOTCONN, errno.ECONNRESET, errno.EPIPE):
                raise
    return b"".join(chunks)


@pytest.mark.timeout(60)
def test_stop_closes_every_open_connection(echo: int) -> None:
    """A stopped relay leaves no connection for the garbage collector: its close, run later from
    any thread, once shut a newer connection that had been given the same descriptor number."""
    head = Relay(role="server", listen=("127.0.0.1", 0), target=("127.0.0.1", echo), token=TOKEN).start()
    node = Relay(role="client", listen=("127.0.0.1", 0), target=("127.0.0.1", head.port), token=TOKEN).start()
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sock:
        sock.sendall(b"ping")
        echoed = b""
        while len(echoed) < 4 and (data := sock.recv(4 - len(echoed))):
            echoed += data
        assert echoed == b"ping"  # through both relays and back: the connection is live
        assert len(node._tasks) == 1
        node.stop()
        head.stop()
        assert sock.recv(4) == b""  # closed by stop(), not left open
    assert not node._tasks and not head._tasks


@pytest.mark.timeout(60)
def test_only_token_holders_reach_the_target(echo: int) -> None:
    head = Relay(role="server", listen=("127.0.0.1", 0), target=("127.0.0.1", echo), token=TOKEN).start()
    good = Relay(role="client", listen=("127.0.0.1", 0), target=("127.0.0.1", head.port), token=TOKEN).start()
    bad = Relay(role="client", listen=("127.0.0.1", 0), target=("127.0.0.1", head.port),
                token=b"another-token-entirely").start()  # fmt: skip
    try:
        assert _roundtrip(good.port, b"hello flower" * 1000) == b"hello flower" * 1000
        assert _roundtrip(bad.port, b"let me in") == b""
        with socket.create_connection(("127.0.0.1", head.port), timeout=10) as raw:  # no handshake
            raw.recv(32)  # the nonce
            raw.sendall(b"POST /v1/control/start-run HTTP/1.1\r\n" + b"x" * 64)
            try:
                answer = raw.recv(4096)
            except ConnectionResetError:  # dropped with our bytes unread: a reset, not a FIN
                answer = b""
            assert answer == b""  # dropped, nothing forwarded
        assert head.refused == 2
        fake_head = Relay(role="server", listen=("127.0.0.1", 0), target=("127.0.0.1", echo),
                          token=b"not-the-real-token!").start()  # fmt: skip
        node = Relay(role="client", listen=("127.0.0.1", 0), target=("127.0.0.1", fake_head.port), token=TOKEN).start()
        assert _roundtrip(node.port, b"secret update") == b""  # a head without the token gets nothing
        node.stop()
        fake_head.stop()
    finally:
        for relay in (good, bad, head):
            relay.stop()


def test_exposed_federation_and_remote_join_need_a_token(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="needs a shared token"):
        Federation(FederatedConfig(run_dir=str(tmp_path)), host="10.1.2.3")
    with pytest.raises(ValueError, match="without TLS would carry weights and updates in the clear"):
        Federation(FederatedConfig(run_dir=str(tmp_path)), host="10.1.2.3", token="x" * 20)
    with pytest.raises(ValueError, match="without TLS would carry weights"):
        join("10.1.2.3:9092", partition_id=0, num_partitions=2, token="x" * 20)
    with pytest.raises(ValueError, match="needs the federation's token"):
        join("10.1.2.3:9092", partition_id=0, num_partitions=2)
    with pytest.raises(ValueError, match="HOST:PORT"):
        join("10.1.2.3", partition_id=0, num_partitions=2, token="x" * 20)
    with pytest.raises(ValueError, match="at least 16"):
        Relay(role="server", listen=("127.0.0.1", 0), target=("127.0.0.1", 1), token=b"short")


def _exchange(port: int, payload: bytes) -> bytes:
    """Send ``payload`` and read as many bytes back without half-closing (a TLS stream cannot);
    b"" when the relay drops the connection."""
    chunks: list[bytes] = []
    got = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(payload)
            while got < len(payload) and (data := sock.recv(65536)):
                chunks.append(data)
                got += len(data)
        except OSError as exc:
            if exc.errno not in (errno.ENOTCONN, errno.ECONNRESET, errno.EPIPE):
                raise
    return b"".join(chunks)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from torsh_distributed.runtime.tls import issue, make_ca

    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root / "ca")
    other = make_ca(root / "other", name="another CA")
    return {
        "ca": ca.cert, "other_ca": other.cert,
        "head": issue(ca, root, name="head", hosts=["127.0.0.1"]),
        "node": issue(ca, root, name="node-0"),
        "stranger": issue(other, root, name="stranger"),
    }  # fmt: skip


@pytest.mark.timeout(60)
def test_over_tls_only_nodes_with_a_certificate_of_the_ca_get_through(echo: int, pki: dict[str, Any]) -> None:
    from torsh_distributed.runtime.tls import client_context, server_context

    head_lines: list[str] = []
    head = Relay(role="server", listen=("127.0.0.1", 0), target=("127.0.0.1", echo), token=TOKEN,
                 tls=server_context(*pki["head"], ca=pki["ca"]), report=head_lines.append).start()  # fmt: skip
    target = ("127.0.0.1", head.port)
    started = []

    def node(ctx: ssl.SSLContext) -> tuple[Relay, list[str]]:
        lines: list[str] = []
        relay = Relay(role="client", listen=("127.0.0.1", 0), target=target, token=TOKEN, tls=ctx,
                      report=lines.append).start()  # fmt: skip
        started.append(relay)
        return relay, lines

    try:
        good, _ = node(client_context(pki["ca"], cert=pki["node"][0], key=pki["node"][1]))
        payload = b"model weights \x00\x01" * 5000
        assert _exchange(good.port, payload) == payload
        # a node trusting another CA refuses the head, in one line naming the cause
        wrong_ca, lines = node(client_context(pki["other_ca"], cert=pki["node"][0], key=pki["node"][1]))
        assert _exchange(wrong_ca.port, b"update") == b""
        assert _exchange(wrong_ca.port, b"update") == b""
        assert lines == [f"federation relay: cannot join 127.0.0.1:{head.port} over TLS (self-signed "
                         "certificate in certificate chain): is --tls-ca the federation's CA?"]
        # nodes without a certificate, or with one of another CA, are refused by the head
        for cert in (None, pki["stranger"]):
            ctx = client_context(pki["ca"], cert=cert[0] if cert else None, key=cert[1] if cert else None)
            stranger, _ = node(ctx)
            assert _exchange(stranger.port, b"let me in") == b""
        # the head counts a refusal in its own handshake thread, which may finish after the node
        # has already seen its connection close (TLS 1.3: the client's certificate is checked by
        # the server after the client's side of the handshake is done): wait for the count
        deadline = time.monotonic() + 30
        while head.tls_refused < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert head.tls_refused >= 2 and head.refused == 0
        assert head_lines and all(line.startswith("federation relay: refused a node: TLS handshake failed")
                                  for line in head_lines), head_lines
        # a plain-TCP client relay gets nothing either
        plain, _ = node(None)  # type: ignore[arg-type]
        assert _exchange(plain.port, b"hello") == b""
        assert _exchange(good.port, b"still fine") == b"still fine"
    finally:
        for relay in (*started, head):
            relay.stop()
