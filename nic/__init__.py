"""The NIC stand-in: its own process, started and supervised by the agent, standing for the
BlueField NIC's hardware steering (DOCA Flow) and its GPUNetIO queues on the activation path.
It binds the socket senders send activation frames to, steers each by the snapshot the agent
publishes (``dpu_offload.steering_snapshot``), writes the payload as checksummed packets into
the worker device's rx ring, and returns the tx ring's answers to the sender: the agent carries
no activation byte (docs/ACTIVATIONS.md; docs/DOCA.md maps it to DOCA).
"""
