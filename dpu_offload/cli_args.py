"""Argument types shared by the command lines of the agent (``dpu-agent``, its ``plan`` and
``cluster`` verbs) and the host client (``expertctl``): each refuses what it cannot use with an
error naming the value given (argparse exits 2 with it), before anything is done."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

MAX_SECONDS = 86_400.0
"""The longest timeout or interval a command line takes (a day)."""


def positive(text: str) -> int:
    """An ``argparse`` type: a positive integer, or an error naming the value given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def non_negative(text: str) -> int:
    """An ``argparse`` type: an integer of 0 or more (a count, an index, a seed)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def integer(low: int, high: int) -> Callable[[str], int]:
    """An ``argparse`` type: an integer from ``low`` to ``high`` (a protobuf field's range, say:
    a value outside it would fail only when the request is built)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {text}")
        return value
    return parse


def fraction(text: str) -> float:
    """An ``argparse`` type: a fraction above 0 and at most 1 (of a cache, say)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a fraction, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, got {text}")
    return value


def seconds(text: str) -> float:
    """An ``argparse`` type: a duration in seconds, above 0 and at most ``MAX_SECONDS``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise argparse.ArgumentTypeError(
            f"must be above 0 and at most {MAX_SECONDS:g} seconds, got {text}")
    return value
