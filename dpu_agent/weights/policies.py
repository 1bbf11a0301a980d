"""Eviction policies of the weight cache, behind one interface.

A policy only orders keys; the cache decides what is evictable (unpinned, resident).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from dpu_offload.keys import ExpertKey


class EvictionPolicy(Protocol):
    """Observes cache traffic and names the next victim among candidates."""

    name: str

    def on_insert(self, key: ExpertKey) -> None: ...
    def on_access(self, key: ExpertKey) -> None: ...
    def on_remove(self, key: ExpertKey) -> None: ...
    def victim(self, candidates: Iterable[ExpertKey]) -> ExpertKey | None: ...


class LruPolicy:
    """Least recently used."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def on_insert(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    on_access = on_insert

    def on_remove(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def victim(self, candidates: Iterable[ExpertKey]) -> ExpertKey | None:
        allowed = set(candidates)
        return next((k for k in self._order if k in allowed), None)


POLICIES: dict[str, type] = {"lru": LruPolicy}
"""Config name -> policy class."""
