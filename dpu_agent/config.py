"""Agent configuration: a TOML file, every key overridable by ``DPU_AGENT_<SECTION>_<KEY>``
environment variables, validated as a whole. ``deploy/agent.toml`` documents every key.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dpu_agent.cluster.settings import ClusterSettings, parse_endpoint

if sys.version_info >= (3, 11):
    import tomllib
else:  # Ubuntu 22.04 on BlueField ships Python 3.10
    import tomli as tomllib

DEFAULT_PATH = Path("/etc/dpu-agent/agent.toml")
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConfigError(ValueError):
    """The configuration has problems; ``problems`` lists each as 'key: what is wrong'."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))
        self.problems = problems

def _size(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str):
        m = _SIZE_RE.match(v)
        if m:
            return int(m[1]) * _UNITS[(m[2] or "B").lower()]
    raise ValueError(f"expected a size (bytes, or e.g. '4GiB'), got {v!r}")


def _int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError(f"expected an integer, got {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    raise ValueError(f"expected an integer, got {v!r}")


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    return v


MAX_ADMIN_NAMES = 64
MAX_POLL_SPIN_US = 100_000
ENGINE_POLL = ("auto", "always", "doze")
ENGINE_POLL_MIN_CPUS = 8
"""``transfer.engine_poll = "auto"`` polls on machines with at least this many CPUs."""


def _names(v: Any) -> tuple[str, ...]:
    if (not isinstance(v, list) or len(v) > MAX_ADMIN_NAMES
            or not all(isinstance(x, str) and 0 < len(x) <= 256 for x in v)):
        raise ValueError(f"expected a list of at most {MAX_ADMIN_NAMES} names of 1-256 "
                         f"characters, got {v!r}"[:300])
    return tuple(v)


def _key(section: str, key: str, parse: Callable[[Any], Any], default: Any, *,
         unit: str = "", live: bool = False) -> Any:
    """A setting, declared once: ``key`` of the TOML file's ``[section]`` (and the variable
    ``DPU_AGENT_<SECTION>_<KEY>``), read by ``parse``; ``unit`` of a number (bytes, s, us);
    ``live``: SIGHUP applies it to a running agent (the others need a restart)."""
    return field(default=default, metadata={"key": (section, key), "parse": parse,
                                            "unit": unit, "live": live})


@dataclass(frozen=True)
class AgentConfig:
    """Validated settings. Sizes are bytes, durations seconds."""

    listen_address: str = _key("server", "listen_address", _str, "127.0.0.1:50051")
    max_message_bytes: int = _key("server", "max_message_bytes", _size, 16 * 2**20, unit="bytes")
    drain_grace_seconds: int = _key("server", "drain_grace_seconds", _int, 10, unit="s")
    tls_cert: str = _key("server", "tls_cert", _str, "")
    tls_key: str = _key("server", "tls_key", _str, "")
    tls_client_ca: str = _key("server", "tls_client_ca", _str, "")
    admin_names: tuple[str, ...] = _key("server", "admin_names", _names, ())
    """Client-certificate common names (mutual TLS) that see every session in GetStatus."""
    arena_bytes: int = _key("arena", "bytes", _size, 1 * 2**30, unit="bytes")
    cache_policy: str = _key("cache", "policy", _str, "reuse")
    prefetch_traces_dir: str = _key("prefetch", "traces_dir", _str, "")
    """A folder of recorded routing traces, ``<model name>.jsonl`` (docs/LAYOUT.md): a model
    loaded under that name starts its routing statistics (the next-layer predictor's, the cache
    policy's and the planner's) from the trace."""
    chunk_bytes: int = _key("transfer", "chunk_bytes", _size, 1 * 2**20, unit="bytes")
    transfer_timeout_seconds: int = _key("transfer", "timeout_seconds", _int, 30,
                                        unit="s", live=True)
    poll_spin_us: int = _key("transfer", "poll_spin_us", _int, 200, unit="us")
    """How long the data-plane loop polls after work before it sleeps on its doorbell,
    microseconds (longer: lower wake-up latency, more CPU)."""
    engine_poll: str = _key("transfer", "engine_poll", _str, "auto")
    """How the DMA-engine process waits for work (``ENGINE_POLL``): ``always`` polls its rings
    without sleeping while it serves a device (a core of its own, as the DMA engine it stands
    for is hardware), ``doze`` sleeps on its doorbell 2 ms after work, ``auto`` polls where the
    machine has ``ENGINE_POLL_MIN_CPUS`` CPUs or more."""
    link_concurrency: int = _key("transfer", "link_concurrency", _int, 4, live=True)
    rebalance_interval_seconds: int = _key("placement", "rebalance_interval_seconds", _int, 0,
                                          unit="s", live=True)
    default_lease_seconds: int = _key("sessions", "default_lease_seconds", _int, 10,
                                     unit="s", live=True)
    max_session_rpcs: int = _key("sessions", "max_concurrent_rpcs", _int, 64, live=True)
    max_lease_seconds: int = _key("sessions", "max_lease_seconds", _int, 300, unit="s", live=True)
    max_sessions: int = _key("sessions", "max_sessions", _int, 256)
    max_devices_per_session: int = _key("sessions", "max_devices", _int, 16)
    metrics_address: str = _key("metrics", "listen_address", _str, "")
    log_format: str = _key("logging", "format", _str, "auto")
    state_dir: str = _key("state", "dir", _str, "")
    activations_address: str = _key("activations", "listen_address", _str, "")
    activation_credits: int = _key("activations", "credits_per_sender", _int, 64)
    activation_worker_timeout: int = _key("activations", "worker_timeout_seconds", _int, 5,
                                         unit="s")
    curve_server_cert: str = _key("activations", "curve_server_cert", _str, "")
    curve_clients_dir: str = _key("activations", "curve_clients_dir", _str, "")
    cluster_etcd_endpoints: str = _key("cluster", "etcd_endpoints", _str, "")
    cluster_agent_id: str = _key("cluster", "agent_id", _str, "")
    cluster_prefix: str = _key("cluster", "prefix", _str, "/dpu-offload")
    cluster_lease_seconds: int = _key("cluster", "lease_seconds", _int, 5, unit="s")
    cluster_join_timeout_seconds: int = _key("cluster", "join_timeout_seconds", _int, 30, unit="s")
    cluster_resync_seconds: int = _key("cluster", "resync_seconds", _int, 2, unit="s")
    cluster_peer_address: str = _key("cluster", "peer_address", _str, "127.0.0.1:0")
    cluster_peer_fetch: str = _key("cluster", "peer_fetch", _str, "auto")
    cluster_etcd_ca: str = _key("cluster", "etcd_ca", _str, "")
    cluster_etcd_cert: str = _key("cluster", "etcd_cert", _str, "")
    cluster_etcd_key: str = _key("cluster", "etcd_key", _str, "")

    @property
    def cluster(self) -> ClusterSettings | None:
        """The [cluster] section, or None in single-agent mode (no etcd endpoints)."""
        if not self.cluster_etcd_endpoints:
            return None
        return ClusterSettings(
            tuple(e.strip() for e in self.cluster_etcd_endpoints.split(",")),
            self.cluster_agent_id or socket.gethostname(), self.cluster_prefix,
            self.cluster_lease_seconds, self.cluster_join_timeout_seconds,
            float(self.cluster_resync_seconds), self.cluster_peer_address,
            self.cluster_peer_fetch, self.cluster_etcd_ca, self.cluster_etcd_cert,
            self.cluster_etcd_key)

    @property
    def engine_polls(self) -> bool:
        """Whether the DMA-engine process polls without sleeping (``transfer.engine_poll``)."""
        if self.engine_poll == "auto":
            return (os.cpu_count() or 1) >= ENGINE_POLL_MIN_CPUS
        return self.engine_poll == "always"


KEYS: dict[tuple[str, str], tuple[str, Any]] = {
    f.metadata["key"]: (f.name, f.metadata["parse"]) for f in fields(AgentConfig)}
"""(section, key) -> (field, parser), from the declarations."""
LIVE_SETTINGS = tuple(f.name for f in fields(AgentConfig) if f.metadata["live"])
"""Settings SIGHUP applies to a running agent; the others need a restart."""
UNITS = {f.metadata["key"]: f.metadata["unit"] for f in fields(AgentConfig)}


def _check(cfg: AgentConfig) -> list[str]:
    from dpu_agent.weights.policies import POLICIES

    problems = []
    for name, addr in (("server.listen_address", cfg.listen_address),
                       ("metrics.listen_address", cfg.metrics_address),
                       ("activations.listen_address", cfg.activations_address),
                       ("cluster.peer_address", cfg.cluster_peer_address)):
        if addr and not re.match(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]+):\d{1,5}$", addr):
            problems.append(f"{name}: {addr!r} is not host:port")
        elif addr and not 0 <= int(addr.rsplit(":", 1)[1]) <= 65535:
            problems.append(f"{name}: port out of range in {addr!r}")
    if not cfg.listen_address:
        problems.append("server.listen_address: must be set")
    if cfg.chunk_bytes <= 0 or cfg.chunk_bytes % 16 or cfg.chunk_bytes > 2**31:
        problems.append(f"transfer.chunk_bytes: {cfg.chunk_bytes} must be a positive multiple "
                        "of 16 below 2 GiB")
    if cfg.log_format not in ("auto", "json", "text"):
        problems.append(f"logging.format: {cfg.log_format!r} is not auto, json or text")
    if bool(cfg.curve_server_cert) != bool(cfg.curve_clients_dir):
        problems.append("activations.curve_server_cert / curve_clients_dir: set both or neither")
    if cfg.curve_server_cert and not os.access(cfg.curve_server_cert, os.R_OK):
        problems.append(f"activations.curve_server_cert: {cfg.curve_server_cert} is not a "
                        "readable file")
    if cfg.curve_clients_dir and not os.path.isdir(cfg.curve_clients_dir):
        problems.append(f"activations.curve_clients_dir: {cfg.curve_clients_dir} is not a "
                        "directory")
    if cfg.activation_worker_timeout <= 0:
        problems.append("activations.worker_timeout_seconds: must be positive")
    if cfg.activation_credits <= 0:
        problems.append("activations.credits_per_sender: must be positive")
    if cfg.drain_grace_seconds < 0:
        problems.append("server.drain_grace_seconds: must be >= 0")
    if cfg.link_concurrency <= 0:
        problems.append("transfer.link_concurrency: must be positive")
    if cfg.rebalance_interval_seconds < 0:
        problems.append("placement.rebalance_interval_seconds: must be >= 0 (0 = off)")
    if not 0 <= cfg.poll_spin_us <= MAX_POLL_SPIN_US:
        problems.append(f"transfer.poll_spin_us: {cfg.poll_spin_us} is not between 0 and "
                        f"{MAX_POLL_SPIN_US}")
    if cfg.engine_poll not in ENGINE_POLL:
        problems.append(f"transfer.engine_poll: {cfg.engine_poll!r} is not one of "
                        f"{', '.join(ENGINE_POLL)}")
    if cfg.transfer_timeout_seconds <= 0:
        problems.append("transfer.timeout_seconds: must be positive")
    if cfg.arena_bytes < max(cfg.chunk_bytes, 2**20):
        problems.append(f"arena.bytes: {cfg.arena_bytes} is smaller than 1 MiB")
    if cfg.prefetch_traces_dir and not os.path.isdir(cfg.prefetch_traces_dir):
        problems.append(f"prefetch.traces_dir: {cfg.prefetch_traces_dir!r} is not a directory")
    if cfg.cache_policy not in POLICIES:
        problems.append(f"cache.policy: {cfg.cache_policy!r} is not one of "
                        f"{sorted(POLICIES)}")
    if not 1 <= cfg.default_lease_seconds <= cfg.max_lease_seconds:
        problems.append("sessions.default_lease_seconds: must be between 1 and "
                        f"max_lease_seconds ({cfg.max_lease_seconds})")
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        problems.append("server.tls_cert / server.tls_key: set both or neither")
    if cfg.tls_client_ca and not cfg.tls_cert:
        problems.append("server.tls_client_ca: needs server.tls_cert and server.tls_key")
    if cfg.admin_names and not cfg.tls_client_ca:
        problems.append("server.admin_names: administrators are client certificates; needs "
                        "server.tls_client_ca")
    for key, path in (("server.tls_cert", cfg.tls_cert), ("server.tls_key", cfg.tls_key),
                      ("server.tls_client_ca", cfg.tls_client_ca)):
        if path and not os.access(path, os.R_OK):
            problems.append(f"{key}: {path} is not a readable file")
    for key, value in (("max_concurrent_rpcs", cfg.max_session_rpcs),
                       ("max_sessions", cfg.max_sessions),
                       ("max_devices", cfg.max_devices_per_session)):
        if value <= 0:
            problems.append(f"sessions.{key}: must be positive")
    problems += _check_cluster(cfg)
    if cfg.max_message_bytes < 2**16:
        problems.append("server.max_message_bytes: must be at least 64 KiB")
    return problems


