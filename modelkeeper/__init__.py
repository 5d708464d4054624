"""modelkeeper: keeps self-hosted LLM deployments served.

This package is the ground floor of the rooms, each importing only what lies below it
(the import-linter contract in pyproject.toml checks this):

- ``store``: PostgreSQL (migrations, a store per aggregate, routing queries), and ``infra``: shared
  I/O such as connecting to Temporal and managed processes;
- ``settings`` and ``names``: the one home of every setting and shared name;
- ``domain``: pure models and decisions (the keeper, placement), no I/O.

The `modelkeeper` command (``cli``: `up` and the operator CLI), the components (``api``,
``worker``, ``gateway``, ``agent``) and the Temporal code (``workflows``, ``activities``)
are top-level packages beside this one.
"""

__version__ = "0.2.0"
