"""A user's own Flower app (its ServerApp and ClientApp; nothing of torsh_distributed): the
ServerApp sends ``messages`` query messages, one after the other, to each of ``nodes`` nodes and
writes every reply's metrics to ``result`` (JSON), and how its own process started next to it
(``*.server.json``). Each ClientApp process answers with how it
started: whether torch was imported before Flower loaded this module, its pid and command line,
how many messages this module has handled in this process, and the seconds (wall and CPU) from
the process's creation to the handler, the app's own ``import torch`` included."""

from __future__ import annotations

import sys

TORCH_BEFORE_APP = "torch" in sys.modules  # first: before this module imports anything

import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402
from flwr.app import Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

client = ClientApp()
server = ServerApp()
_handled = 0


@client.query()
def _query(msg: Message, context: Context) -> Message:
    global _handled
    _handled += 1
    import torch  # what the app uses, as a user's training would

    me = psutil.Process()
    metrics = MetricRecord({
        "torch-before-app": int(TORCH_BEFORE_APP),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "handled": _handled,
        "named-flwr-clientapp": int(any("flwr-clientapp" in part for part in me.cmdline()[:2])),
        "start-to-handler-s": time.time() - me.create_time(),
        "cpu-to-handler-s": sum(me.cpu_times()[:2]),
        "torch-ok": int(torch.ones(2).sum().item() == 2),
    })  # fmt: skip
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


@server.main()
def _main(grid: Grid, context: Context) -> None:
    nodes = int(context.run_config["nodes"])
    deadline = time.monotonic() + 300
    while len(list(grid.get_node_ids())) < nodes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {nodes} nodes connected")
        time.sleep(0.5)
    replies: list[dict[str, float]] = []
    for _ in range(int(context.run_config["messages"])):
        sent = time.monotonic()
        out = [Message(RecordDict(), dst_node_id=node, message_type="query") for node in grid.get_node_ids()]
        for reply in grid.send_and_receive(out, timeout=300):
            if reply.has_error():
                raise RuntimeError(f"a ClientApp failed: {reply.error.reason}")
            replies.append({**dict(reply.content["metrics"]), "round-trip-s": time.monotonic() - sent})
    result = Path(str(context.run_config["result"]))
    result.write_text(json.dumps(replies))
    me = psutil.Process()  # how this ServerApp's process started
    result.with_suffix(".server.json").write_text(json.dumps({
        "torch-before-app": int(TORCH_BEFORE_APP), "pid": os.getpid(), "ppid": os.getppid(),
        "named-flwr-serverapp": int(any("flwr-serverapp" in part for part in me.cmdline()[:2])),
    }))  # fmt: skip
