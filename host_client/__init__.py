"""The host client: the inference process's library for registering GPUs with the DPU agent,
running the receive kernels the agent drives, and acquiring experts as arrays. Errors:
``host_client.errors`` (every refusal a typed ``AgentError`` with its status code)."""

from host_client.client import AgentClient
from host_client.connection import TlsFiles
from host_client.devices import CpuReferenceDevice, Device, DeviceFault
from host_client.errors import (
    AgentError,
    AgentUnavailable,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TransferFailed,
)
from host_client.handles import AcquireHandle
from host_client.memory import ExpertSlot, SlotPoolSpec

__all__ = ["AcquireHandle", "AgentClient", "AgentError", "AgentUnavailable", "AlreadyExists",
           "CpuReferenceDevice", "Device", "DeviceFault", "ExpertSlot", "FailedPrecondition",
           "InvalidArgument", "NotFound", "PermissionDenied", "ResourceExhausted",
           "SlotPoolSpec", "TlsFiles", "TransferFailed"]
