"""What the API does with a heartbeat's memory report (:mod:`modelkeeper.domain.watchdog`
has the rules): record the node's level, an event when it changes; with
``watchdog_auto_protect``, stop one replica of a critical node; and raise the claim of a
model killed for memory (OOM calibration).

Why here, in the heartbeat's handler, and not in an activity: the heartbeat *is* the
observation, and what follows is small and bounded: an UPDATE that matches no row while
the level holds; on a critical node with auto_protect, one read of its replicas, one
conditional UPDATE that lets one API process act per interval, one audit event and one
signal. A workflow would add a start and a history to carry that one signal. The signal
is sent after the audit event is written, so a stop is never unaudited; should sending it
fail, the node is still critical at a heartbeat after the interval, and the watchdog acts
again then.
"""

from __future__ import annotations

import logging
from datetime import datetime

from temporalio.client import Client
from temporalio.service import RPCError

from modelkeeper.domain.capacity import PreemptRequest
from modelkeeper.domain.events import NewEvent
from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.nodes import AgentHeartbeat
from modelkeeper.domain.notify import watchdog_notice
from modelkeeper.domain.units import format_gib
from modelkeeper.domain.watchdog import (
    MemoryLevel,
    MemoryReport,
    OomKill,
    action_due,
    choose_victim,
    protect_reason,
)
from modelkeeper.infra import notify
from modelkeeper.names import deployment_workflow_id
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from workflows.deployment import DeploymentWorkflow

log = logging.getLogger(__name__)

#: Audit-log kinds: a node's level changed; the watchdog stopped a replica; a model's
#: claim was raised after an OOM kill.
EVENT_MEMORY_LEVEL = "node.memory_level"
EVENT_WATCHDOG_STOP = "node.watchdog_stop"
EVENT_OOM_CALIBRATED = "model.oom_calibrated"


async def watch_memory(node_id: NodeId, beat: AgentHeartbeat, *, store: Store,
                       temporal: Client, settings: Settings, now: datetime,
                       stored: MemoryLevel | None = None) -> None:
    """Everything a heartbeat's memory report and memory kills call for (see the module
    docstring). ``stored``: the level the heartbeat's own statement read for the node;
    when it is the report's, nothing is written (None: unknown, the write decides)."""
    for kill in beat.oom_kills:
        await _calibrate(node_id, kill, store=store, settings=settings)
    report = beat.memory
    if report is None:
        return
    previous = (None if report.level is stored
                else await store.watchdog.record_memory_level(node_id, report))
    if previous is not None:
        worse = report.level is not MemoryLevel.OK
        (log.warning if worse else log.info)(
            "node %s memory level %s -> %s: %s", node_id, previous.value,
            report.level.value, report.reason)
        await store.events.record_event(NewEvent(
            kind=EVENT_MEMORY_LEVEL, node_id=node_id,
            message=f"memory {previous.value} -> {report.level.value}: {report.reason}",
            data={"level": report.level.value, "previous": previous.value,
                  "available_bytes": report.available_bytes,
                  "margin_bytes": report.margin_bytes,
                  "engines_rss_bytes": report.engines_rss_bytes,
                  "gpu_free_bytes": report.gpu_free_bytes,
                  "auto_protect": settings.watchdog_auto_protect}))
    if previous is not None and report.level is MemoryLevel.CRITICAL:
        # On the change only: a node that stays critical is notified once, not at every
        # heartbeat (and at most once an hour, by the notice's id).
        await notify.notice_or_log(temporal, watchdog_notice(
            node_id, report.reason, report.available_bytes, report.margin_bytes,
            auto_protect=settings.watchdog_auto_protect, now=now), settings)
    if report.level is MemoryLevel.CRITICAL and settings.watchdog_auto_protect:
        await _protect(node_id, report, store=store, temporal=temporal, settings=settings,
                       now=now)


async def _protect(node_id: NodeId, report: MemoryReport, *, store: Store, temporal: Client,
                   settings: Settings, now: datetime) -> None:
    """Stop the replica :func:`choose_victim` names, once per interval per node."""
    known, last = await store.watchdog.last_action(node_id)
    if not known or not action_due(last, now, settings.watchdog_action_interval_s):
        return
    victim = choose_victim(await store.watchdog.protect_candidates(node_id))
    if victim is None:
        return
    if not await store.watchdog.claim_action(node_id, last=last, now=now):
        return  # another API process acts on this node now
    auth = await store.nodes.node_auth(node_id)
    reason = protect_reason(auth.name if auth is not None else node_id, report, victim)
    log.warning("%s", reason)
    await store.events.record_event(NewEvent(
        kind=EVENT_WATCHDOG_STOP, node_id=node_id, deployment_id=victim.deployment_id,
        replica_id=victim.replica_id, message=reason,
        data={"runs_as": victim.runs_as.value, "memory_bytes": victim.memory_bytes,
              "available_bytes": report.available_bytes,
              "margin_bytes": report.margin_bytes}))
    # The deployment workflow's ``preempt`` signal drains the replica and holds its place
    # back until room returns.
    handle = temporal.get_workflow_handle_for(DeploymentWorkflow.run,
                                              deployment_workflow_id(victim.deployment_id))
    try:
        await handle.signal(DeploymentWorkflow.preempt,
                            PreemptRequest(replica_id=victim.replica_id, by=None,
                                           reason=reason[:1024]))
    except RPCError as err:
        log.warning("the watchdog could not preempt %s of %s (%s); it tries again after "
                    "%gs if node %s is still critical", victim.replica_id,
                    victim.deployment_id, err, settings.watchdog_action_interval_s, node_id)


async def _calibrate(node_id: NodeId, kill: OomKill, *, store: Store,
                     settings: Settings) -> None:
    """Raise the killed engine's model's claim (see :func:`calibrated_memory`)."""
    calibration = await store.watchdog.record_oom_kill(kill)
    if calibration is None:
        return
    margin = settings.oom_calibration_margin
    await store.events.record_event(NewEvent(
        kind=EVENT_OOM_CALIBRATED, node_id=node_id, replica_id=kill.replica_id,
        message=f"{kill.replica_id} of model {kill.model_id} was killed for memory "
                f"({kill.detail}) at {format_gib(kill.peak_rss_bytes)} resident at most; "
                f"its next replicas claim at least "
                f"{format_gib(int(calibration.peak_rss_bytes * margin))}",
        data={"model_id": kill.model_id, "peak_rss_bytes": kill.peak_rss_bytes,
              "calibrated_peak_bytes": calibration.peak_rss_bytes,
              "oom_kills": calibration.oom_kills, "margin": margin}))
