"""The `modelkeeper` command: the local stack (`up`), each component's entry point, and
the operator CLI. The only room that imports the components (api, worker, agent,
gateway); nothing imports it but `python -m modelkeeper` (modelkeeper/__main__.py)."""
