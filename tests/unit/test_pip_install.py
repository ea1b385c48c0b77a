"""scripts/pip_install.py: pip's settings handed to uv, and pip where a setting has no translation."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pip_install.py"


def _module():
    spec = importlib.util.spec_from_file_location("pip_install_script", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_indexes_links_and_constraints_reach_uv_and_the_environment_wins():
    m = _module()
    listed = "\n".join([
        ":env:.cert='/etc/ssl/certs/ca.crt'",
        ":env:.find-links='/opt/wheels'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
        "global.find-links='/ignored/by/env'",
        "global.disable-pip-version-check='1'",
        "user.index-url='https://other.example/simple'",  # another section: not pip's install's
    ])
    settings = m.parse_pip_config(listed)
    assert settings["find-links"] == ["/opt/wheels"]
    args, env = m.uv_arguments(settings)
    assert args[:2] == ["--index-strategy", "unsafe-best-match"]
    pairs = list(zip(args[2::2], args[3::2], strict=True))
    assert ("--constraint", "/etc/xdg/pip/constraints.txt") in pairs
    assert ("--extra-index-url", "file:///opt/a/simple") in pairs
    assert ("--extra-index-url", "file:///opt/b/simple") in pairs
    assert ("--find-links", "/opt/wheels") in pairs
    assert "/ignored/by/env" not in args and "--index-url" not in args
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca.crt"}


@pytest.mark.parametrize("line", ["global.no-index='true'", ":env:.proxy='http://p:3128'",
                                  "install.no-binary=':all:'"])
def test_a_setting_uv_would_not_honour_the_same_way_is_named(line: str):
    m = _module()
    with pytest.raises(ValueError, match=line.split(".", 1)[1].split("=")[0]):
        m.uv_arguments(m.parse_pip_config(line))


def test_no_requirement_is_refused_with_usage():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "usage: python scripts/pip_install.py REQUIREMENT" in proc.stderr
