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
from dpu_agent.config_values import (
    ConfigError,
    parse_cpus,
    parse_int,
    parse_names,
    parse_size,
    parse_str,
    setting,
)
from dpu_offload import futex, shm

if sys.version_info >= (3, 11):
    import tomllib
else:  # Ubuntu 22.04 on BlueField ships Python 3.10
    import tomli as tomllib

DEFAULT_PATH = Path("/etc/dpu-agent/agent.toml")

MAX_POLL_SPIN_US = 100_000
ENGINE_POLL = ("auto", "always", "doze")


@dataclass(frozen=True)
class ServerSettings:
    """``[server]``: the gRPC endpoint."""

    listen_address: str = setting(parse_str, "127.0.0.1:50051")
    max_message_bytes: int = setting(parse_size, 16 * 2**20, unit="bytes")
    drain_grace_seconds: int = setting(parse_int, 10, unit="s")
    tls_cert: str = setting(parse_str, "")
    tls_key: str = setting(parse_str, "")
    tls_client_ca: str = setting(parse_str, "")
    admin_names: tuple[str, ...] = setting(parse_names, ())
    """Client-certificate common names (mutual TLS) that see every session in GetStatus."""


@dataclass(frozen=True)
class ArenaSettings:
    """``[arena]``: the DPU-DRAM weight arena."""

    bytes: int = setting(parse_size, 1 * 2**30, unit="bytes")


@dataclass(frozen=True)
class CacheSettings:
    """``[cache]``: the eviction policy (``weights.policies.POLICIES``) of the arena and of
    each slot pool a device registers."""

    policy: str = setting(parse_str, "reuse")


@dataclass(frozen=True)
class PrefetchSettings:
    """``[prefetch]``."""

    traces_dir: str = setting(parse_str, "")
    """A folder of recorded routing traces, ``<model name>.jsonl`` (docs/LAYOUT.md): a model
    loaded under that name starts its routing statistics (the next-layer predictor's, the cache
    policy's and the planner's) from the trace."""


@dataclass(frozen=True)
class TransferSettings:
    """``[transfer]``: deliveries and the data-plane loop."""

    chunk_bytes: int = setting(parse_size, 1 * 2**20, unit="bytes")
    timeout_seconds: int = setting(parse_int, 30, unit="s", live=True)
    poll_spin_us: int = setting(parse_int, 200, unit="us")
    """How long the data-plane loop polls after serving requests before it sleeps on its
    doorbell, microseconds (longer: lower wake-up latency, more CPU)."""
    engine_poll: str = setting(parse_str, "auto")
    """How the DMA-engine process waits for work (``ENGINE_POLL``): ``always`` polls its rings
    without sleeping while it serves a device (a core of its own, as the DMA engine it stands
    for is hardware), ``doze`` sleeps on its doorbell 2 ms after work, ``auto`` polls where the
    machine has cores to spare (``dpu_offload.futex.SPARE_CORES``: 8 CPUs or more)."""
    link_concurrency: int = setting(parse_int, 4, live=True)

    @property
    def engine_polls(self) -> bool:
        """Whether the DMA-engine process polls without sleeping (``engine_poll``)."""
        if self.engine_poll == "auto":
            return futex.SPARE_CORES
        return self.engine_poll == "always"


@dataclass(frozen=True)
class PlacementSettings:
    """``[placement]``."""

    rebalance_interval_seconds: int = setting(parse_int, 0, unit="s", live=True)


@dataclass(frozen=True)
class SessionSettings:
    """``[sessions]``: leases and per-session limits."""

    default_lease_seconds: int = setting(parse_int, 10, unit="s", live=True)
    max_concurrent_rpcs: int = setting(parse_int, 64, live=True)
    max_lease_seconds: int = setting(parse_int, 300, unit="s", live=True)
    max_sessions: int = setting(parse_int, 256)
    max_devices: int = setting(parse_int, 16)
    shm_group: str = setting(parse_str, "")
    """The group (name or number) the agent's shared memory is shared with, 0660, so clients
    of other Unix users in it can map it, and they theirs likewise (empty: 0600, clients must
    run as the agent's user; docs/DEPLOY.md)."""


