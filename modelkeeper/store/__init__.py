"""The PostgreSQL store, the only room that holds SQL:

- :mod:`.schema`: the versioned migrations in ``migrations/`` and their runner;
- :mod:`.control`: the control plane's queries (catalog, nodes, deployments, placement);
- :mod:`.routing`: the gateway's reads, client keys and usage.
"""

from .control import Store
from .schema import MIGRATIONS_DIR, Migration, load_migrations

__all__ = ["MIGRATIONS_DIR", "Migration", "Store", "load_migrations"]
