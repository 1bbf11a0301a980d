"""The flow-steering table: the software model of DOCA Flow pipes (docs/DOCA.md), one
definition for the agent, which programs it, and the NIC stand-in, which executes it.

A rule matches traffic by class (weights or activations), model, layer range, expert and
source, and acts: forward to a device queue (one of several replicas, chosen by least work
in flight), hand to the agent, drop, or only count. The highest priority match wins; ties go
to the rule added first. Updates build a new immutable table and swap it in with a new
version, so a reader sees the old table or the new one, never a mix. Per-rule packet and byte
counters survive updates of other rules. ``rule_record`` / ``rule_from_record`` are the rules'
form in the agent's published snapshot (``dpu_offload.steering_snapshot``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any, NamedTuple


class TrafficClass(str, Enum):
    WEIGHTS = "weights"
    ACTIVATIONS = "activations"

    # Enum's own __hash__ is Python code; lookups hash this in every key (equal to the str's).
    __hash__ = str.__hash__


class Action(str, Enum):
    FORWARD = "forward"
    TO_AGENT = "to_agent"
    DROP = "drop"
    COUNT = "count"


ANY = -1
"""Wildcard for layer bounds and expert."""
_FORWARD, _COUNT, _DROP = Action.FORWARD, Action.COUNT, Action.DROP


@dataclass(frozen=True)
class FlowRule:
    """One steering rule. ``queues`` are device ids (FORWARD only)."""

    rule_id: int
    traffic: TrafficClass
    action: Action
    model: str = ""
    """Empty matches every model."""
    layer_min: int = ANY
    layer_max: int = ANY
    expert: int = ANY
    source: str = ""
    """Empty matches every sender."""
    queues: tuple[int, ...] = ()
    priority: int = 0
    origin: str = ""
    """Who made it: ``manual:<session>`` (ApplyFlows; only that session deletes it) or
    ``placement:<session>:<model>`` (follows that session's placement of the model); every
    rule of a session goes when it closes."""

    def matches(self, traffic: TrafficClass, model: str, layer: int, expert: int,
                source: str) -> bool:
        return (self.traffic == traffic and self.model in ("", model)
                and (self.layer_min == ANY or layer >= self.layer_min)
                and (self.layer_max == ANY or layer <= self.layer_max)
                and self.expert in (ANY, expert) and self.source in ("", source))


class SteeringError(ValueError):
    """A rule or update is malformed; the message says which field."""


def _sort_key(rule: FlowRule) -> tuple[int, int]:
    return (-rule.priority, rule.rule_id)


@dataclass
class Counters:
    packets: int = 0
    bytes: int = 0
    dropped: int = 0


class Decision(NamedTuple):
    """The outcome of a lookup."""

    rule: FlowRule | None
    action: Action
    queue: int | None
    version: int


@dataclass(frozen=True)
class _Table:
    version: int
    rules: tuple[FlowRule, ...]
    """Sorted: priority descending, then rule id ascending."""
    exact: dict[tuple[TrafficClass, str, int, int], tuple[FlowRule, ...]] = field(
        default_factory=dict)
    """Rules naming one model, one layer and one expert, any source (placement's rules):
    found by one dictionary lookup instead of a scan."""
    wild: dict[tuple[TrafficClass, str], tuple[FlowRule, ...]] = field(default_factory=dict)
    """Every other rule by (traffic, model or '' for any model), sorted like ``rules``."""
    wild_for: dict[tuple[TrafficClass, str], tuple[FlowRule, ...]] = field(
        default_factory=dict)
    """For each (traffic, model) that any rule names: its wildcard rules plus the any-model
    ones, sorted (one dictionary lookup on the hot path; other models take
    ``wild[(traffic, '')]``)."""
    direct: dict[tuple[TrafficClass, str, int, int],
                 tuple[Counters, tuple[Decision, ...], bool]] = field(default_factory=dict)
    """The exact keys whose first rule decides alone (no wildcard rule of their traffic and
    model, and that rule does not COUNT): its counters, its decisions made in advance (one per
    queue of a FORWARD, else one), and whether it drops. The placement's rules are all of
    this kind: a lookup is then one dictionary lookup and no allocation."""

    @classmethod
    def build(cls, version: int, rules: list[FlowRule], counters: dict[int, Counters]
              ) -> _Table:
        """The table of ``rules`` at ``version``, each rule counted in ``counters[rule_id]``."""
        rules = sorted(rules, key=_sort_key)
        exact: dict[tuple[TrafficClass, str, int, int], list[FlowRule]] = {}
        wild: dict[tuple[TrafficClass, str], list[FlowRule]] = {}
        for r in rules:
            if r.model and r.layer_min == r.layer_max != ANY and r.expert != ANY \
                    and not r.source:
                exact.setdefault((r.traffic, r.model, r.layer_min, r.expert), []).append(r)
            else:
                wild.setdefault((r.traffic, r.model), []).append(r)
        named = {(t, m) for t, m in wild if m} | {(t, m) for t, m, _, _ in exact}
        merged = {(t, m): tuple(sorted((*wild.get((t, m), ()), *wild.get((t, ""), ())),
                                       key=_sort_key)) for t, m in named}
        direct = {}
        for (t, m, layer, expert), found in exact.items():
            first = found[0]
            if merged.get((t, m)) or first.action is _COUNT:
                continue
            decisions = tuple(Decision(first, first.action, q, version) for q in first.queues
                              ) or (Decision(first, first.action, None, version),)
            direct[(t, m, layer, expert)] = (counters[first.rule_id], decisions,
                                             first.action is _DROP)
        return cls(version, tuple(rules), {k: tuple(v) for k, v in exact.items()},
                   {k: tuple(v) for k, v in wild.items()}, merged, direct)


class FlowTable:
    """Versioned, atomically replaced rule set with per-rule counters."""

    def __init__(self) -> None:
        self._table = _Table.build(0, [], {})
        self._write = threading.Lock()
        self._ids = itertools.count(1)
        self.counters: dict[int, Counters] = {}
        self.lookups = 0
        self.misses = 0

    @property
    def version(self) -> int:
        return self._table.version

    def rules(self) -> tuple[FlowRule, ...]:
        return self._table.rules

    def _validate(self, rule: FlowRule) -> None:
        if rule.action == Action.FORWARD and not rule.queues:
            raise SteeringError(f"rule {rule.rule_id}: action forward needs at least one queue")
        if rule.action != Action.FORWARD and rule.queues:
            raise SteeringError(f"rule {rule.rule_id}: queues only go with action forward")
        if rule.layer_min != ANY and rule.layer_max != ANY and rule.layer_min > rule.layer_max:
            raise SteeringError(f"rule {rule.rule_id}: layer_min {rule.layer_min} > layer_max "
                                f"{rule.layer_max}")
        if min(rule.layer_min, rule.layer_max, rule.expert) < ANY:
            raise SteeringError(f"rule {rule.rule_id}: layers and expert must be >= 0 or any")

    def update(self, add: Iterable[FlowRule] = (), delete: Iterable[int] = (),
               replace_origin: str | None = None) -> int:
        """Apply one atomic change: drop ``delete`` ids (and every rule of
        ``replace_origin``), add ``add`` (their rule_id 0 gets a fresh id). All or nothing;
        returns the new version."""
        with self._write:
            current = {r.rule_id: r for r in self._table.rules}
            for rid in delete:
                if rid not in current:
                    raise SteeringError(f"no rule {rid} to delete")
            new = [r for rid, r in current.items() if rid not in set(delete)
                   and (replace_origin is None or r.origin != replace_origin)]
            added = [r if r.rule_id else replace(r, rule_id=next(self._ids)) for r in add]
            for r in added:
                self._validate(r)
                if any(x.rule_id == r.rule_id for x in new):
                    raise SteeringError(f"rule {r.rule_id} already exists")
            new += added
            for r in added:
                self.counters.setdefault(r.rule_id, Counters())
            self._table = _Table.build(self._table.version + 1, new, self.counters)
            return self._table.version

    def install(self, version: int, rules: Iterable[FlowRule]) -> None:
        """Replace the whole table with ``rules`` (ids kept) at ``version``: how the NIC takes
        up a snapshot the agent published. Counters of rules still present carry over."""
        rules = list(rules)
        with self._write:
            for r in rules:
                self._validate(r)
            self.counters = {r.rule_id: self.counters.get(r.rule_id, Counters())
                             for r in rules}
            self._table = _Table.build(version, rules, self.counters)

    def lookup(self, traffic: TrafficClass, model: str, layer: int, expert: int,
               source: str = "", nbytes: int = 0,
               load: Callable[[int], int] | None = None) -> Decision:
        """The decision for one message; counts it on the matching rule. ``load(queue)`` gives
        the work in flight per queue, to choose among replicas."""
        table = self._table  # one snapshot for the whole decision
        self.lookups += 1
        key = (traffic, model, layer, expert)
        direct = table.direct.get(key)
        if direct is not None:
            c, decisions, drops = direct
            c.packets += 1
            c.bytes += nbytes
            if drops:
                c.dropped += 1
            if load is None or len(decisions) == 1:
                return decisions[0]
            if len(decisions) == 2:  # the common replica pair, without min()'s calls
                a, b = decisions
                return a if load(a.queue) <= load(b.queue) else b
            return min(decisions, key=lambda d: load(d.queue))
        exact = table.exact.get(key, ())
        wild = table.wild_for.get((traffic, model))
        if wild is None:
            wild = table.wild.get((traffic, ""), ())
        if wild:
            candidates = sorted((*exact, *wild), key=_sort_key)
            check = True
        else:
            candidates, check = exact, False  # exact rules match by construction
        for rule in candidates:
            if not check or rule.matches(traffic, model, layer, expert, source):
                c = self.counters[rule.rule_id]
                c.packets += 1
                c.bytes += nbytes
                action = rule.action
                if action is _FORWARD:
                    queues = rule.queues
                    if load is None or len(queues) == 1:
                        queue = queues[0]
                    elif len(queues) == 2:  # the common replica pair, without min()'s calls
                        a, b = queues
                        queue = a if load(a) <= load(b) else b
                    else:
                        queue = min(queues, key=load)
                    return Decision(rule, action, queue, table.version)
                if action is _COUNT:
                    continue
                if action is _DROP:
                    c.dropped += 1
                return Decision(rule, action, None, table.version)
        self.misses += 1
        return Decision(None, Action.TO_AGENT, None, table.version)


def rule_record(rule: FlowRule) -> dict[str, Any]:
    """``rule`` as plain JSON values."""
    out = asdict(rule)
    out["traffic"], out["action"], out["queues"] = rule.traffic.value, rule.action.value, \
        list(rule.queues)
    return out


def rule_from_record(record: dict[str, Any]) -> FlowRule:
    """The rule of a :func:`rule_record` (SteeringError naming what is malformed)."""
    try:
        return FlowRule(int(record["rule_id"]), TrafficClass(record["traffic"]),
                        Action(record["action"]), str(record["model"]),
                        int(record["layer_min"]), int(record["layer_max"]),
                        int(record["expert"]), str(record["source"]),
                        tuple(int(q) for q in record["queues"]), int(record["priority"]),
                        str(record["origin"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise SteeringError(f"malformed rule record {record!r}: {exc}") from exc
