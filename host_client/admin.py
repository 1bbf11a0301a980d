"""Session-less calls to an agent for tools (``expertctl status``, ``top``, ``flows``,
``rebalance``): one channel, the same TLS files as :class:`~host_client.client.AgentClient`,
failures raised as typed errors (``host_client.errors``)."""

from __future__ import annotations

from collections import Counter
from types import TracebackType

from dpu_offload.v1 import agent_pb2 as pb
from host_client.connection import TlsFiles, open_channel, typed_stub


class AgentAdmin:
    """Administrative calls to the agent at ``address``, no session of its own.

    Args:
        address: the agent's ``host:port``.
        tls: TLS (or mutual TLS) files; None for plaintext.
        token: a session's token, sent with every call (GetStatus then lists that session
            too; ApplyFlows and Rebalance on a session need it).
        timeout: deadline of every call, seconds.
    """

    def __init__(self, address: str, tls: TlsFiles | None = None, token: str = "",
                 timeout: float = 5.0) -> None:
        self.timeout = timeout
        self._channel = open_channel(address, tls)
        self.calls: Counter[str] = Counter()
        self._stub = typed_stub(self._channel, self.calls, lambda: token)

    def status(self) -> pb.StatusResponse:
        """The agent's state: the caller's sessions (every session for an administrator's
        certificate), models, arena and cache counters."""
        return self._stub.GetStatus(pb.StatusRequest(), timeout=self.timeout)

    def list_flows(self) -> pb.ListFlowsResponse:
        """The flow-steering table and its counters."""
        return self._stub.ListFlows(pb.ListFlowsRequest(), timeout=self.timeout)

    def apply_flows(self, session: str, add: list[pb.FlowRule], delete: list[int]
                    ) -> pb.ApplyFlowsResponse:
        """Add ``add`` and delete the rules numbered ``delete`` (``session``'s own)."""
        return self._stub.ApplyFlows(pb.ApplyFlowsRequest(session_id=session, add=add,
                                                          delete=delete), timeout=self.timeout)

    def rebalance(self, session: str, model: str, replicas: int = 0) -> pb.RebalanceResponse:
        """Re-plan ``session``'s ``model`` from its reported routing (progress on the
        session's event stream)."""
        return self._stub.Rebalance(pb.RebalanceRequest(session_id=session, model=model,
                                                        replicas=replicas),
                                    timeout=self.timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AgentAdmin:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
