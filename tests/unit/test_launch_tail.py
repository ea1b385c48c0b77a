"""The launcher's rank-prefixed output keeps lines whole (torsh_distributed.elastic._tail): a
worker caught between a line and its newline is not echoed until the line is complete."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import tail_log

from torsh_distributed.elastic import _tail


class _Sink:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            self.parts.append(text)
        return len(text)

    def text(self) -> str:
        with self.lock:
            return "".join(self.parts)


def _wait_for(predicate, seconds: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.mark.timeout(60)
def test_torchs_tail_log_echoes_two_ranks_lines_whole(tmp_path: Path) -> None:
    assert _tail.install() and _tail.install()  # idempotent
    assert tail_log.tail_logfile is _tail.tail_whole_lines
    files = {0: str(tmp_path / "0.log"), 1: str(tmp_path / "1.log")}
    sink = _Sink()
    prefixes = {0: "[rank0]: ", 1: "[rank1]: "}
    tailer = tail_log.TailLog("w", files, sink, prefixes, interval_sec=0.01).start()  # type: ignore[arg-type]
    try:
        with open(files[0], "w") as r0, open(files[1], "w") as r1:
            r0.write("final loss 3.46")  # rank 0 between its text and its newline
            r0.flush()
            # torch's own tail echoes the fragment within one interval; ours must not
            assert not _wait_for(lambda: "final loss" in sink.text(), 0.5), sink.text()
            r1.write("final loss 3.46\n")
            r1.flush()
            assert _wait_for(lambda: "[rank1]: final loss 3.46\n" in sink.text(), 10)
            r0.write("\nnext")
            r0.flush()
            assert _wait_for(lambda: "[rank0]: final loss 3.46\n" in sink.text(), 10)
    finally:
        tailer.stop()
    lines = sink.text().splitlines(keepends=True)
    assert sorted(lines) == ["[rank0]: final loss 3.46\n", "[rank0]: next\n", "[rank1]: final loss 3.46\n"]


def test_a_line_without_its_newline_at_the_end_is_kept(tmp_path: Path) -> None:
    log = tmp_path / "0.log"
    log.write_text("one\ntwo")
    sink = _Sink()
    finished = threading.Event()
    finished.set()
    _tail.tail_whole_lines("[rank0]: ", str(log), sink, finished, 0.01)  # type: ignore[arg-type]
    assert sink.text() == "[rank0]: one\n[rank0]: two\n"
