"""The agent's loaded models: each checkpoint's catalog under its name and index, its routing
statistics started from a recorded trace where the config names one, and a degraded model (a
shard changed under the agent) read again on the next LoadModel.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from dpu_agent.dataplane.requests import unknown_model
from dpu_agent.errors import AgentError, ErrorKind, invalid, not_found, precondition
from dpu_agent.routing.stats import RoutingStats
from dpu_agent.routing.traces import read_trace
from dpu_agent.weights.cache import WeightCache
from dpu_agent.weights.catalog import ExpertEntry, ModelCatalog, build_catalog, path_problem
from dpu_agent.weights.ingest import attach_manifest
from dpu_agent.weights.layouts import LayoutError
from dpu_agent.weights.safetensors_file import CheckpointError
from dpu_offload.keys import ExpertKey, model_name_problem

log = logging.getLogger("dpu_agent")

MAX_TRACE_BYTES = 256 * 2**20
"""A recorded routing trace larger than this is not read (``prefetch.traces_dir``)."""


class Models:
    """The loaded models.

    Args:
        cache: the arena's cache (its size bounds an expert; a reload drops a model's copies).
        routing: the routing statistics each model's layers are declared in.
        traces_dir: a folder of recorded traces (``<model name>.jsonl``), or "".

    Attributes:
        catalogs: name -> catalog.
        names: model index (request entries name models by it) -> name, in load order.
    """

    def __init__(self, cache: WeightCache, routing: RoutingStats, traces_dir: str) -> None:
        self.cache = cache
        self.routing = routing
        self.traces_dir = traces_dir
        self.catalogs: dict[str, ModelCatalog] = {}
        self.names: list[str] = []
        self._lock = threading.Lock()

    def load(self, path: str, name: str = "") -> tuple[ModelCatalog, bool]:
        """The catalog of the checkpoint at ``path`` under ``name`` (default: the folder's
        name); a model already loaded from that path is returned as it is (read again if it
        is degraded). Returns (catalog, whether it is new)."""
        problem = path_problem(path)
        if problem:
            raise invalid(f"LoadModel: {problem}")
        model_name = name or Path(path).name
        problem = model_name_problem(model_name)
        if problem:
            raise invalid(f"LoadModel: {problem}")
        with self._lock:
            existing = self.catalogs.get(model_name)
        if existing is not None:
            if existing.path != Path(path):
                raise AgentError(ErrorKind.ALREADY_EXISTS,
                                 f"model {model_name!r} is already loaded from {existing.path}")
            if model_name not in self.cache.degraded:
                return existing, False
            return self._reload(existing), False
        try:
            catalog = attach_manifest(build_catalog(path, model_name))
        except (CheckpointError, LayoutError) as exc:
            kind = ErrorKind.NOT_FOUND if not Path(path).is_dir() else ErrorKind.INVALID_ARGUMENT
            raise AgentError(kind, f"LoadModel: {exc}") from exc
        largest, arena = catalog.expert_bytes, self.cache.arena.size
        if largest > arena:
            raise precondition(f"model {model_name!r}: an expert of {largest} bytes exceeds "
                               f"the arena (config arena.bytes = {arena}); the cache "
                               "budget must hold at least one expert")
        with self._lock:
            if model_name not in self.catalogs:
                self.catalogs[model_name] = catalog
                self.names.append(model_name)
        self.routing.declare(model_name, catalog.layout.moe_layers,
                             catalog.layout.experts_per_layer)
        self._learn_routing(catalog)
        return self.catalogs[model_name], True

    def _learn_routing(self, catalog: ModelCatalog) -> None:
        """Fold the model's recorded trace into its routing statistics (what the next-layer
        predictor, the cache policy and the planner start from), if ``traces_dir`` holds
        ``<model name>.jsonl``; a trace that cannot be used is logged and skipped (the model
        loads all the same)."""
        path = Path(self.traces_dir) / f"{catalog.name}.jsonl" if self.traces_dir else None
        if path is None or not path.is_file():
            return
        try:
            if path.stat().st_size > MAX_TRACE_BYTES:
                raise ValueError(f"larger than {MAX_TRACE_BYTES} bytes")
            steps = read_trace(path)
        except (OSError, ValueError) as exc:
            log.warning("routing trace %s not used for %r: %s", path, catalog.name, exc)
            return
        used = self.routing.learn(catalog.name, steps, catalog.layout.experts_per_layer)
        log.info("routing statistics of %r learned %d of %d steps of %s", catalog.name,
                 used, len(steps), path)

    def _reload(self, old: ModelCatalog) -> ModelCatalog:
        """A degraded model (a shard changed under the agent) loaded again: a fresh catalog of
        the same shape replaces the old one and its arena copies are dropped, so every expert
        is read from the files as they are now."""
        try:
            catalog = attach_manifest(build_catalog(old.path, old.name))
        except (CheckpointError, LayoutError) as exc:
            raise precondition(f"LoadModel: {old.name!r} is degraded and its checkpoint cannot "
                               f"be read again: {exc}") from exc
        shape = {k: e.blob_bytes for k, e in catalog.experts.items()}
        if shape != {k: e.blob_bytes for k, e in old.experts.items()}:
            raise precondition(f"LoadModel: the checkpoint of {old.name!r} now holds experts of "
                               "other sizes; load it under a new name")
        with self._lock:
            self.catalogs[old.name] = catalog
        for key in catalog.experts:
            self.cache.invalidate(key)
        self.cache.degraded.pop(old.name, None)
        log.info("model %r loaded again from %s after a shard changed", old.name, old.path)
        return catalog

    def index(self, name: str) -> int:
        """The index request-ring entries name a loaded model by."""
        return self.names.index(name)

    def name(self, index: int) -> str:
        """The model a request entry's index names; NOT_FOUND if none."""
        names = self.names
        if index >= len(names):
            raise unknown_model(index, len(names))
        return names[index]

    def expert(self, key: ExpertKey) -> ExpertEntry:
        """The catalog entry of ``key``; NOT_FOUND naming what the model has."""
        model = self.catalogs.get(key.model)
        if model is None:
            raise not_found(f"model {key.model!r} is not loaded")
        entry = model.experts.get(key)
        if entry is None:
            raise not_found(f"expert {key} is not in model {key.model!r} "
                            f"(MoE layers {list(model.layout.moe_layers)[:4]}..., "
                            f"{model.layout.experts_per_layer} experts per layer)")
        return entry