def _check_cluster(cfg: AgentConfig) -> list[str]:
    problems = []
    for e in filter(None, cfg.cluster_etcd_endpoints.split(",")):
        try:
            parse_endpoint(e)
        except ValueError as exc:
            problems.append(f"cluster.etcd_endpoints: {exc}")
    if not re.match(r"^(/[A-Za-z0-9._\-]+)+$", cfg.cluster_prefix):
        problems.append(f"cluster.prefix: {cfg.cluster_prefix!r} must look like /name[/name] "
                        "(no trailing slash)")
    if cfg.cluster_agent_id and not re.match(r"^[A-Za-z0-9._\-]+$", cfg.cluster_agent_id):
        problems.append(f"cluster.agent_id: {cfg.cluster_agent_id!r} may hold only letters, "
                        "digits, '.', '_' and '-'")
    if cfg.cluster_peer_fetch not in ("auto", "always", "never"):
        problems.append(f"cluster.peer_fetch: {cfg.cluster_peer_fetch!r} is not auto, always or "
                        "never")
    for key in ("lease_seconds", "join_timeout_seconds", "resync_seconds"):
        if getattr(cfg, f"cluster_{key}") <= 0:
            problems.append(f"cluster.{key}: must be positive")
    if bool(cfg.cluster_etcd_cert) != bool(cfg.cluster_etcd_key):
        problems.append("cluster.etcd_cert / cluster.etcd_key: set both or neither")
    if cfg.cluster_etcd_cert and not cfg.cluster_etcd_ca:
        problems.append("cluster.etcd_cert: a client certificate needs cluster.etcd_ca (TLS)")
    for key in ("etcd_ca", "etcd_cert", "etcd_key"):
        path = getattr(cfg, f"cluster_{key}")
        if path and not os.access(path, os.R_OK):
            problems.append(f"cluster.{key}: {path} is not a readable file")
    return problems


