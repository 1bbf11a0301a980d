"""Writing desired placements: validated against the live members and the checkpoint before
anything reaches etcd, then written by compare-and-swap so that two planners never interleave
(the loser re-reads and tries again, or gives up with the reason)."""

from __future__ import annotations

import numpy as np

from dpu_agent.cluster.placement import ClusterPlacement, PlacementError, check, plan_cluster
from dpu_agent.cluster.store import ClusterStore
from dpu_agent.weights.catalog import ModelCatalog


def publish(store: ClusterStore, placement: ClusterPlacement, catalog: ModelCatalog,
            attempts: int = 3) -> ClusterPlacement:
    """Write ``placement`` (its version replaced by the next one) if it passes :func:`check`.

    Raises:
        PlacementError: the placement is unfit (each problem named) or the key kept changing.
    """
    key = store.key("placement", placement.model)
    for _ in range(attempts):
        problems = check(placement, store.members(), catalog)
        if problems:
            raise PlacementError("placement refused, nothing written: " + "; ".join(problems))
        current = store.get_json(key)
        version, revision = (0, 0) if current is None else (int(current[0]["version"]),
                                                            current[1])
        new = ClusterPlacement(placement.model, placement.path, version + 1, placement.holders)
        if store.compare_and_put(key, new.to_json(), revision):
            return new
    raise PlacementError(f"placement of {placement.model} changed under us {attempts} times")


def rebalance(store: ClusterStore, catalog: ModelCatalog, replicas: int = 0,
              load: np.ndarray | None = None) -> ClusterPlacement:
    """Plan ``catalog`` over the live members (keeping copies where balance allows) and
    publish it."""
    members = store.members()
    got = store.get_json(store.key("placement", catalog.name))
    current = ClusterPlacement.from_json(got[0]) if got is not None else None
    planned = plan_cluster(catalog, members, version=0, current=current, replicas=replicas,
                           load=load)
    return publish(store, planned, catalog)
