"""Inference frameworks served through the agent (each imports its framework lazily)."""
