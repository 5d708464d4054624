"""The OpenAI-compatible gateway: routes requests to ready replicas (a later issue)."""