def from_mapping(data: Mapping[str, Any], env: Mapping[str, str] | None = None) -> AgentConfig:
    """Validate parsed TOML plus environment overrides; ConfigError lists every problem."""
    problems: list[str] = []
    values: dict[str, Any] = {}
    for section, table in data.items():
        if not isinstance(table, Mapping):
            problems.append(f"{section}: expected a [{section}] table")
            continue
        for key, raw in table.items():
            spec = KEYS.get((section, key))
            if spec is None:
                problems.append(f"{section}.{key}: unknown key")
                continue
            try:
                values[spec[0]] = spec[1](raw)
            except ValueError as exc:
                problems.append(f"{section}.{key}: {exc}")
    for (section, key), (name, parse) in KEYS.items():
        var = f"DPU_AGENT_{section}_{key}".upper()
        if env is not None and var in env:
            try:
                values[name] = parse(env[var])
            except ValueError as exc:
                problems.append(f"{var}: {exc}")
    if env is not None:
        known = {f"DPU_AGENT_{s}_{k}".upper() for s, k in KEYS}
        problems += [f"{v}: unknown variable" for v in env
                     if v.startswith("DPU_AGENT_") and v not in known]
    cfg = AgentConfig(**values)
    flagged = {p.split(":", 1)[0] for p in problems}
    problems += [p for p in _check(cfg) if p.split(":", 1)[0] not in flagged]
    if problems:
        raise ConfigError(problems)
    return cfg


def load(path: str | Path | None, env: Mapping[str, str] | None = None) -> AgentConfig:
    """Read and validate a config file (``None``: defaults plus environment)."""
    env = os.environ if env is None else env
    if path is None:
        return from_mapping({}, env)
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError([f"{p}: no such file"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{p}: cannot read ({exc})"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{p}: not valid TOML ({exc})"]) from None
    return from_mapping(data, env)
