"""The desired placement of a model across the agents of a cluster: which agents' arenas hold
which experts. Planned by :func:`dpu_agent.planning.placement.plan` with agents as the bins
(capacity: their arena bytes), validated before it is written, re-planned when agents die.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpu_agent.cluster.store import Member
from dpu_agent.planning.placement import PlacementError, plan
from dpu_agent.weights.catalog import ModelCatalog
from dpu_offload.keys import ExpertKey


@dataclass(frozen=True)
class ClusterPlacement:
    """A model's experts assigned to agents.

    Attributes:
        model: the model name every agent loads it under.
        path: checkpoint directory, the same path on every agent (shared storage).
        version: bumped by each write; agents report the version they reconciled to.
        holders: agent id -> sorted ``[layer, expert]`` pairs it holds in its arena.
    """

    model: str
    path: str
    version: int
    holders: dict[str, list[list[int]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "path": self.path, "version": self.version,
                "holders": {a: sorted(map(list, ks)) for a, ks in sorted(self.holders.items())}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ClusterPlacement:
        """Raises ValueError/KeyError/TypeError on a malformed record."""
        holders = {str(a): sorted([int(le[0]), int(le[1])] for le in ks)
                   for a, ks in dict(d["holders"]).items()}
        if any(len(le) != 2 for ks in d["holders"].values() for le in ks):
            raise ValueError("holders entries must be [layer, expert] pairs")
        return cls(str(d["model"]), str(d["path"]), int(d["version"]), holders)

    def keys_of(self, agent_id: str) -> set[ExpertKey]:
        return {ExpertKey(self.model, le[0], le[1]) for le in self.holders.get(agent_id, [])}

    def holders_of(self, key: ExpertKey) -> list[str]:
        return sorted(a for a, ks in self.holders.items() if [key.layer, key.expert] in ks)


def check(p: ClusterPlacement, members: Mapping[str, Member], catalog: ModelCatalog
          ) -> list[str]:
    """Problems that make ``p`` unfit to write: agents that are not live members, arenas
    overfilled, experts the checkpoint lacks, experts nobody holds. Empty when fit."""
    problems = []
    wanted: set[ExpertKey] = set()
    for agent in sorted(p.holders):
        if agent not in members:
            problems.append(f"agent {agent!r} is not a live member of the cluster")
        keys = p.keys_of(agent)
        unknown = sorted(str(k) for k in keys if k not in catalog.experts)
        if unknown:
            problems.append(f"agent {agent!r}: experts not in {p.model}: {', '.join(unknown[:4])}")
        need = sum(catalog.experts[k].blob_bytes for k in keys if k in catalog.experts)
        if agent in members and need > members[agent].arena_bytes:
            problems.append(f"agent {agent!r}: {need} bytes of experts overfill its arena of "
                            f"{members[agent].arena_bytes} bytes")
        wanted |= keys
    missing = sorted(str(k) for k in set(catalog.experts) - wanted)
    if missing:
        problems.append(f"{len(missing)} experts held by no agent, e.g. {missing[0]}")
    return problems


def plan_cluster(catalog: ModelCatalog, members: Mapping[str, Member], *, version: int,
                 current: ClusterPlacement | None = None, replicas: int = 0,
                 load: np.ndarray | None = None) -> ClusterPlacement:
    """Balance ``catalog``'s experts over the live ``members``' arenas.

    With ``current``, copies stay where they are when balance allows (experts on agents that
    are gone count as not held), so a re-plan after a death moves only the lost experts plus
    what balance needs.

    Args:
        load: ``float[layers, experts]`` routed tokens (uniform when None).
        replicas: extra copies per layer.

    Raises:
        PlacementError: the members cannot hold the model.
    """
    agents = sorted(members)
    if not agents:
        raise PlacementError("no live agents to place on")
    layers = 1 + max(k.layer for k in catalog.experts)
    experts = 1 + max(k.expert for k in catalog.experts)
    index = {a: i for i, a in enumerate(agents)}
    assignment = None
    if current is not None:
        assignment = [[[] for _ in range(experts)] for _ in range(layers)]
        for agent, pairs in current.holders.items():
            if agent in index:
                for layer, expert in pairs:
                    if layer < layers and expert < experts:
                        assignment[layer][expert].append(index[agent])
    weights = np.ones((layers, experts)) if load is None else np.asarray(load, dtype=np.float64)
    placed = plan(weights, [members[a].arena_bytes for a in agents], current=assignment,
                  replicas=replicas, expert_bytes=catalog.expert_bytes, capacity="bytes")
    holders: dict[str, list[list[int]]] = {a: [] for a in agents}
    for layer, row in enumerate(placed.assignment):
        for expert, gpus in enumerate(row):
            if ExpertKey(catalog.name, layer, expert) in catalog.experts:
                for g in gpus:
                    holders[agents[g]].append([layer, expert])
    return ClusterPlacement(catalog.name, str(catalog.path), version,
                            {a: ks for a, ks in holders.items() if ks})


__all__ = ["ClusterPlacement", "PlacementError", "check", "plan_cluster"]
