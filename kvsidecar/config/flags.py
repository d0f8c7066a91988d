"""The command line and the TOML file read into a Config: flags override the file, which overrides the defaults."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from kvsidecar.config.checks import Config
from kvsidecar.config.groups import DISK_TIER, FLAG_GROUPS
from kvsidecar.errors import ConfigError
from kvsidecar.parsing import parse_bool, parse_text
from kvsidecar_contract.paths import default_socket_path

__all__ = ["add_flags", "build", "from_args", "load_file"]


def _settings() -> list[dataclasses.Field[Any]]:
    return list(dataclasses.fields(Config))


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """parse for argparse, whose message for a bad value is then ConfigError's (not "invalid parse_size value")."""

    def flag_value(text: str) -> Any:
        try:
            return parse_text(parse, text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return flag_value


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one flag per Config field, in their groups; unset flags stay None so the file and defaults
    apply."""
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with the same keys as the flags (dashes or underscores)"
    )
    sections = {group: parser.add_argument_group(group.title, group.description) for group in FLAG_GROUPS}
    defaults = Config(socket=default_socket_path())
    for f in _settings():
        meta = f.metadata
        section = sections[meta["group"]]
        flag = "--" + f.name.replace("_", "-")
        text = meta["help"] % {"default": getattr(defaults, f.name)}
        if meta["parse"] is bool:
            section.add_argument(flag, dest=f.name, action="store_const", const=True, default=None, help=text)
            continue
        section.add_argument(
            flag,
            dest=f.name,
            type=_flag_type(meta["parse"]),
            default=None,
            action="append" if meta["repeatable"] else "store",
            help=text,
        )


def from_args(args: argparse.Namespace) -> Config:
    """Flags override the config file, which overrides the defaults."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_file(Path(args.config)))
    for f in _settings():
        value = getattr(args, f.name, None)
        if value is not None:
            values[f.name] = value
    return build(values)


def load_file(path: Path) -> dict[str, Any]:
    """Read a TOML config file into Config field values, each parsed as its flag would be."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    known = {f.name: f for f in _settings()}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"config file {path}: unknown key {key!r}")
        meta = known[name].metadata
        parse = parse_bool if meta["parse"] is bool else meta["parse"]
        try:
            if meta["repeatable"] and isinstance(value, list):
                out[name] = tuple(parse_text(parse, item) if isinstance(item, str) else item for item in value)
            else:
                out[name] = parse_text(parse, value) if isinstance(value, str) else value
        except ConfigError as exc:
            raise ConfigError(f"config file {path}: bad value for {key!r}: {exc}") from None
    return out


def build(values: dict[str, Any]) -> Config:
    """A Config from field values, with every field type checked; a repeatable setting's list becomes a tuple."""
    fields = {f.name: f for f in _settings()}
    unknown = set(values) - set(fields)
    if unknown:
        raise ConfigError(f"unknown settings: {', '.join(sorted(unknown))}")
    # A disk-tier setting without the disk tier would do nothing: say so rather than ignore it.
    idle = [n for n in values if fields[n].metadata["group"] is DISK_TIER and n != "ssd_dir"]
    if idle and not values.get("ssd_dir"):
        flags = ", ".join("--" + n.replace("_", "-") for n in sorted(idle))
        raise ConfigError(f"{flags} {'applies' if len(idle) == 1 else 'apply'} only with --ssd-dir (the disk tier)")
    ready = dict(values)
    for name, value in values.items():
        if fields[name].metadata["repeatable"]:
            ready[name] = (value,) if isinstance(value, str) else tuple(value)
    try:
        return Config(**ready)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
