"""Server interceptors: gRPC server metrics under the names Grafana's gRPC dashboards expect
(``grpc_server_started_total``, ``grpc_server_handled_total``, ``grpc_server_handling_seconds``),
a request id carried through every log line of a call, and the guard that no call ends UNKNOWN.

A server-streaming handler is either an async generator or a coroutine that writes with
``context.write`` (the standard health service's Watch); both wrappers keep that shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import inspect
import logging
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from dpu_agent.identity import Caller, set_caller
from dpu_offload.identity import SESSION_TOKEN_METADATA

log = logging.getLogger("dpu_agent")

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
"""The current RPC's id ('-' outside a call); the log formatter reads it."""

_TYPES = {(False, False): "unary", (False, True): "server_stream",
          (True, False): "client_stream", (True, True): "bidi_stream"}


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class _OneRequestInterceptor(grpc.aio.ServerInterceptor, ABC):
    """Wraps the handlers of methods that take one request (unary and server-streaming: every
    method the agent serves); client-streaming ones pass through."""

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
            details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        return self.wrap(handler, details)

    @abstractmethod
    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
             ) -> grpc.RpcMethodHandler:
        """``handler`` wrapped for this interceptor's duty."""


class MetricsInterceptor(_OneRequestInterceptor):
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

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
             ) -> grpc.RpcMethodHandler:
        service, _, method = details.method.lstrip("/").rpartition("/")
        labels = (service, method, _TYPES[(False, handler.response_streaming)])
        return _around(handler, lambda context: self._observe(labels, context))

    @contextlib.asynccontextmanager
    async def _observe(self, labels: tuple[str, str, str], context: Any
                       ) -> AsyncIterator[None]:
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


def _around(handler: grpc.RpcMethodHandler, around: Callable[[Any], Any]
            ) -> grpc.RpcMethodHandler:
    """``handler`` (unary or server-streaming) with every call run inside the async context
    manager ``around(context)``."""
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _around_stream(handler.unary_stream, around),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
    behavior = handler.unary_unary

    async def unary(request: Any, context: Any) -> Any:
        async with around(context):
            return await behavior(request, context)

    return grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer)


def _around_stream(behavior: Any, around: Callable[[Any], Any]) -> Any:
    """``behavior`` (a server-streaming handler of either shape) run inside the async
    context manager ``around(context)``, keeping its shape."""
    if inspect.isasyncgenfunction(behavior):
        async def generator(request: Any, context: Any) -> Any:
            async with around(context):
                async for item in behavior(request, context):
                    yield item
        return generator

    async def writer(request: Any, context: Any) -> Any:
        async with around(context):
            return await behavior(request, context)
    return writer


class GuardInterceptor(_OneRequestInterceptor):
    """No call ends UNKNOWN. A body that does not decode as the method's request message is
    INVALID_ARGUMENT naming the message; an exception a handler did not turn into a status is
    logged with the call's request id and answered INTERNAL naming that id (a defect to fix:
    the hostile-input tests require that it never happens). Register it after
    :class:`MetricsInterceptor`, which sets the request id."""

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
             ) -> grpc.RpcMethodHandler:
        method, decode = details.method, handler.request_deserializer
        if handler.response_streaming:
            inner = _around_stream(handler.unary_stream, _guarded)

            async def decoded_stream(raw: bytes, context: Any) -> Any:
                return await _decoded(raw, decode, method, context)

            return grpc.unary_stream_rpc_method_handler(
                _decode_then(inner, decoded_stream),
                response_serializer=handler.response_serializer)

        async def unary(raw: bytes, context: Any) -> Any:
            request = await _decoded(raw, decode, method, context)
            async with _guarded(context):
                return await handler.unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, response_serializer=handler.response_serializer)


async def _decoded(raw: bytes, decode: Callable[[bytes], Any] | None, method: str,
                   context: Any) -> Any:
    """The request message of ``raw``; aborts INVALID_ARGUMENT when it does not parse."""
    if decode is None:
        return raw
    try:
        return decode(raw)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and others
        message = getattr(getattr(decode, "__self__", None), "DESCRIPTOR", None)
        name = message.full_name if message is not None else "request message"
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{method}: the request body is not a valid {name} "
                            f"({type(exc).__name__})")


def _decode_then(inner: Any, decode: Callable[[bytes, Any], Awaitable[Any]]) -> Any:
    """A server-streaming handler taking the raw body: decode, then run ``inner`` (either
    shape)."""
    if inspect.isasyncgenfunction(inner):
        async def generator(raw: bytes, context: Any) -> Any:
            request = await decode(raw, context)
            async for item in inner(request, context):
                yield item
        return generator

    async def writer(raw: bytes, context: Any) -> Any:
        return await inner(await decode(raw, context), context)
    return writer


@contextlib.asynccontextmanager
async def _guarded(context: Any) -> AsyncIterator[None]:
    """Turn an exception that escaped a handler into INTERNAL with the request id, logged."""
    try:
        yield
    except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:
        rid = request_id.get()
        log.exception("unhandled %s in a call (request %s)", type(exc).__name__, rid)
        await context.abort(grpc.StatusCode.INTERNAL,
                            f"internal error (request {rid}, in the agent's log)")


class CallerInterceptor(_OneRequestInterceptor):
    """Records who is calling (:mod:`dpu_agent.identity`) for the core's checks: the session
    token from the metadata, and under mutual TLS a digest of the peer's certificate."""

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
             ) -> grpc.RpcMethodHandler:
        return _around(handler, _as_caller)


@contextlib.asynccontextmanager
async def _as_caller(context: Any) -> AsyncIterator[None]:
    metadata = dict(context.invocation_metadata() or ())
    auth = context.auth_context() or {}
    pem = auth.get("x509_pem_cert") or [b""]
    name = (auth.get("x509_common_name") or [b""])[0]
    set_caller(Caller(token=str(metadata.get(SESSION_TOKEN_METADATA, ""))[:256],
                      identity=hashlib.sha256(pem[0]).hexdigest() if pem[0] else "",
                      name=name.decode(errors="replace") if pem[0] else ""))
    yield
