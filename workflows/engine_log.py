"""EngineLog: one read of an engine's log on its node, for the API (`modelkeeper logs`).

The API cannot run an activity by itself, and agents listen on no port of their own
(docs/security.md): this workflow runs ``read_engine_log`` on the node's task queue once
and returns its answer (modelkeeper.domain.log_reads). No retry: the caller (a person, or
a follow asking again within a second) retries, and an agent that does not pick the read
up within :data:`AGENT_PICKUP` is reported as not answering rather than waited for.

A brand-new workflow type: nothing to patch yet. A change to its commands from here on
goes behind ``workflow.patched``.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from activities import stubs
    from modelkeeper.domain.log_reads import EngineLogChunk, EngineLogInput
    from modelkeeper.names import WORKFLOW_ENGINE_LOG, node_task_queue

#: A live agent polls its queue all the time and picks a read up in milliseconds: 5 s
#: without one means its agent is down or cut off, and the person asking should hear so.
AGENT_PICKUP = timedelta(seconds=5)
#: Reading at most MAX_LOG_BYTES of a local file takes milliseconds; 10 s covers a slow disk.
READ_TIMEOUT = timedelta(seconds=10)
#: The whole run's bound (the API waits for it): the two above and some slack.
RUN_TIMEOUT = timedelta(seconds=20)
#: One attempt: the caller retries (see the module docstring).
ONE_ATTEMPT = RetryPolicy(maximum_attempts=1)


@workflow.defn(name=WORKFLOW_ENGINE_LOG)
class EngineLogWorkflow:
    """One read of an engine's log."""

    @workflow.run
    async def run(self, request: EngineLogInput) -> EngineLogChunk:
        return await workflow.execute_activity(
            stubs.read_engine_log, request.read, task_queue=node_task_queue(request.node_id),
            schedule_to_start_timeout=AGENT_PICKUP, start_to_close_timeout=READ_TIMEOUT,
            retry_policy=ONE_ATTEMPT)
