"""`torsh-dist serve` starts without torch's deprecation warnings: serving does not import
``torch.distributed.optim`` (whose import scripts optimizers with the deprecated
``torch.jit.script``), and the start-up prints only what its own settings warn about."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys, warnings
warnings.simplefilter("error", DeprecationWarning)
import torsh_distributed.inference.serve, torsh_distributed.inference.server
import torsh_distributed.parallel
print("torch.distributed.optim" in sys.modules)
"""


def test_serving_modules_do_not_import_torch_distributed_optim():
    proc = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False"


def test_serve_start_up_prints_no_library_warnings(tmp_path):
    # an empty --checkpoint directory: the start-up runs through the settings (whose warnings it
    # prints) and stops at the checkpoint, in a fresh process (no module imported yet)
    proc = subprocess.run(
        [sys.executable, "-m", "torsh_distributed.cli.main", "serve", "--checkpoint",
         str(tmp_path), "--port", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"torsh-dist serve: error: no checkpoint in {tmp_path}" in proc.stderr
    assert "warning" not in proc.stderr, proc.stderr[-3000:]
