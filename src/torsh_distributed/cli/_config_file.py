"""``--config FILE`` and ``--print-config`` for subcommands: a TOML file as the command's flags.

A key is a flag's destination: the flag without ``--`` and with ``-`` spelled ``_`` or ``-``
(``max_steps``, ``nproc-per-node``). A section flag ``--optim.lr`` is the key ``lr`` of the
table ``[optim]``. A command may name prefix tables: with ``user``, the table ``[user]`` holds
``--model`` (destination ``user_model``) as ``model``. Flags on the command line override the
file; the file overrides the defaults (and ``--preset``'s values).

``--print-config`` prints the resolved settings as TOML and exits: fed back through
``--config``, the file gives the same run. A command may register a resolver that expands the
settings (``train`` prints every field of its configuration, not only those given).

Values are checked as the flags would be: an unknown key (with the closest known ones), a
wrong type or a choice outside the allowed ones is an error naming the file and the key,
before anything starts.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "add_config_file_arguments",
    "apply_config_file",
    "config_file_path",
    "dump_toml",
    "settings_of",
]

Resolver = Callable[[argparse.Namespace], dict[str, Any]]
"""Settings of a parsed command line (``{destination: value}``) for ``--print-config``."""

_SKIP = {"command", "handler", "config", "print_config", "config_resolver", "config_tables",
         "config_json", "help"}


def add_config_file_arguments(
    parser: argparse.ArgumentParser,
    *,
    tables: Sequence[str] = (),
    resolver: Resolver | None = None,
) -> None:
    """Give ``parser`` the ``--config FILE`` and ``--print-config`` flags.

    Args:
        parser: a subcommand's parser.
        tables: destination prefixes grouped as TOML tables (``user`` puts ``user_model`` in
            ``[user]`` as ``model``).
        resolver: what ``--print-config`` prints; default: every setting the command line
            and the file gave (including defaults).
    """
    group = parser.add_argument_group("config file")
    group.add_argument(
        "--config", metavar="FILE.toml",
        help="read settings from a TOML file (keys: flag names; [section] tables for "
        "--section.name flags); flags given here override the file",
    )
    group.add_argument(
        "--print-config", action="store_true",
        help="print the resolved settings as TOML (feed them back with --config) and exit",
    )
    parser.set_defaults(config_tables=tuple(tables), config_resolver=resolver)


def config_file_path(argv: Sequence[str]) -> str | None:
    """The value of ``--config`` in ``argv`` (``--config F`` or ``--config=F``), if any."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _load(path: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file")
    try:
        with file.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--config {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _flatten(data: Mapping[str, Any], path: str) -> dict[str, Any]:
    """``{key path: value}``: a table's keys become ``table.key``; keys spelled with ``-`` or ``_``."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            for sub, inner in value.items():
                name = f"{key}.{sub}".replace("-", "_")
                if isinstance(inner, dict):
                    raise ValueError(f"--config {path}: [{key}.{sub}]: tables nest one level only")
                flat[name] = inner
        else:
            flat[key.replace("-", "_")] = value
    return flat


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        a.dest: a for a in parser._actions  # noqa: SLF001 - argparse has no public list of actions
        if a.dest not in _SKIP and a.dest != argparse.SUPPRESS and a.option_strings
    }


def _flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def _convert(action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` from the file as the flag would have parsed it; ``ValueError`` if it cannot be."""
    flag = _flag(action)
    is_bool = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,  # noqa: SLF001
                                  argparse.BooleanOptionalAction))
    if is_bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {flag} is a switch: write true or false, not {value!r}")
        return value
    if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+"):  # noqa: SLF001
        values = value if isinstance(value, list) else [value]
        return [_scalar(action, v, where, flag) for v in values]
    if isinstance(value, (list, dict)):
        raise ValueError(f"{where}: {flag} takes one value, not {value!r}")
    return _scalar(action, value, where, flag)


