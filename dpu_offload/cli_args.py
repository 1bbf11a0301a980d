"""Argument types shared by the command lines of the agent (``dpu-agent``, its ``plan`` and
``cluster`` verbs) and the host client (``expertctl``): each refuses what it cannot use with an
error naming the value given (argparse exits 2 with it), before anything is done."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)

MAX_SECONDS = 86_400.0
"""The longest timeout or interval a command line takes (a day)."""


def _parse(text: str, convert: Callable[[str], N], kind: str, valid: Callable[[N], bool],
           expected: str) -> N:
    """``text`` as ``convert`` reads it if ``valid``; otherwise an error saying the value must
    be ``kind`` (unreadable) or ``expected`` (out of range)."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
    if not valid(value):
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text}")
    return value


def positive(text: str) -> int:
    """An ``argparse`` type: a positive integer."""
    return _parse(text, int, "a positive integer", lambda v: v > 0, "positive")


def non_negative(text: str) -> int:
    """An ``argparse`` type: an integer of 0 or more (a count, an index, a seed)."""
    return _parse(text, int, "an integer", lambda v: v >= 0, "0 or more")


def integer(low: int, high: int) -> Callable[[str], int]:
    """An ``argparse`` type: an integer from ``low`` to ``high`` (a protobuf field's range, say:
    a value outside it would fail only when the request is built)."""
    return lambda text: _parse(text, int, "an integer", lambda v: low <= v <= high,
                               f"from {low} to {high}")


def fraction(text: str) -> float:
    """An ``argparse`` type: a fraction above 0 and at most 1 (of a cache, say)."""
    return _parse(text, float, "a fraction", lambda v: math.isfinite(v) and 0 < v <= 1,
                  "above 0 and at most 1")


def seconds(text: str) -> float:
    """An ``argparse`` type: a duration in seconds, above 0 and at most ``MAX_SECONDS``."""
    return _parse(text, float, "a number of seconds",
                  lambda v: math.isfinite(v) and 0 < v <= MAX_SECONDS,
                  f"above 0 and at most {MAX_SECONDS:g} seconds")
