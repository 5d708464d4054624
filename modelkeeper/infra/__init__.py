"""Shared I/O helpers that several components use: connecting to Temporal, managed
processes, secrets and model files on disk. No SQL (that is the store's) and no
decisions (those are the domain's)."""
