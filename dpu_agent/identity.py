"""Who is calling. The service layer records, per call, the session token the call presented
and its peer's TLS identity; a session is bound to both when it is created and every call that
names it is checked against them (``Orchestrator.session``)."""

from __future__ import annotations

import hmac
import secrets
from contextvars import ContextVar
from dataclasses import dataclass

from dpu_offload.shm import token_digest


@dataclass(frozen=True)
class Caller:
    """The credentials of the call being served.

    Attributes:
        token: the session token the call presented ("" when none).
        identity: a digest of the peer's certificate under mutual TLS ("" without TLS).
    """

    token: str = ""
    identity: str = ""
    name: str = ""
    """The peer certificate's common name under mutual TLS ("" without TLS)."""


_NOBODY = Caller()
_current: ContextVar[Caller] = ContextVar("caller")


def current_caller() -> Caller:
    """The credentials of the call being served (no token, no identity outside a call)."""
    return _current.get(_NOBODY)


def set_caller(who: Caller) -> None:
    """Record the credentials of the call being served (the service layer, per call)."""
    _current.set(who)


@dataclass(frozen=True)
class Binding:
    """What a session was bound to at creation: the digest of its token and the identity."""

    digest: bytes
    identity: str

    @classmethod
    def issue(cls, identity: str) -> tuple[Binding, str]:
        """A new binding for ``identity`` and the token to hand out (once)."""
        token = secrets.token_hex(16)
        return cls(token_digest(token), identity), token

    def admits(self, who: Caller) -> bool:
        """Whether ``who`` presented this session's token (and, under TLS, is its owner)."""
        return hmac.compare_digest(token_digest(who.token), self.digest) and \
            who.identity == self.identity
