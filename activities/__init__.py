"""Temporal activities, one module per system they touch (store, agents, gateway)."""
