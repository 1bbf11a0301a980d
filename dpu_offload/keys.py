"""Expert identity, as Expert Kit prints it: ``model/l{layer}-e{expert}``."""

from __future__ import annotations

import re
from typing import NamedTuple

from dpu_offload.v1 import agent_pb2 as pb

MAX_DESCRIBE_KEYS = 4096
"""Keys one DescribeExperts call may name (the agent refuses more; the client sends batches)."""

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
