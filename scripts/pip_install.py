"""Install into the running interpreter's environment with uv when it can, with pip otherwise.

Run by the Makefile with the virtual environment's Python: `.venv/bin/python scripts/pip_install.py
ARGS...`, where ARGS are what `pip install` would take (requirements, `-e .[extras]`).

Why: on this project's 2-core CI machine, pip installed the test suite's dependencies in about
100 s of the suite's 15-minute budget; uv installs the same requirements (bytecode compiled, as pip
does) in about 30 s (docs/testing.md, "The install"). uv does not read pip's configuration, so the
indexes, find-links and constraints that pip is configured with (pip.conf files and PIP_* variables,
as `pip config list` reports them) are handed to uv as flags. A setting this script does not know
how to translate, a uv that cannot be installed, or a uv that fails, falls back to pip with one line
saying why; `TORSH_INSTALLER=pip` asks for pip.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

# pip settings that change what is installed, and the uv flag each maps to.
_REPEATED = {
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "requirement": "--requirement",
}
_SINGLE = {"index-url": "--index-url"}
# pip settings that change nothing uv would install (output, version checks, timeouts, certificates
# handled below through SSL_CERT_FILE).
_HARMLESS = {
    "cert",
    "timeout",
    "default-timeout",
    "disable-pip-version-check",
    "no-input",
    "progress-bar",
    "quiet",
    "verbose",
    "root-user-action",
    "no-cache-dir",
    "cache-dir",
    "no-color",
}
_SECTIONS = {"global", "install", ":env:"}


def parse_pip_config(text: str) -> dict[str, list[str]]:
    """`pip config list` lines (`section.key='value'`) -> {key: [values]} for `global`, `install`
    and the environment (PIP_* variables, which win over files as they do for pip)."""
    found: dict[str, dict[str, list[str]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or "=" not in line:
            continue
        name, _, raw = line.partition("=")
        section, _, key = name.rpartition(".")
        if section not in _SECTIONS or not key:
            continue
        value = raw.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        found.setdefault(section, {})[key] = value.split()
    merged: dict[str, list[str]] = {}
    for section in ("global", "install", ":env:"):
        merged.update(found.get(section, {}))
    return merged


def uv_arguments(settings: dict[str, list[str]]) -> tuple[list[str], dict[str, str]]:
    """pip's settings -> (uv flags, environment). Raises ValueError naming a setting uv would
    not honour the same way, so that the caller uses pip instead."""
    args = ["--index-strategy", "unsafe-best-match"]  # pip's rule: the best version of any index
    env: dict[str, str] = {}
    for key, values in sorted(settings.items()):
        if key in _REPEATED:
            for value in values:
                args += [_REPEATED[key], value]
        elif key in _SINGLE:
            args += [_SINGLE[key], values[0]]
        elif key == "cert":
            env["SSL_CERT_FILE"] = values[0]
        elif key in _HARMLESS:
            continue
        else:
            raise ValueError(f"pip setting {key!r} has no uv translation here")
    return args, env


def _run(cmd: list[str], env: dict[str, str] | None = None) -> int:
    return subprocess.call(cmd, env={**os.environ, **(env or {})})


def _pip(requirements: list[str], why: str) -> int:
    if why:
        print(f"pip_install: using pip ({why})", file=sys.stderr)
    return _run([sys.executable, "-m", "pip", "install", "--quiet", *requirements])


def _uv_binary() -> Path | None:
    uv = Path(sys.executable).with_name("uv")
    if uv.exists():
        return uv
    if _run([sys.executable, "-m", "pip", "install", "--quiet", "uv"]) != 0:
        return None
    return uv if uv.exists() else None


def main(requirements: list[str]) -> int:
    if not requirements:
        print("usage: python scripts/pip_install.py REQUIREMENT...", file=sys.stderr)
        return 2
    if os.environ.get("TORSH_INSTALLER", "uv") == "pip":
        return _pip(requirements, "")
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    )
    if listed.returncode != 0:
        return _pip(requirements, "`pip config list` failed")
    try:
        args, env = uv_arguments(parse_pip_config(listed.stdout))
    except ValueError as err:
        return _pip(requirements, str(err))
    uv = _uv_binary()
    if uv is None:
        return _pip(requirements, "uv could not be installed")
    cmd = [str(uv), "pip", "install", "--quiet", "--compile-bytecode", "--python", sys.executable]
    cmd += args + requirements
    if _run(cmd, env) == 0:
        return 0
    return _pip(requirements, f"uv failed: {shlex.join(cmd)}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
