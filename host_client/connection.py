"""The gRPC connection to the agent: TLS files, the channel, and a stub whose calls carry the
session token, are counted by method and fail as typed errors (``host_client.errors``). Shared
by the session client (``AgentClient``) and the session-less admin client."""

from __future__ import annotations

from collections import Counter, namedtuple
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from dpu_offload.identity import SESSION_TOKEN_METADATA
from dpu_offload.v1 import agent_pb2_grpc as pb_grpc
from host_client.errors import from_rpc


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS connection to the agent: the CA that signed the agent's certificate,
    and this client's certificate and key when the agent requires mutual TLS."""

    ca: str
    cert: str = ""
    key: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str) -> bytes | None:
            return open(path, "rb").read() if path else None
        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


def open_channel(address: str, tls: TlsFiles | None = None) -> grpc.Channel:
    """A gRPC channel to the agent at ``address`` (``host:port``): TLS (mutual where ``tls``
    names a client certificate) or, without ``tls``, plaintext."""
    return (grpc.secure_channel(address, tls.credentials()) if tls is not None
            else grpc.insecure_channel(address))


def typed_stub(channel: grpc.Channel, counts: Counter[str], token: Callable[[], str]
               ) -> pb_grpc.DpuAgentStub:
    """A stub whose unary calls send ``token()`` (when not empty), are counted in ``counts``
    by method and raise their failures as typed errors (``host_client.errors``)."""
    return pb_grpc.DpuAgentStub(grpc.intercept_channel(channel, _Calls(counts, token)))


class _Details(namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                         "wait_for_ready", "compression")),
               grpc.ClientCallDetails):
    pass


class _Calls(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Counts the client's gRPC calls by method name, sends the session token with each (the
    agent refuses a call naming the session without it) and raises a unary call's failure as
    the typed error of its status code."""

    def __init__(self, counts: Counter[str], token: Callable[[], str]) -> None:
        self.counts = counts
        self.token = token

    def _prepare(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        method = details.method
        name = method.decode() if isinstance(method, bytes) else str(method)
        self.counts[name.rsplit("/", 1)[-1]] += 1
        token = self.token()
        if not token:
            return details
        return _Details(details.method, details.timeout,
                        [*(details.metadata or ()), (SESSION_TOKEN_METADATA, token)],
                        details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Callable[..., Any],
                              details: grpc.ClientCallDetails, request: Any) -> Any:
        """The call, or its failure as a typed :class:`AgentError` (``host_client.errors``)."""
        call = continuation(self._prepare(details), request)
        failure = call.exception()
        if failure is not None:
            raise from_rpc(failure) from None
        return call

    def intercept_unary_stream(self, continuation: Callable[..., Any],
                               details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._prepare(details), request)
