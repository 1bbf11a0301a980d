"""Argument types shared by the command lines of the agent (``dpu-agent-admin``) and the host
client (``expertctl``)."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """An ``argparse`` type: a positive integer, or an error naming the value given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value
