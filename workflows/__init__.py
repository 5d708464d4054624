"""Temporal workflows, one module per workflow. Deterministic and thin: decisions live in
:mod:`modelkeeper`'s pure functions, effects in :mod:`activities`.

The list of workflows a worker runs is ``worker.main.ALL_WORKFLOWS``, not here: this
package's ``__init__`` importing its modules put it in one import cycle with
``workflows.deployment``, and mypy, checking that cycle from a fresh cache, could no longer
infer ``DeploymentWorkflow.run``'s type where the API names it (``get_workflow_handle_for``).
"""
