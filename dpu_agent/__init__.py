"""The DPU agent: the daemon on the BlueField's Arm cores that owns the expert catalog and the
weight cache, plans delivery, and drives the data plane through the ring ABI. No CUDA here."""

__version__ = "0.1.0"
