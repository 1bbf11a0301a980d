"""The cluster's shared state in etcd (v3 API through its HTTP gateway, ``etcd3gw``).

Key layout under ``prefix`` (docs/CLUSTER.md; values are JSON):

- ``{prefix}/members/{agent_id}``: a live agent's addresses and arena size, bound to its lease;
- ``{prefix}/placement/{model}``: the desired placement of a model (:class:`ClusterPlacement`),
  written only by compare-and-swap on its revision;
- ``{prefix}/actual/{agent_id}/{model}``: what an agent holds now, bound to its lease;
- ``{prefix}/planner``: the planner election key, bound to the leader's lease.

Anything else under the prefix is foreign: ignored, logged and counted.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpu_agent.cluster.settings import parse_endpoint

if TYPE_CHECKING:
    import requests
    from etcd3gw.client import Etcd3Client
    from etcd3gw.lease import Lease

log = logging.getLogger("dpu_agent.cluster")


class ClusterUnavailable(RuntimeError):
    """etcd could not be reached (after the retries the caller allowed)."""


@dataclass(frozen=True)
class Member:
    """A live agent, as registered under ``members/``."""

    agent_id: str
    grpc: str
    peer: str
    """host:port of its peer weight server (ZeroMQ)."""
    activations: str
    """host:port of its activation router ('' when off)."""
    arena_bytes: int

    @classmethod
    def from_json(cls, raw: bytes) -> Member:
        d = json.loads(raw)
        return cls(str(d["agent_id"]), str(d["grpc"]), str(d["peer"]),
                   str(d.get("activations", "")), int(d["arena_bytes"]))


class ClusterStore:
    """Typed access to the keys above, with every etcd call counted in :attr:`ops`.

    Args:
        endpoints: etcd client URLs as ``host:port``; the first that answers is used.
        prefix: key prefix shared by the agents of one cluster (no trailing slash).
        timeout: seconds for one etcd request.
        tls: (CA bundle, client certificate, client key) paths; a CA means https.
    """

    def __init__(self, endpoints: list[str], prefix: str, timeout: float = 2.0,
                 tls: tuple[str, str, str] = ("", "", "")) -> None:
        if not endpoints:
            raise ValueError("cluster: no etcd endpoints")
        self.endpoints = [parse_endpoint(e) for e in endpoints]
        self.prefix = prefix.rstrip("/")
        self.timeout = timeout
        self.tls = tls
        self.ops: Counter[str] = Counter()
        """etcd requests made, by operation (get, put, txn, lease, watch, delete)."""
        self.foreign_keys = 0
        self._client: Etcd3Client | None = None
        self._lock = threading.Lock()

    # -- connection ---------------------------------------------------------------------------
    def connect(self, deadline_seconds: float) -> None:
        """Find an answering endpoint, retrying with exponential backoff (0.1 s doubling to
        2 s) until ``deadline_seconds`` pass.

        Raises:
            ClusterUnavailable: naming every endpoint and the last error.
        """
        from etcd3gw.client import Etcd3Client  # only cluster mode needs the etcd client

        end = time.monotonic() + deadline_seconds
        delay, last = 0.1, ""
        while True:
            for host, port in self.endpoints:
                client = Etcd3Client(host, port, protocol="https" if self.tls[0] else "http",
                                     timeout=self.timeout, api_path="/v3/",
                                     session=self._session())
                try:
                    client.status()
                    self.ops["status"] += 1
                    self._client = client
                    return
                except (*_errors(), ValueError) as exc:
                    last = f"{host}:{port}: {_describe(exc)}"
            if time.monotonic() + delay > end:
                names = ", ".join(f"{h}:{p}" for h, p in self.endpoints)
                raise ClusterUnavailable(f"etcd unreachable at {names} for "
                                         f"{deadline_seconds:.0f} s (last error: {last})")
            log.warning("etcd not reachable yet (%s); retrying in %.1f s", last, delay)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _session(self) -> requests.Session:
        """An HTTP session that ignores the environment: REQUESTS_CA_BUNDLE would otherwise
        replace the cluster's CA (a requests quirk), and proxy variables do not apply."""
        import requests

        session = requests.Session()
        session.trust_env = False
        ca, cert, key = self.tls
        if ca:
            session.verify = ca
        if cert:
            session.cert = (cert, key)
        return session

    @property
    def client(self) -> Etcd3Client:
        if self._client is None:
            raise ClusterUnavailable("cluster store used before connect()")
        return self._client

    def _call(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.ops[op] += 1
        try:
            return fn(*args, **kwargs)
        except _errors() as exc:
            raise ClusterUnavailable(f"etcd {op} failed: {_describe(exc)}") from exc

    # -- keys -----------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def get_json(self, key: str) -> tuple[Any, int] | None:
        """The value at ``key`` decoded, and its mod revision; None when absent."""
        got = self._call("get", self.client.get, key, metadata=True)
        if not got:
            return None
        value, meta = got[0]
        return json.loads(value), int(meta["mod_revision"])

    def get_prefix(self, *parts: str) -> dict[str, bytes]:
        """Every key under ``prefix/parts.../`` -> its raw value."""
        base = self.key(*parts) + "/"
        got = self._call("get", self.client.get_prefix, base)
        return {meta["key"].decode(): value for value, meta in got}

    def put_json(self, key: str, value: Any, lease: Lease | None = None) -> None:
        self._call("put", self.client.put, key, json.dumps(value, sort_keys=True), lease)

    def delete(self, key: str) -> None:
        self._call("delete", self.client.delete, key)

    def compare_and_put(self, key: str, value: Any, mod_revision: int) -> bool:
        """Put only if the key's mod revision is still ``mod_revision`` (0: key absent)."""
        k = _b64(key)
        target = ({"target": "CREATE", "create_revision": 0} if mod_revision == 0 else
                  {"target": "MOD", "mod_revision": mod_revision})
        txn = {"compare": [{"key": k, "result": "EQUAL", **target}],
               "success": [{"request_put": {"key": k, "value": _b64(json.dumps(
                   value, sort_keys=True))}}],
               "failure": []}
        return bool(self._call("txn", self.client.transaction, txn).get("succeeded", False))

    def create(self, key: str, value: Any, lease: Lease) -> bool:
        """Put only if absent (an election), bound to ``lease``."""
        return bool(self._call("txn", self.client.create, key,
                               json.dumps(value, sort_keys=True), lease))

    # -- leases and watches ---------------------------------------------------------------------
    def lease(self, ttl: int) -> Lease:
        return self._call("lease", self.client.lease, ttl)

    def refresh(self, lease: Lease) -> int:
        """Keep ``lease`` alive; returns its TTL (0 or less: it has expired)."""
        return int(self._call("lease", lease.refresh))

    def watch(self, callback: Callable[[], None], on_end: Callable[[], None]
              ) -> Callable[[], None]:
        """Call ``callback`` on every batch of changes under the prefix, and ``on_end`` once
        when the stream ends (etcd went away, or cancelled); returns the cancel function.

        Raises:
            ClusterUnavailable: the watch could not be created.
        """
        self.ops["watch"] += 1
        prefix = self.prefix + "/"
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        try:
            resp = self.client.session.post(
                self.client.get_url("/watch"), stream=True, timeout=(self.timeout, None),
                json={"create_request": {"key": _b64(prefix), "range_end": _b64(end)}})
            resp.raise_for_status()
        except _errors() as exc:
            raise ClusterUnavailable(f"etcd watch failed: {_describe(exc)}") from exc
        cancelled = threading.Event()

        def pump() -> None:
            why = "stream closed"
            try:
                for line in resp.iter_lines():
                    if cancelled.is_set():
                        break
                    if line and json.loads(line).get("result", {}).get("events"):
                        callback()
            except Exception as exc:  # noqa: BLE001 - the stream ends when etcd goes away
                why = _describe(exc)
            finally:
                if not cancelled.is_set():
                    log.warning("etcd watch ended (%s); reconciling by resync until it is back",
                                why)
                on_end()

        def cancel() -> None:
            cancelled.set()
            resp.close()

        threading.Thread(target=pump, name="etcd-watch", daemon=True).start()
        return cancel

    def members(self) -> dict[str, Member]:
        """Live members by agent id; malformed entries are counted and skipped."""
        out: dict[str, Member] = {}
        for key, raw in self.get_prefix("members").items():
            agent_id = key.rsplit("/", 1)[1]
            try:
                member = Member.from_json(raw)
                if member.agent_id != agent_id:
                    raise ValueError(f"names agent {member.agent_id!r}")
            except (ValueError, KeyError, TypeError) as exc:
                self.foreign(key, f"not a member record ({exc})")
                continue
            out[agent_id] = member
        return out

    def foreign(self, key: str, why: str) -> None:
        self.foreign_keys += 1
        log.warning("cluster: ignoring %s: %s", key, why)


def _errors() -> tuple[type[Exception], ...]:
    """What the etcd client raises when etcd cannot answer."""
    import requests
    from etcd3gw.exceptions import Etcd3Exception

    return Etcd3Exception, requests.RequestException


def _describe(exc: BaseException) -> str:
    """etcd3gw's exceptions carry their text in ``detail_text``, not in ``str()``."""
    return str(getattr(exc, "detail_text", "") or exc or repr(exc))


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()
