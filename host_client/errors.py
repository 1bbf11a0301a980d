"""What the client raises when the agent says no, or is gone: one hierarchy, each error with
its gRPC status code (``code()``) and the agent's message (``details()``), whether the
refusal came back over gRPC or through the shared-memory channel. Every class is a
``grpc.RpcError``, so code written against raw gRPC errors keeps working.

    try:
        client.acquire(dev, key).wait()
    except NotFound: ...          # the model or expert does not exist
    except ResourceExhausted: ... # every slot that fits is held
    except AgentError as e: ...   # anything else the agent refused: e.code(), e.details()
"""

from __future__ import annotations

import grpc
import numpy as np

from dpu_offload import abi


class AgentError(grpc.RpcError):
    """The agent refused a call or request (or could not be reached).

    Attributes:
        message: what the agent (or the client) said was wrong.
        status: the channel's :class:`abi.RequestStatus` when the refusal came through the
            shared-memory channel; None for a gRPC call.
    """

    CODE = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None,
                 status: abi.RequestStatus | None = None) -> None:
        super().__init__(f"{(code or self.CODE).name}: {message}")
        self.message = message
        self._code = code or self.CODE
        self.status = status

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self.message


class InvalidArgument(AgentError):
    CODE = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(AgentError):
    CODE = grpc.StatusCode.NOT_FOUND


class AlreadyExists(AgentError):
    CODE = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(AgentError):
    """The call named something this session does not own (or lacked its token)."""

    CODE = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(AgentError):
    CODE = grpc.StatusCode.UNAUTHENTICATED


class FailedPrecondition(AgentError):
    CODE = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(AgentError):
    CODE = grpc.StatusCode.RESOURCE_EXHAUSTED


class AgentUnavailable(AgentError, ConnectionError):
    """The agent cannot be reached, went away, or stopped serving the channel."""

    CODE = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(AgentError, TimeoutError):
    CODE = grpc.StatusCode.DEADLINE_EXCEEDED


class AgentInternal(AgentError):
    """A fault inside the agent (its message carries the request id its log names)."""

    CODE = grpc.StatusCode.INTERNAL


class ChannelCorrupt(AgentError):
    """The agent's side of the shared-memory channel holds a value its ABI does not define
    (a status outside the enum): a broken agent, or the channel's memory overwritten."""

    CODE = grpc.StatusCode.DATA_LOSS


class TransferFailed(AgentError):
    """A delivery ended without verified bytes in the slot (the message says why)."""

    CODE = grpc.StatusCode.ABORTED


_BY_CODE: dict[grpc.StatusCode, type[AgentError]] = {
    cls.CODE: cls for cls in (InvalidArgument, NotFound, AlreadyExists, PermissionDenied,
                              Unauthenticated, FailedPrecondition, ResourceExhausted,
                              AgentUnavailable, DeadlineExceeded, AgentInternal, ChannelCorrupt,
                              TransferFailed)}
_REQUEST_CODES = {
    abi.RequestStatus.BAD_OPCODE: grpc.StatusCode.INVALID_ARGUMENT,
    abi.RequestStatus.REQUEST_REUSED: grpc.StatusCode.INVALID_ARGUMENT,
}


def error_for(code: grpc.StatusCode, message: str,
              status: abi.RequestStatus | None = None) -> AgentError:
    """The typed error for a status code (AgentError itself for a code without a class)."""
    return _BY_CODE.get(code, AgentError)(message, code, status)


def from_rpc(exc: grpc.RpcError) -> AgentError:
    """The typed error for a failed gRPC call."""
    if isinstance(exc, AgentError):
        return exc
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_for(code, details or "")


def refusal(status: abi.RequestStatus, message: str) -> AgentError:
    """The typed error for a channel request's status."""
    code = _REQUEST_CODES.get(status) or getattr(grpc.StatusCode, status.name)
    return error_for(code, message, status)


def refusal_of(reply: np.void) -> AgentError | None:
    """The refusal a channel reply carries; None for OK; ChannelCorrupt for a status the ABI
    does not define."""
    code = int(reply["status"])
    if code == abi.RequestStatus.OK:
        return None
    message = bytes(reply["message"]).decode(errors="replace")
    if code not in abi.RequestStatus._value2member_map_:
        return ChannelCorrupt(f"reply status {code} is not an abi.RequestStatus "
                              f"(message {message!r})")
    return refusal(abi.RequestStatus(code), message)


def status_text(value: int) -> str:
    """A completion or fault word's :class:`abi.Status` name, or the number and that it is
    none (the word is the agent's or the consumer's, read from shared memory)."""
    known = abi.Status._value2member_map_.get(value)
    return known.name if known is not None else f"status {value} (not an abi.Status)"