def _scalar(action: argparse.Action, value: Any, where: str, flag: str) -> Any:
    if isinstance(value, (list, dict)):
        raise ValueError(f"{where}: {flag} takes plain values, not {value!r}")
    convert = action.type
    if isinstance(value, bool) and getattr(convert, "__name__", "") != "_parse_bool":
        raise ValueError(f"{where}: {flag} takes {action.metavar or 'a value'}, not a true/false")
    if convert is not None and callable(convert):
        try:
            value = convert(value if isinstance(value, str) else _text(value))
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            kind = getattr(convert, "__name__", "the flag's type")
            raise ValueError(f"{where}: {flag} expects {kind}, got {value!r} ({exc})") from None
    elif not isinstance(value, str):
        value = _text(value)
    if action.choices is not None and value not in action.choices:
        allowed = ", ".join(map(str, action.choices))
        raise ValueError(f"{where}: {flag} must be one of {allowed}, got {value!r}")
    return value


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def apply_config_file(parser: argparse.ArgumentParser, argv: Sequence[str], command: str) -> None:
    """Set the defaults of ``command``'s sub-parser from the ``--config`` file in ``argv``.

    Raises:
        ValueError: the file is missing, not TOML, or holds a key or value the flags refuse;
            the message names the file and the key.
    """
    path = config_file_path(argv)
    if path is None:
        return
    sub = _subparser(parser, command)
    if sub is None or "config" not in {a.dest for a in sub._actions}:  # noqa: SLF001
        return  # a command without the flag: a --config there belongs to a user's script
    actions = _actions(sub)
    tables = sub.get_default("config_tables") or ()
    defaults: dict[str, Any] = {}
    for key, value in _flatten(_load(path), path).items():
        table, _, name = key.partition(".")
        dest = key if key in actions else (f"{table}_{name}" if table in tables and name else key)
        where = f"--config {path}: {key}"
        action = actions.get(dest)
        if action is None:
            near = difflib.get_close_matches(key, [_key(d, tables) for d in actions], n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ValueError(f"--config {path}: unknown key {key!r}{hint}")
        defaults[dest] = _convert(action, value, where)
        action.required = False  # the file gives it; a flag may still override
    sub.set_defaults(**defaults)


def _key(dest: str, tables: Sequence[str]) -> str:
    for table in tables:
        if dest.startswith(f"{table}_"):
            return f"{table}.{dest[len(table) + 1:]}"
    return dest


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return action.choices.get(command)
    return None


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting of a parsed command line (defaults included), for ``--print-config``."""
    out: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if dest in _SKIP or value is None or callable(value):
            continue
        out[dest] = str(value) if isinstance(value, Path) else value
    return out


def dump_toml(settings: Mapping[str, Any], *, tables: Sequence[str] = (), header: str = "") -> str:
    """``settings`` (``{destination: value}``) as TOML: dotted destinations and ``tables``
    prefixes as tables, plain ones first."""
    top: dict[str, Any] = {}
    grouped: dict[str, dict[str, Any]] = {}
    for dest, value in settings.items():
        key = _key(dest, tables)
        table, dot, name = key.partition(".")
        if dot:
            grouped.setdefault(table, {})[name] = value
        else:
            top[key] = value
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"{k} = {_toml_value(v)}" for k, v in top.items()]
    for table, values in grouped.items():
        lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def print_config(args: argparse.Namespace, out: Any = None) -> int:
    """``--print-config``: the resolved settings of ``args`` as TOML on ``out`` (stdout)."""
    resolver: Resolver | None = getattr(args, "config_resolver", None)
    settings = resolver(args) if resolver is not None else settings_of(args)
    header = (f"torsh-dist {args.command}: resolved settings "
              f"(torsh-dist {args.command} --config FILE runs them; flags override)")
    text = dump_toml(settings, tables=getattr(args, "config_tables", ()) or (), header=header)
    (out or sys.stdout).write(text)
    return 0
