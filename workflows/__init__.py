"""Temporal workflows, one module per workflow. Deterministic and thin: decisions live in
:mod:`modelkeeper`'s pure functions, effects in :mod:`activities`."""

#: Every workflow the control-plane worker runs. Later workflows are added here.
ALL_WORKFLOWS: list[type] = []  # filled below, once the modules exist

from .deployment import DeploymentWorkflow  # noqa: E402 - after the list it fills
from .drain import DrainSaga  # noqa: E402
from .notify import CantPlaceWatch, NotifyWorkflow  # noqa: E402 - after the others: mypy's cycle order
from .restart import RestartSaga  # noqa: E402
from .switch import SwitchSaga  # noqa: E402
from .window import WindowWorkflow  # noqa: E402

ALL_WORKFLOWS.extend([DeploymentWorkflow, RestartSaga, DrainSaga, SwitchSaga, WindowWorkflow,
                      NotifyWorkflow, CantPlaceWatch])
