"""The thin HTTP API (FastAPI): deployments, models, nodes. OpenAPI at /docs."""
