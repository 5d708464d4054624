"""The PostgreSQL store. :mod:`modelkeeper.store.store` (the control plane's queries) and
:mod:`modelkeeper.store.routing` (the gateway's reads, keys and usage) are the only modules
that hold SQL, besides the versioned migrations in ``migrations/``."""

from .store import MIGRATIONS_DIR, Migration, Store, load_migrations

__all__ = ["MIGRATIONS_DIR", "Migration", "Store", "load_migrations"]