@dataclass(frozen=True)
class MetricsSettings:
    """``[metrics]``: the Prometheus endpoint (empty: none)."""

    listen_address: str = setting(parse_str, "")


@dataclass(frozen=True)
class LoggingSettings:
    """``[logging]``."""

    format: str = setting(parse_str, "auto")


@dataclass(frozen=True)
class StateSettings:
    """``[state]``: where the agent keeps what survives a restart (empty: nothing)."""

    dir: str = setting(parse_str, "")


@dataclass(frozen=True)
class ActivationSettings:
    """``[activations]``: the activation router (empty address: none)."""

    listen_address: str = setting(parse_str, "")
    credits_per_sender: int = setting(parse_int, 64)
    worker_timeout_seconds: int = setting(parse_int, 5, unit="s")
    curve_server_cert: str = setting(parse_str, "")
    curve_clients_dir: str = setting(parse_str, "")


@dataclass(frozen=True)
class ClusterSection:
    """``[cluster]``: several agents sharing placement through etcd (no endpoints: alone)."""

    etcd_endpoints: str = setting(parse_str, "")
    agent_id: str = setting(parse_str, "")
    prefix: str = setting(parse_str, "/dpu-offload")
    lease_seconds: int = setting(parse_int, 5, unit="s")
    join_timeout_seconds: int = setting(parse_int, 30, unit="s")
    resync_seconds: int = setting(parse_int, 2, unit="s")
    peer_address: str = setting(parse_str, "127.0.0.1:0")
    peer_fetch: str = setting(parse_str, "auto")
    etcd_ca: str = setting(parse_str, "")
    etcd_cert: str = setting(parse_str, "")
    etcd_key: str = setting(parse_str, "")

    @property
    def settings(self) -> ClusterSettings | None:
        """The cluster code's settings, or None in single-agent mode (no etcd endpoints)."""
        if not self.etcd_endpoints:
            return None
        return ClusterSettings(
            tuple(e.strip() for e in self.etcd_endpoints.split(",")),
            self.agent_id or socket.gethostname(), self.prefix, self.lease_seconds,
            self.join_timeout_seconds, float(self.resync_seconds), self.peer_address,
            self.peer_fetch, self.etcd_ca, self.etcd_cert, self.etcd_key)


@dataclass(frozen=True)
class ProcessSettings:
    """``[process]``: where the agent runs."""

    cpus: tuple[int, ...] = setting(parse_cpus, ())
    """The CPUs the agent and the processes it starts (the DMA engine, the NIC stand-in) run
    on, a Linux CPU list such as ``"12-15"`` (empty: wherever it was started). On a
    BlueField, the Arm cores given to it; on a host emulating one, cores apart from the
    inference process's, as a DPU's are."""


