"""The PostgreSQL store. :mod:`modelkeeper.store.store` is the only module that holds SQL
besides the versioned migrations in ``migrations/``."""

from .store import MIGRATIONS_DIR, Migration, Store, load_migrations

__all__ = ["MIGRATIONS_DIR", "Migration", "Store", "load_migrations"]
