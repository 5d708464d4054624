"""modelkeeper: keeps self-hosted LLM deployments served.

This package holds what every component shares: settings, ids and names, the
domain models and pure decision logic, the PostgreSQL store, the CLI and the
local stack launcher. Its pure modules import none of temporalio, httpx or
asyncpg; those live in ``store``, ``stack`` and the top-level component packages.
"""

__version__ = "0.1.0"
