"""Settings as dataclass fields: each field's type, default and doc make its command-line flag and
its TOML key, so a setting is declared once and every door (`jinfer serve`, `jinfer generate`,
TOML presets, `LLM(**options)`) offers the same ones with the same defaults.

    setting(default, "what it does")      a dataclass field carrying its help text
    add_flags(parser, Cls)                 --field-name for every field, help showing the default
    given(args, Cls)                       the fields set on the command line
    read_toml(path_or_preset)              a TOML file, or a preset shipped in jinfer/presets

Flags parse by the field's annotation: int, float, str, bool (true/false, on/off; a plain bool
also takes `--no-field-name` for off), `bool | None` (also "auto"), tuples of ints
(comma-separated), and `X | None` for the optional ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import typing
from importlib import resources
from typing import Any

PRESET_PACKAGE = "jinfer.presets"


def setting(default: Any, doc: str) -> Any:
    """A dataclass field whose flag and TOML key are documented by `doc`."""
    if isinstance(default, list | dict | set):
        raise TypeError("settings take immutable defaults")
    return dataclasses.field(default=default, metadata={"doc": doc})


def on_off(text: str) -> bool:
    lowered = str(text).lower()
    if lowered in ("true", "on", "yes", "1"):
        return True
    if lowered in ("false", "off", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def on_off_auto(text: str) -> bool | None:
    return None if str(text).lower() == "auto" else on_off(text)


def int_or_auto(text: str) -> int | None:
    return None if str(text).lower() == "auto" else int(text)


def int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _parser_for(hint) -> Any:
    args = typing.get_args(hint)
    optional = type(None) in args
    inner = [a for a in args if a is not type(None)] if args else [hint]
    if typing.get_origin(hint) is tuple or (inner and typing.get_origin(inner[0]) is tuple):
        return int_tuple
    base = inner[0] if len(inner) == 1 else hint
    if base is bool:
        return on_off_auto if optional else on_off
    if base is int and optional:
        return int_or_auto
    if base in (int, float, str):
        return base
    raise TypeError(f"no flag parser for {hint!r}")


def fields(cls) -> list[dataclasses.Field]:
    """The fields of `cls` that are settings (documented with `setting`)."""
    return [f for f in dataclasses.fields(cls) if "doc" in f.metadata]


def _show(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def add_flags(
    parser: argparse.ArgumentParser,
    cls,
    *,
    title: str,
    skip: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None,
) -> None:
    """--name for each setting of `cls` (argparse default None, so `given` sees only what was set);
    `defaults`: where this command's own defaults differ from the field's, shown instead."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title)
    for f in fields(cls):
        if f.name in skip:
            continue
        parse = _parser_for(hints[f.name])
        default = (defaults or {}).get(f.name, f.default)
        auto = default is None and (parse is on_off_auto or "auto:" in f.metadata["doc"])
        shown = "auto" if auto else _show(default)
        flag = "--" + f.name.replace("_", "-")
        group.add_argument(
            flag,
            type=parse,
            default=None,
            metavar=f.name.upper(),
            help=f"{f.metadata['doc']} (default: {shown})",
        )
        if parse is on_off:
            group.add_argument(
                "--no-" + flag[2:], dest=f.name, action="store_const", const=False, help=argparse.SUPPRESS
            )


def given(args: argparse.Namespace, cls) -> dict[str, Any]:
    """The settings of `cls` that the command line set."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def preset_names() -> list[str]:
    return sorted(
        p.name.removesuffix(".toml")
        for p in resources.files(PRESET_PACKAGE).iterdir()
        if p.name.endswith(".toml")
    )


def read_toml(source: str) -> dict[str, Any]:
    """A TOML file by path, or by name a preset shipped inside the package (`jinfer/presets`)."""
    if not os.path.exists(source) and source in preset_names():
        text = resources.files(PRESET_PACKAGE).joinpath(source + ".toml").read_text(encoding="utf-8")
        where = f"preset {source}"
    else:
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(
                f"cannot read {source}: {e.strerror} (presets: {', '.join(preset_names())})"
            ) from None
        where = source
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}: {e}") from None


def check_keys(values: dict[str, Any], where: str, *classes, extra: tuple[str, ...] = ()) -> None:
    known = {f.name for cls in classes for f in fields(cls)} | set(extra)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown options {unknown}")


def typed(values: dict[str, Any], cls) -> dict[str, Any]:
    """TOML values for `cls`'s settings, lists made tuples (dataclass fields are immutable)."""
    names = {f.name for f in fields(cls)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in names}
