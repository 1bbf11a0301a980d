"""The host client: the inference process's library for registering GPUs with the DPU agent,
running the receive kernels the agent drives, and acquiring experts as arrays."""

from host_client.client import (
    AcquireHandle,
    AgentClient,
    AgentUnavailable,
    RequestRefused,
    TlsFiles,
    TransferFailed,
)
from host_client.devices import CpuReferenceDevice, Device, DeviceFault
from host_client.memory import ExpertSlot, SlotPoolSpec

__all__ = ["AcquireHandle", "AgentClient", "AgentUnavailable", "CpuReferenceDevice", "Device",
           "DeviceFault", "ExpertSlot", "RequestRefused", "SlotPoolSpec", "TlsFiles",
           "TransferFailed"]
