"""`torsh-dist train --plot FILE`: rank 0 writes the loss curve at the end; a missing matplotlib
or a bad file name is refused before any rank starts. The run's checkpoint directory then loads
for inference from the config the trainer recorded in it."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from torsh_distributed.testing.cli import run_cli

QUICK = ["--preset", "tiny", "--data.max-bytes", "200000", "--max-steps", "4", "--batch-size",
         "8", "--eval-every", "2", "--eval-batches", "1", "--progress", "false"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(args: list[str], *, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return run_cli(args, timeout=timeout)  # a warm process (torsh_distributed.testing.cli)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_ranks_write_one_png_and_a_loadable_checkpoint(tmp_path: Path):
    from torsh_distributed.inference.load import load_gpt
    from torsh_distributed.train import preset

    plot = tmp_path / "plots" / "loss.png"
    proc = _run(["train", "--nproc-per-node", "2", *QUICK, "--plot", str(plot),
                 "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = plot.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (700, 400)
    assert proc.stdout.count("loss curve written to") == 1, "only rank 0 plots"
    assert not list(plot.parent.glob(".*tmp*"))
    model, config, info = load_gpt(tmp_path / "ckpt")
    assert config == preset("tiny").model and info.step == 4 and info.world_size == 2


def test_plot_refused_before_launch_without_matplotlib_or_with_a_bad_name(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    # Refused before any rank starts: the command's own code in this process (file-descriptor
    # capture, so a rank that started would show), without ~3 s of interpreter start per case.
    from torsh_distributed.cli.main import main

    with monkeypatch.context() as hidden:
        hidden.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
        code = main(["train", "--nproc-per-node", "2", *QUICK, "--plot", str(tmp_path / "l.png")])
    out, err = capfd.readouterr()
    assert code == 2, err
    assert "--plot) needs matplotlib, which is not installed: pip install " in err
    assert "torsh-distributed[plot]" in err and "[rank" not in out
    code = main(["train", *QUICK, "--plot", str(tmp_path / "loss.txt")])
    assert code == 2 and "must end in .png, .svg, .pdf, got" in capfd.readouterr().err
    assert not (tmp_path / "l.png").exists()
