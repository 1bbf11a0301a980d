"""Expert identity, as Expert Kit prints it: ``model/l{layer}-e{expert}``."""

from __future__ import annotations

import re
from typing import NamedTuple

from dpu_offload import abi
from dpu_offload.v1 import agent_pb2 as pb

MAX_KEYS_PER_CALL = 4096
"""Keys one DescribeExperts, AcquireBatch or Prefetch call may name (the agent refuses more
before any work; the client sends DescribeExperts in batches)."""
MAX_STEPS_PER_REPORT = 4096
"""Routing steps one ReportRouting call may carry (the agent refuses more before any work)."""

MAX_MODEL_NAME_CHARS = 128
"""Longest model name the agent accepts (names are part of every expert key and persisted)."""


def model_name_problem(name: str) -> str | None:
    """What makes ``name`` unusable as a model name (None when it is fine): empty, longer than
    ``MAX_MODEL_NAME_CHARS``, or holding a '/', whitespace or a non-printable character (the
    key ``model/l{layer}-e{expert}`` must parse back). The message shows at most 40 characters
    of the name."""
    shown = repr(name[:40]) + ("..." if len(name) > 40 else "")
    if not name:
        return "the model name is empty"
    if len(name) > MAX_MODEL_NAME_CHARS:
        return f"model name {shown} has {len(name)} characters, more than {MAX_MODEL_NAME_CHARS}"
    if "/" in name or any(c.isspace() or not c.isprintable() for c in name):
        return f"model name {shown} holds a '/', whitespace or a non-printable character"
    return None


def key_index_problem(key: ExpertKey) -> str | None:
    """What makes ``key``'s layer or expert unusable (None when both fit): below 0 or above
    ``abi.MAX_KEY_FIELD``, what a request-ring entry's field holds."""
    if 0 <= key.layer <= abi.MAX_KEY_FIELD and 0 <= key.expert <= abi.MAX_KEY_FIELD:
        return None
    return f"{key}: layer and expert must be from 0 to {abi.MAX_KEY_FIELD}"


_KEY_RE = re.compile(r"^(?P<model>[^/\s]+)/l(?P<layer>\d+)-e(?P<expert>\d+)$")


class ExpertKey(NamedTuple):
    """One routed expert of one MoE layer of one model."""

    model: str
    layer: int
    expert: int

    def __str__(self) -> str:
        return f"{self.model}/l{self.layer}-e{self.expert}"

    @classmethod
    def parse(cls, text: str) -> ExpertKey:
        """Parse ``model/l{layer}-e{expert}``; ValueError naming the text otherwise."""
        m = _KEY_RE.match(text)
        if not m:
            raise ValueError(f"not an expert key (model/l<layer>-e<expert>): {text!r}")
        return cls(m["model"], int(m["layer"]), int(m["expert"]))

    def to_proto(self) -> pb.ExpertKey:
        return pb.ExpertKey(model=self.model, layer=self.layer, expert=self.expert)

    @classmethod
    def from_proto(cls, msg: pb.ExpertKey) -> ExpertKey:
        return cls(msg.model, msg.layer, msg.expert)
