"""Contracts shared by the agent and the host client: the generated v1 control API
(``dpu_offload.v1``, produced from ``proto/`` by ``make proto``) and the expert identity."""
