"""``modelkeeper agent`` as it ran before the liveness redesign (commit 3f64917).

Until then the agent's worker sent a watch's heartbeats to Temporal at most once a second
whatever the heartbeat timeout::

    Worker(..., max_heartbeat_throttle_interval=MAX_HEARTBEAT_THROTTLE,
           default_heartbeat_throttle_interval=MAX_HEARTBEAT_THROTTLE)

The agent no longer passes either (the SDK's default, 0.8 x the timeout, applies), and no
setting brings them back, so this runs today's agent with its ``Worker`` wrapped to pass
them again. Everything else is today's code. Run it like ``python -m modelkeeper``::

    python -m bench.temporal_cost.old_agent agent --data-dir ... --name ...
"""

from __future__ import annotations

import functools

from temporalio.worker import Worker

import agent.main
from activities.node import MAX_HEARTBEAT_THROTTLE
from cli.main import main

if __name__ == "__main__":
    # run_agent looks Worker up in its module's globals when it builds the worker; these
    # are the two arguments its Worker(...) call had before 3f64917. mypy objects twice, and
    # both are the point: agent.main does not export Worker (attr-defined), and a partial
    # stands where the class was (assignment); Worker(...) is all run_agent does with it.
    agent.main.Worker = functools.partial(  # type: ignore[attr-defined,assignment]
        Worker, max_heartbeat_throttle_interval=MAX_HEARTBEAT_THROTTLE,
        default_heartbeat_throttle_interval=MAX_HEARTBEAT_THROTTLE)
    main()
