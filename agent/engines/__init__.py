"""Inference engines the agent can launch, one adapter per engine kind."""
