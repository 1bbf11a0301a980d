"""Contracts between the agent, the host client, the DMA engine and the kernels, in one package:
the generated v1 control API (``dpu_offload.v1``, produced from ``proto/`` by ``make proto``);
the shared-memory ABI (``abi``, mirrored in ``include/ring.cuh``) with its rings (``ring``),
the data-plane channel (``channel``), segment naming (``shm``), doorbells and futex waits
(``bell``, ``futex``); the checksum (``checksum``); the expert blob's layout (``blob``);
expert keys (``keys``), session identity (``identity``), activation frames (``frames``) and
the command lines' argument types (``cli_args``). No CuPy, no torch: the agent (aarch64)
imports it."""
