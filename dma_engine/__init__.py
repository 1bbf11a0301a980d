"""The DMA-engine stand-in: its own process, started and supervised by the agent. It maps the
agent's arena, opens each client's slot pools (CUDA IPC handle on a GPU, shared memory on the CPU
reference device), consumes the agent's work ring, moves runs of chunks (the copy engine on a
GPU), checks each landed run's chunk checksums (the segmented checksum kernel in its own CUDA
context; NumPy on the CPU reference device) and completes every descriptor on its completion
ring to the agent, which publishes READY. No thread of the inference process moves or checks a
payload byte.

It is the only process besides the host client that imports CUDA (and only for CUDA devices).
Control comes as JSON lines on stdin (see ``__main__``); docs/DOCA.md maps it to DOCA DMA and
says what a BlueField would do differently (the checksum is the GPU's work there).
"""
