"""The DMA-engine stand-in: its own process, started and supervised by the agent, doing only
what a BlueField's DMA engine does. It maps the agent's arena, opens each client's slot pools
(CUDA IPC handle on a GPU, shared memory on the CPU reference device), consumes the agent's
work ring, moves runs of chunks (the copy engine on a GPU), and, once a run has landed, posts
its chunks as VERIFY descriptors on the device's landed ring, which the client's resident
kernel (or its CPU twin) checks before anything is READY. Descriptors it refuses, and copies
that ask for no verification, it completes on its own completion ring to the agent.

It is the only process besides the host client that imports CUDA (and only for CUDA
devices). Control comes as JSON lines on stdin (docs/ARCHITECTURE.md); see docs/DOCA.md for
the DOCA DMA calls it stands for.
"""
