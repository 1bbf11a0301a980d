"""How a call proves which session it may touch: the secret the agent hands out with a new
session travels in this gRPC metadata key on every later call. Session ids are names, not
secrets (status lists them); the token is the secret."""

SESSION_TOKEN_METADATA = "x-dpu-session-token"
"""gRPC metadata key (lower case, as gRPC requires) carrying the session token."""
