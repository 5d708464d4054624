"""The PostgreSQL store, the only room that holds SQL:

- :mod:`.schema`: the versioned migrations in ``migrations/`` and their runner;
- :mod:`.control`: the control plane's queries (catalog, nodes, deployments, placement);
- :mod:`.routing`: the gateway's reads, client keys and usage;
- :mod:`.operations`: the sagas' records (restart, drain, switch, reconfigure).
"""

from .control import Store
from .operations import OperationConflictError, OperationsStore
from .schema import MIGRATIONS_DIR, Migration, load_migrations

__all__ = ["MIGRATIONS_DIR", "Migration", "OperationConflictError", "OperationsStore", "Store",
           "load_migrations"]