@dataclass(frozen=True)
class AgentConfig:
    """Validated settings, one dataclass per section of the file. Sizes are bytes, durations
    seconds."""

    server: ServerSettings = field(default_factory=ServerSettings)
    arena: ArenaSettings = field(default_factory=ArenaSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    prefetch: PrefetchSettings = field(default_factory=PrefetchSettings)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    sessions: SessionSettings = field(default_factory=SessionSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    state: StateSettings = field(default_factory=StateSettings)
    activations: ActivationSettings = field(default_factory=ActivationSettings)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    process: ProcessSettings = field(default_factory=ProcessSettings)

    def value(self, section: str, key: str) -> Any:
        """The setting ``section.key``."""
        return getattr(getattr(self, section), key)


SECTIONS: dict[str, type] = {f.name: f.default_factory  # type: ignore[misc]
                             for f in fields(AgentConfig)}
"""Section -> its dataclass."""
_DECLARED = [((section, f.name), f.metadata) for section, cls in SECTIONS.items()
             for f in fields(cls)]
KEYS: dict[tuple[str, str], Callable[[Any], Any]] = {k: m["parse"] for k, m in _DECLARED}
"""(section, key) -> its parser, from the declarations."""
LIVE_SETTINGS = frozenset(k for k, m in _DECLARED if m["live"])
"""(section, key) of the settings SIGHUP applies to a running agent; the others need a
restart."""
UNITS = {k: m["unit"] for k, m in _DECLARED}


POSITIVE = (("activations", "worker_timeout_seconds"), ("activations", "credits_per_sender"),
            ("transfer", "link_concurrency"), ("transfer", "timeout_seconds"),
            ("sessions", "max_concurrent_rpcs"), ("sessions", "max_sessions"),
            ("sessions", "max_devices"), ("cluster", "lease_seconds"),
            ("cluster", "join_timeout_seconds"), ("cluster", "resync_seconds"))
"""Settings that must be above zero."""


def _check(cfg: AgentConfig) -> list[str]:
    from dpu_agent.weights.policies import POLICIES

    srv, t, act, ses = cfg.server, cfg.transfer, cfg.activations, cfg.sessions
    problems = [f"{s}.{k}: must be positive" for s, k in POSITIVE if cfg.value(s, k) <= 0]
    for name, addr in (("server.listen_address", srv.listen_address),
                       ("metrics.listen_address", cfg.metrics.listen_address),
                       ("activations.listen_address", act.listen_address),
                       ("cluster.peer_address", cfg.cluster.peer_address)):
        if addr and not re.match(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]+):\d{1,5}$", addr):
            problems.append(f"{name}: {addr!r} is not host:port")
        elif addr and not 0 <= int(addr.rsplit(":", 1)[1]) <= 65535:
            problems.append(f"{name}: port out of range in {addr!r}")
    if not srv.listen_address:
        problems.append("server.listen_address: must be set")
    if t.chunk_bytes <= 0 or t.chunk_bytes % 16 or t.chunk_bytes > 2**31:
        problems.append(f"transfer.chunk_bytes: {t.chunk_bytes} must be a positive multiple "
                        "of 16 below 2 GiB")
    if cfg.logging.format not in ("auto", "json", "text"):
        problems.append(f"logging.format: {cfg.logging.format!r} is not auto, json or text")
    if bool(act.curve_server_cert) != bool(act.curve_clients_dir):
        problems.append("activations.curve_server_cert / curve_clients_dir: set both or neither")
    if act.curve_server_cert and not os.access(act.curve_server_cert, os.R_OK):
        problems.append(f"activations.curve_server_cert: {act.curve_server_cert} is not a "
                        "readable file")
    if act.curve_clients_dir and not os.path.isdir(act.curve_clients_dir):
        problems.append(f"activations.curve_clients_dir: {act.curve_clients_dir} is not a "
                        "directory")
    if srv.drain_grace_seconds < 0:
        problems.append("server.drain_grace_seconds: must be >= 0")
    if cfg.placement.rebalance_interval_seconds < 0:
        problems.append("placement.rebalance_interval_seconds: must be >= 0 (0 = off)")
    if not 0 <= t.poll_spin_us <= MAX_POLL_SPIN_US:
        problems.append(f"transfer.poll_spin_us: {t.poll_spin_us} is not between 0 and "
                        f"{MAX_POLL_SPIN_US}")
    if t.engine_poll not in ENGINE_POLL:
        problems.append(f"transfer.engine_poll: {t.engine_poll!r} is not one of "
                        f"{', '.join(ENGINE_POLL)}")
    if cfg.arena.bytes < max(t.chunk_bytes, 2**20):
        problems.append(f"arena.bytes: {cfg.arena.bytes} is smaller than 1 MiB")
    if cfg.prefetch.traces_dir and not os.path.isdir(cfg.prefetch.traces_dir):
        problems.append(f"prefetch.traces_dir: {cfg.prefetch.traces_dir!r} is not a directory")
    if cfg.cache.policy not in POLICIES:
        problems.append(f"cache.policy: {cfg.cache.policy!r} is not one of "
                        f"{sorted(POLICIES)}")
    if ses.shm_group:
        try:
            shm.group_id(ses.shm_group)
        except ValueError as exc:
            problems.append(f"sessions.shm_group: {exc}")
    if not 1 <= ses.default_lease_seconds <= ses.max_lease_seconds:
        problems.append("sessions.default_lease_seconds: must be between 1 and "
                        f"max_lease_seconds ({ses.max_lease_seconds})")
    if bool(srv.tls_cert) != bool(srv.tls_key):
        problems.append("server.tls_cert / server.tls_key: set both or neither")
    if srv.tls_client_ca and not srv.tls_cert:
        problems.append("server.tls_client_ca: needs server.tls_cert and server.tls_key")
    if srv.admin_names and not srv.tls_client_ca:
        problems.append("server.admin_names: administrators are client certificates; needs "
                        "server.tls_client_ca")
    for key in ("tls_cert", "tls_key", "tls_client_ca"):
        path = getattr(srv, key)
        if path and not os.access(path, os.R_OK):
            problems.append(f"server.{key}: {path} is not a readable file")
    problems += _check_cluster(cfg)
    machine = os.cpu_count() or 1
    outside = [c for c in cfg.process.cpus if c >= machine]
    if outside:
        problems.append(f"process.cpus: CPUs {outside[:16]} are not on this machine (CPUs 0 "
                        f"to {machine - 1})")
    if srv.max_message_bytes < 2**16:
        problems.append("server.max_message_bytes: must be at least 64 KiB")
    return problems


def _check_cluster(cfg: AgentConfig) -> list[str]:
    problems = []
    for e in filter(None, cfg.cluster.etcd_endpoints.split(",")):
        try:
            parse_endpoint(e)
        except ValueError as exc:
            problems.append(f"cluster.etcd_endpoints: {exc}")
    if not re.match(r"^(/[A-Za-z0-9._\-]+)+$", cfg.cluster.prefix):
        problems.append(f"cluster.prefix: {cfg.cluster.prefix!r} must look like /name[/name] "
                        "(no trailing slash)")
    if cfg.cluster.agent_id and not re.match(r"^[A-Za-z0-9._\-]+$", cfg.cluster.agent_id):
        problems.append(f"cluster.agent_id: {cfg.cluster.agent_id!r} may hold only letters, "
                        "digits, '.', '_' and '-'")
    if cfg.cluster.peer_fetch not in ("auto", "always", "never"):
        problems.append(f"cluster.peer_fetch: {cfg.cluster.peer_fetch!r} is not auto, always or "
                        "never")
    if bool(cfg.cluster.etcd_cert) != bool(cfg.cluster.etcd_key):
        problems.append("cluster.etcd_cert / cluster.etcd_key: set both or neither")
    if cfg.cluster.etcd_cert and not cfg.cluster.etcd_ca:
        problems.append("cluster.etcd_cert: a client certificate needs cluster.etcd_ca (TLS)")
    for key in ("etcd_ca", "etcd_cert", "etcd_key"):
        path = getattr(cfg.cluster, key)
        if path and not os.access(path, os.R_OK):
            problems.append(f"cluster.{key}: {path} is not a readable file")
    return problems


def from_mapping(data: Mapping[str, Any], env: Mapping[str, str] | None = None) -> AgentConfig:
    """Validate parsed TOML plus environment overrides; ConfigError lists every problem."""
    problems: list[str] = []
    values: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for section, table in data.items():
        if not isinstance(table, Mapping):
            problems.append(f"{section}: expected a [{section}] table")
            continue
        for key, raw in table.items():
            parse = KEYS.get((section, key))
            if parse is None:
                problems.append(f"{section}.{key}: unknown key")
                continue
            try:
                values[section][key] = parse(raw)
            except ValueError as exc:
                problems.append(f"{section}.{key}: {exc}")
    for (section, key), parse in KEYS.items():
        var = f"DPU_AGENT_{section}_{key}".upper()
        if env is not None and var in env:
            try:
                values[section][key] = parse(env[var])
            except ValueError as exc:
                problems.append(f"{var}: {exc}")
    if env is not None:
        known = {f"DPU_AGENT_{s}_{k}".upper() for s, k in KEYS}
        problems += [f"{v}: unknown variable" for v in env
                     if v.startswith("DPU_AGENT_") and v not in known]
    cfg = AgentConfig(**{section: SECTIONS[section](**given)
                         for section, given in values.items()})
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
