"""Server interceptors: gRPC server metrics under the names Grafana's gRPC dashboards expect
(``grpc_server_started_total``, ``grpc_server_handled_total``, ``grpc_server_handling_seconds``)
and a request id carried through every log line of a call."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
"""The current RPC's id ('-' outside a call); the log formatter reads it."""

_TYPES = {(False, False): "unary", (False, True): "server_stream",
          (True, False): "client_stream", (True, True): "bidi_stream"}


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts and times every call; labels are bounded (service, method, type, code)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_service", "grpc_method", "grpc_type"]
        self.started = Counter("grpc_server_started", "RPCs started on the server.", labels,
                               registry=registry)
        self.handled = Counter("grpc_server_handled", "RPCs completed on the server.",
                               [*labels, "grpc_code"], registry=registry)
        self.seconds = Histogram("grpc_server_handling_seconds",
                                 "Response latency of RPCs handled by the server.", labels,
                                 registry=registry,
                                 buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5,
                                          1, 2.5, 5, 10))

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
            details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        service, _, method = details.method.lstrip("/").rpartition("/")
        kind = _TYPES[(handler.request_streaming, handler.response_streaming)]
        labels = (service, method, kind)
        if kind == "unary":
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, labels),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if kind == "server_stream":
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, labels),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler

    @contextlib.contextmanager
    def _observe(self, labels: tuple[str, str, str], context: Any) -> Iterator[None]:
        """Give the call a request id, count it started, and on the way out count its code
        and time it."""
        request_id.set(secrets.token_hex(4))
        self.started.labels(*labels).inc()
        start = time.perf_counter()
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            code = context.code()
            if code is None:
                code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
            name = code.name if isinstance(code, grpc.StatusCode) else str(code)
            self.handled.labels(*labels, name).inc()
            self.seconds.labels(*labels).observe(time.perf_counter() - start)

    def _unary(self, behavior: Any, labels: tuple[str, str, str]) -> Any:
        async def wrapped(request: Any, context: Any) -> Any:
            with self._observe(labels, context):
                return await behavior(request, context)
        return wrapped

    def _stream(self, behavior: Any, labels: tuple[str, str, str]) -> Any:
        async def wrapped(request: Any, context: Any) -> Any:
            with self._observe(labels, context):
                async for item in behavior(request, context):
                    yield item
        return wrapped
