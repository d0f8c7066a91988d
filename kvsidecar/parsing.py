"""How a setting's text becomes its value: sizes ('1GiB'), host:port addresses, octal permissions, booleans.

The flags and the config file (config/), the tenants file (tenancy/) and the parts that take an address (rpc/,
daemon/) read text the same way, so they share these; a bad text is a ConfigError that says what it should look like.

Imports: errors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from kvsidecar.errors import ConfigError

__all__ = ["GiB", "MiB", "TiB", "parse_address", "parse_bool", "parse_mode", "parse_size", "parse_text"]

MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40


def parse_size(text: str | int) -> int:
    """'1GiB', '512MiB', '64M', '4096' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not m:
        raise ConfigError(f"not a size: {text!r} (a number of bytes, with an optional unit: 4096, 512MiB, 64M, 1GiB)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * scale)


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' -> (host, port); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"not a host:port address: {text!r}")
    return host.strip("[]"), int(port)


def parse_mode(text: str) -> int:
    """'0660' -> a file permission."""
    try:
        return int(text, 8)
    except ValueError:
        raise ConfigError(f"not an octal permission: {text!r} (e.g. 0660)") from None


def parse_bool(text: str) -> bool:
    """'true'/'1'/'yes' or 'false'/'0'/'no', any case."""
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ConfigError(f"not a boolean: {text!r} (true or false)")


# What a value of a plain Python parser looks like, for the message when it is not one.
_LOOKS_LIKE: dict[Callable[[str], Any], str] = {int: "a whole number", float: "a number"}


def parse_text(parse: Callable[[str], Any], text: str) -> Any:
    """text as parse reads it; a ConfigError says what the value should look like."""
    try:
        return parse(text)
    except ConfigError:
        raise
    except ValueError:
        raise ConfigError(f"not {_LOOKS_LIKE.get(parse, 'a valid value')}: {text!r}") from None
