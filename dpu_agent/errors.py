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


def invalid(msg: str) -> AgentError:
    return AgentError(ErrorKind.INVALID_ARGUMENT, msg)


def not_found(msg: str) -> AgentError:
    return AgentError(ErrorKind.NOT_FOUND, msg)


def precondition(msg: str) -> AgentError:
    return AgentError(ErrorKind.FAILED_PRECONDITION, msg)
