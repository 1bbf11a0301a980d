"""Errors the agent's core raises; the servicer maps each kind to its gRPC status code."""

from __future__ import annotations

from enum import Enum


class ErrorKind(Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"


class AgentError(Exception):
    """A refused request. Raised before any state changed."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class SlotsLanding(AgentError):
    """No slot can be given now, but one will be: every slot that fits is held or has a
    delivery in flight that nobody holds (it becomes evictable once it lands). A caller that
    may block waits and retries; one that reaches a client is RESOURCE_EXHAUSTED."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorKind.RESOURCE_EXHAUSTED, message)


def invalid(msg: str) -> AgentError:
    return AgentError(ErrorKind.INVALID_ARGUMENT, msg)


def not_found(msg: str) -> AgentError:
    return AgentError(ErrorKind.NOT_FOUND, msg)


def precondition(msg: str) -> AgentError:
    return AgentError(ErrorKind.FAILED_PRECONDITION, msg)
