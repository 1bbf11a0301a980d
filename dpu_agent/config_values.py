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


MAX_CPU = 4095
_CPU_RANGE_RE = re.compile(r"^(\d{1,4})(?:-(\d{1,4}))?$")


def parse_cpus(v: Any) -> tuple[int, ...]:
    """A Linux CPU list (``"0-3,8"``, as ``taskset -c`` and ``/proc/*/status`` write it) or a
    TOML array of CPU numbers -> the CPU numbers, ascending; ``""``: none given."""
    if isinstance(v, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in v):
        v = ",".join(map(str, v))
    if not isinstance(v, str):
        raise ValueError(f"expected a CPU list such as '2-3,6', got {v!r}"[:200])
    cpus: set[int] = set()
    for part in filter(None, (x.strip() for x in v.split(","))):
        m = _CPU_RANGE_RE.match(part)
        first = int(m[1]) if m else -1
        last = int(m[2]) if m and m[2] is not None else first
        if not m or not 0 <= first <= last <= MAX_CPU:
            raise ValueError(f"{part!r} in {v!r} is not a CPU number or a range first-last of "
                             f"them, from 0 to {MAX_CPU}"[:300])
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def setting(parse: Callable[[Any], Any], default: Any, *, unit: str = "",
            live: bool = False) -> Any:
    """A setting, declared once: the key of its section's TOML table named as the field (and
    the variable ``DPU_AGENT_<SECTION>_<KEY>``), read by ``parse``; ``unit`` of a number
    (bytes, s, us); ``live``: SIGHUP applies it to a running agent (the others need a
    restart)."""
    return field(default=default, metadata={"parse": parse, "unit": unit, "live": live})
