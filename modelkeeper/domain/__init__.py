"""The domain: what modelkeeper knows and decides, as pure code.

Stdlib and pydantic only: no temporalio, httpx, aiohttp or asyncpg, and no clock (time is
an argument). The keeper's ``decide`` and ``place`` live here, with the values every
component shares. The import-linter contract in pyproject.toml holds this room to that.
"""
