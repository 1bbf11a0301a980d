"""Prometheus metrics of the agent, read from the core at scrape time (no counters to keep in
step: the collector reports what the cache, tracker and sessions hold). Names follow Prometheus
conventions: ``dpu_agent_`` prefix, base units, ``_total`` for counters."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dpu_agent.cluster.agent import ClusterAgent
from dpu_agent.orchestrator import Orchestrator


class AgentCollector(Collector):
    """Cache, arena, transfer and session figures of one :class:`Orchestrator`."""

    def __init__(self, core: Orchestrator) -> None:
        self.core = core

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        core = self.core
        stats = core.cache.stats
        yield CounterMetricFamily("dpu_agent_cache_hits", "Acquires served from the arena.",
                                  value=stats.hits)
        yield CounterMetricFamily("dpu_agent_cache_misses",
                                  "Acquires that filled the arena from checkpoint files.",
                                  value=stats.misses)
        yield CounterMetricFamily("dpu_agent_cache_evictions",
                                  "Experts evicted from the arena.", value=stats.evictions)
        yield CounterMetricFamily("dpu_agent_cache_fill_seconds",
                                  "Seconds spent filling the arena from checkpoint files.",
                                  value=stats.fill_seconds)
        fills = CounterMetricFamily("dpu_agent_cache_fill_bytes",
                                    "Bytes filled into the arena, by source (storage: checkpoint "
                                    "files; peer: another agent's arena).", labels=["source"])
        fills.add_metric(["storage"], stats.storage_bytes)
        fills.add_metric(["peer"], stats.peer_bytes)
        yield fills
        yield CounterMetricFamily("dpu_agent_cache_fill_source_failures",
                                  "Fills whose peer source failed (fell back to storage).",
                                  value=stats.source_failures)
        yield GaugeMetricFamily("dpu_agent_cache_resident_experts",
                                "Experts resident in the arena.", value=core.cache.resident)
        yield GaugeMetricFamily("dpu_agent_arena_bytes", "Arena size.", value=core.arena.size)
        yield GaugeMetricFamily("dpu_agent_arena_used_bytes", "Arena bytes allocated.",
                                value=core.arena.used_bytes)
        yield GaugeMetricFamily("dpu_agent_arena_fragmentation_ratio",
                                "1 - largest free block / free bytes.",
                                value=core.arena.fragmentation)
        yield GaugeMetricFamily("dpu_agent_transfers_in_flight", "Deliveries in flight.",
                                value=core.plane.deliveries.tracker.in_flight)
        delivered = CounterMetricFamily("dpu_agent_delivered_bytes",
                                        "Verified expert bytes delivered to devices, by source "
                                        "(arena, or peer: another device's slot).",
                                        labels=["source"])
        for source in ("arena", "peer"):
            delivered.add_metric([source], core.plane.deliveries.delivered_bytes[source])
        yield delivered
        yield CounterMetricFamily("dpu_agent_checksum_failures",
                                  "Deliveries that failed chunk verification.",
                                  value=core.plane.deliveries.verify_failures)
        loop, served = core.plane.loop.stats, core.plane.requests
        yield CounterMetricFamily("dpu_agent_dataplane_requests",
                                  "Request-ring entries the data-plane loop took (an ACQUIRE "
                                  "that waited for a slot counted once).",
                                  value=served.taken)
        yield CounterMetricFamily("dpu_agent_dataplane_refused_requests",
                                  "Request-ring entries answered with an error status.",
                                  value=served.refused)
        yield CounterMetricFamily("dpu_agent_dataplane_parked_requests",
                                  "ACQUIRE entries that found every fitting slot held or "
                                  "landing and waited in the loop for one.",
                                  value=served.parked_total)
        yield CounterMetricFamily("dpu_agent_dataplane_timed_requests",
                                  "Request-ring entries with a plausible posting time.",
                                  value=served.timed)
        yield CounterMetricFamily("dpu_agent_dataplane_request_wait_seconds",
                                  "Posting to being taken by the loop, summed over timed "
                                  "requests (the client's clock: a diagnostic).",
                                  value=served.waited_ns / 1e9)
        yield CounterMetricFamily("dpu_agent_dataplane_request_service_seconds",
                                  "Taken by the loop to answered (or handed to a fill thread, "
                                  "or parked), summed over timed requests (a batch's time "
                                  "counted once per entry).",
                                  value=served.served_ns / 1e9)
        yield CounterMetricFamily("dpu_agent_dataplane_completions",
                                  "Completion entries the data-plane loop folded.",
                                  value=loop.completions)
        yield CounterMetricFamily("dpu_agent_dataplane_cpu_seconds",
                                  "CPU time of the data-plane loop's thread.",
                                  value=loop.cpu_seconds)
        yield CounterMetricFamily("dpu_agent_engine_restarts",
                                  "Times the DMA-engine process died and was started again.",
                                  value=core.plane.engine.restarts)
        yield GaugeMetricFamily("dpu_agent_sessions", "Open sessions.",
                                value=len(core.sessions))
        yield CounterMetricFamily("dpu_agent_session_events_dropped",
                                  "Session events dropped because their client did not read "
                                  "its Events stream (oldest first).",
                                  value=core.events_dropped())
        yield GaugeMetricFamily("dpu_agent_models_loaded", "Models in the catalog.",
                                value=len(core.models))
        degraded = GaugeMetricFamily("dpu_agent_model_degraded",
                                     "1 for a model some of whose experts cannot be read (a "
                                     "shard changed under the agent) until it is loaded again.",
                                     labels=["model"])
        visits = CounterMetricFamily("dpu_agent_routing_visits",
                                     "MoE layer visits folded into the routing statistics "
                                     "(ReportRouting, and traces learned at load), by model.",
                                     labels=["model"])
        for name in list(core.models):
            degraded.add_metric([name], float(name in core.cache.degraded))
            visits.add_metric([name], float(core.routing.visits(name)))
        yield degraded
        yield visits
        states = list(core.placements.states.values())
        copies = GaugeMetricFamily("dpu_agent_placement_copies",
                                   "New expert copies of the placements in force, by state.",
                                   labels=["state"])
        copies.add_metric(["done"], sum(s.done for s in states))
        copies.add_metric(["failed"], sum(s.failed for s in states))
        copies.add_metric(["pending"], sum(s.total - s.done - s.failed for s in states))
        copies.add_metric(["dropped"], sum(s.dropped for s in states))
        yield copies
        flows = core.flows
        counted = core.steering_counters()
        yield CounterMetricFamily("dpu_agent_steering_lookups", "Flow-table lookups (the NIC's).",
                                  value=counted.lookups)
        yield CounterMetricFamily("dpu_agent_steering_misses",
                                  "Lookups no rule matched.", value=counted.misses)
        packets = CounterMetricFamily("dpu_agent_flow_packets",
                                      "Messages matched by flow rules, by rule action.",
                                      labels=["action"])
        nbytes = CounterMetricFamily("dpu_agent_flow_bytes",
                                     "Bytes matched by flow rules, by rule action.",
                                     labels=["action"])
        by_action: dict[str, list[int]] = {}
        for rule in flows.rules():
            n, b, _ = counted.rules.get(rule.rule_id, (0, 0, 0))
            acc = by_action.setdefault(rule.action.value, [0, 0])
            acc[0] += n
            acc[1] += b
        for action, (n, b) in sorted(by_action.items()):
            packets.add_metric([action], n)
            nbytes.add_metric([action], b)
        yield packets
        yield nbytes
        yield GaugeMetricFamily("dpu_agent_flow_rules", "Rules in the flow table.",
                                value=len(flows.rules()))
        if core.activations is not None:
            messages = CounterMetricFamily("dpu_agent_activation_messages",
                                           "Activation frames the NIC received, by kind.",
                                           labels=["kind"])
            nbytes = CounterMetricFamily("dpu_agent_activation_bytes",
                                         "Activation payload bytes the NIC received, by kind.",
                                         labels=["kind"])
            for kind in sorted(counted.messages):
                messages.add_metric([kind], counted.messages[kind])
                nbytes.add_metric([kind], counted.bytes.get(kind, 0))
            yield messages
            yield nbytes
            refused = CounterMetricFamily("dpu_agent_activation_refused",
                                          "Activation frames refused, by reason (NO_CREDIT "
                                          "counts credit stalls).", labels=["reason"])
            for reason in sorted(counted.refused):
                refused.add_metric([reason], counted.refused[reason])
            yield refused
            yield CounterMetricFamily("dpu_agent_activation_forwarded",
                                      "Requests forwarded to another agent (cluster mode).",
                                      value=counted.forwarded)
            yield CounterMetricFamily("dpu_agent_activation_retransmits",
                                      "Messages written again into a worker's rx ring after "
                                      "its packets failed their check.",
                                      value=counted.retransmits)
            yield GaugeMetricFamily("dpu_agent_activation_outstanding",
                                    "Requests routed by the NIC and not yet answered.",
                                    value=counted.outstanding)
        if core.cluster is not None:
            yield from _cluster_metrics(core.cluster)
        yield GaugeMetricFamily("dpu_agent_scheduler_waiting_jobs",
                                "Deliveries waiting for their device link.",
                                value=core.scheduler.waiting())


def _cluster_metrics(c: ClusterAgent) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    yield GaugeMetricFamily("dpu_agent_cluster_members", "Live agents in the cluster.",
                            value=len(c.members))
    yield GaugeMetricFamily("dpu_agent_cluster_leader", "1 while this agent is the planner.",
                            value=int(c.leader))
    yield GaugeMetricFamily("dpu_agent_cluster_held_experts",
                            "Experts this agent holds for the cluster placement.",
                            value=sum(len(v) for v in c.held.values()))
    yield CounterMetricFamily("dpu_agent_cluster_reconciles", "Reconciliation passes.",
                              value=c.reconciles)
    yield CounterMetricFamily("dpu_agent_cluster_replans",
                              "Placements re-planned by this agent after members died.",
                              value=c.replans)
    yield CounterMetricFamily("dpu_agent_cluster_fetch_failures",
                              "Experts this agent failed to fetch for the placement.",
                              value=c.fetch_failures)
    yield CounterMetricFamily("dpu_agent_cluster_foreign_keys",
                              "Keys under the prefix ignored as stale or foreign.",
                              value=c.store.foreign_keys)
    yield CounterMetricFamily("dpu_agent_cluster_peer_served_bytes",
                              "Expert bytes streamed to other agents.",
                              value=c.server.served_bytes)
    ops = CounterMetricFamily("dpu_agent_cluster_etcd_operations", "etcd requests, by kind.",
                              labels=["op"])
    for op, n in sorted(c.store.ops.items()):
        ops.add_metric([op], n)
    yield ops
