"""The agent configuration's values: how a key's text becomes a typed setting (sizes with
units, integers, strings, name lists), how a setting is declared, and the error that lists
every problem of a configuration."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import field
from typing import Any

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConfigError(ValueError):
    """The configuration has problems; ``problems`` lists each as 'key: what is wrong'."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))
        self.problems = problems


def parse_size(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str):
        m = _SIZE_RE.match(v)
        if m:
            return int(m[1]) * _UNITS[(m[2] or "B").lower()]
    raise ValueError(f"expected a size (bytes, or e.g. '4GiB'), got {v!r}")


def parse_int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError(f"expected an integer, got {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    raise ValueError(f"expected an integer, got {v!r}")


def parse_str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    return v


MAX_ADMIN_NAMES = 64


def parse_names(v: Any) -> tuple[str, ...]:
    if (not isinstance(v, list) or len(v) > MAX_ADMIN_NAMES
            or not all(isinstance(x, str) and 0 < len(x) <= 256 for x in v)):
        raise ValueError(f"expected a list of at most {MAX_ADMIN_NAMES} names of 1-256 "
                         f"characters, got {v!r}"[:300])
    return tuple(v)


def setting(parse: Callable[[Any], Any], default: Any, *, unit: str = "",
            live: bool = False) -> Any:
    """A setting, declared once: the key of its section's TOML table named as the field (and
    the variable ``DPU_AGENT_<SECTION>_<KEY>``), read by ``parse``; ``unit`` of a number
    (bytes, s, us); ``live``: SIGHUP applies it to a running agent (the others need a
    restart)."""
    return field(default=default, metadata={"parse": parse, "unit": unit, "live": live})
