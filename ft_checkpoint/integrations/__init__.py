"""Participants of frameworks the core does not name (DeepSpeed)."""
