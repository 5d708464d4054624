"""The PostgreSQL store, the only room that holds SQL:

- :mod:`.schema`: the versioned migrations in ``migrations/`` and their runner;
- :mod:`.stores`: :class:`Store`, the control plane's pool and a store per aggregate on
  it (:mod:`.nodes`, :mod:`.placement`, :mod:`.catalog`, :mod:`.deployments`,
  :mod:`.usage`, :mod:`.measured`, :mod:`.events`, :mod:`.operations`, :mod:`.tokens`,
  :mod:`.quotas`);
- :mod:`.routing`: the gateway's reads, client keys and usage, on a pool of its own.
"""

from .catalog import CatalogStore, ModelExistsError, ModelInUseError
from .deployments import DeploymentExistsError, DeploymentStore, UnknownModelError
from .events import EventStore
from .measured import MeasuredStore
from .nodes import NodeStore
from .operations import OperationConflictError, OperationsStore
from .placement import PlacementStore
from .quotas import QuotasStore
from .schema import MIGRATIONS_DIR, Migration, load_migrations
from .stores import Store
from .tokens import TokensStore
from .usage import UsageStore

__all__ = ["MIGRATIONS_DIR", "CatalogStore", "DeploymentExistsError", "DeploymentStore",
           "EventStore", "MeasuredStore", "Migration", "ModelExistsError", "ModelInUseError",
           "NodeStore",
           "OperationConflictError", "OperationsStore", "PlacementStore", "QuotasStore", "Store",
           "TokensStore", "UnknownModelError", "UsageStore", "load_migrations"]
