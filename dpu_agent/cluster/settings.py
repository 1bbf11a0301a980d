"""The ``[cluster]`` section as the cluster code takes it, and the etcd endpoint form: kept
apart from ``dpu_agent.config`` (which builds it) and the cluster modules (which use it), so
neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterSettings:
    """The ``[cluster]`` config section (durations in seconds; defaults and meanings in
    dpu_agent/config.py and deploy/agent.toml)."""

    etcd_endpoints: tuple[str, ...]
    agent_id: str
    prefix: str
    lease_seconds: int
    join_timeout_seconds: int
    resync_seconds: float
    peer_address: str
    peer_fetch: str
    etcd_ca: str = ""
    """CA bundle verifying etcd's certificate; set: https to etcd."""
    etcd_cert: str = ""
    """Client certificate and key for etcd's client-cert-auth."""
    etcd_key: str = ""


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); ValueError names what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint {text!r} is not host:port")
    return host, int(port)
