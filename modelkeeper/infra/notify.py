"""Notifications at the edges: the targets and secret from the settings, one HTTP POST of
a notice, and starting the notification workflows by name (they live above this room).

Every place that sees a condition (the keeper's status activity, a saga's record, the
API's liveness, watchdog and quota checks) calls :func:`start_notice`. It starts one short
workflow per notice under ``notify/<kind>/<subject>/<yyyymmddhh>``; Temporal refuses a
second start under that id (:data:`REUSE`, :data:`CONFLICT`), which is the de-duplication
per hour. From then on the notice is in Temporal's history: a worker that dies mid-delivery
leaves it to the next worker, which retries it (workflows/notify.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import httpx
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError

from ..domain.notify import (
    HEADER_IDEMPOTENCY_KEY,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    POST_TIMEOUT_S,
    CantPlaceWatchInput,
    Notice,
    Target,
    TargetFormat,
    idempotency_key,
    notice_workflow_id,
    signature,
    slack_body,
    targets_from,
    webhook_body,
)
from ..names import (
    CONTROL_TASK_QUEUE,
    WORKFLOW_CANT_PLACE_WATCH,
    WORKFLOW_NOTIFY,
    cant_place_watch_id,
)
from ..settings import Settings

log = logging.getLogger(__name__)

#: A notice's id is refused while its workflow runs (CONFLICT) and after it closed
#: (REUSE), whatever its outcome: within the hour its id names, it is sent once.
REUSE = WorkflowIDReusePolicy.REJECT_DUPLICATE
CONFLICT = WorkflowIDConflictPolicy.FAIL
#: One watch per deployment: a second cant_place while it waits joins it (USE_EXISTING);
#: a new stretch after it ended starts a new one (ALLOW_DUPLICATE). The notice it sends
#: is de-duplicated per hour like any other.
WATCH_REUSE = WorkflowIDReusePolicy.ALLOW_DUPLICATE
WATCH_CONFLICT = WorkflowIDConflictPolicy.USE_EXISTING
#: The most of a refused answer's body kept in the error (a receiver's explanation).
DETAIL_CHARS = 200


class NotifyConfigError(ValueError):
    """Webhook URLs without a readable secret: reported as one line naming the setting."""


def configured_targets(settings: Settings) -> list[Target]:
    """Every target in the settings, in order (webhooks, then Slack)."""
    return targets_from(settings.notify_webhook_urls, settings.notify_slack_urls)


def notify_configured(settings: Settings) -> bool:
    """Whether any target is set: without one, no notification workflow is started."""
    return bool(settings.notify_webhook_urls or settings.notify_slack_urls)


def read_notify_secret(settings: Settings) -> str | None:
    """The signing secret from ``notify_secret_file``; None when no webhook needs one.
    Raises :class:`NotifyConfigError` when webhooks are set and the file is unset,
    unreadable or empty: an unsigned notice would teach receivers to skip the check."""
    if not settings.notify_webhook_urls:
        return None
    path = settings.notify_secret_file
    if path is None:
        raise NotifyConfigError("MODELKEEPER_NOTIFY_WEBHOOK_URLS is set but "
                                "MODELKEEPER_NOTIFY_SECRET_FILE is not: webhooks are signed, "
                                "so name a file holding the shared secret")
    try:
        secret = path.read_text().strip()
    except OSError as err:
        raise NotifyConfigError(f"notify_secret_file = {str(path)!r}: cannot read it "
                                f"({err.strerror})") from err
    if not secret:
        raise NotifyConfigError(f"notify_secret_file = {str(path)!r}: the file is empty")
    return secret


@dataclass(frozen=True)
class PostResult:
    """What one POST got: the status (None when no answer came) and a short detail."""

    status: int | None
    detail: str


async def post_notice(http: httpx.AsyncClient, target: Target, notice: Notice, *,
                      workflow_id: str, secret: str | None) -> PostResult:
    """POST ``notice`` to ``target`` once: signed JSON or Slack's shape, with the
    idempotency key of this notice and target. A network failure or timeout is a result
    (status None), not an exception: the caller decides what to retry."""
    key = idempotency_key(workflow_id, target.name)
    headers = {"Content-Type": "application/json", HEADER_IDEMPOTENCY_KEY: key,
               "User-Agent": "modelkeeper-notify"}
    if target.format is TargetFormat.WEBHOOK:
        body = webhook_body(notice, key)
        if secret is not None:
            # Signed at each attempt, so a retry hours later passes the receiver's age check.
            sent_at = int(time.time())
            headers[HEADER_TIMESTAMP] = str(sent_at)
            headers[HEADER_SIGNATURE] = signature(secret, sent_at, body)
    else:
        body = slack_body(notice)
    try:
        resp = await http.post(target.url, content=body, headers=headers,
                               timeout=POST_TIMEOUT_S)
    except httpx.HTTPError as err:
        # The URL may carry a token (Slack's): name the target, never the URL.
        return PostResult(None, f"{target.name}: {type(err).__name__}: {err}"[:DETAIL_CHARS])
    return PostResult(resp.status_code, f"{target.name}: HTTP {resp.status_code} "
                      f"{resp.text[:DETAIL_CHARS]}".strip())


async def start_notice(client: Client, notice: Notice, settings: Settings) -> bool:
    """Start the notice's workflow; False when none is configured or its id was seen this
    hour (the de-duplication). Temporal errors propagate: an activity calling this is
    retried, so its notice is not lost to a blip."""
    if not notify_configured(settings):
        return False
    workflow_id = notice_workflow_id(notice)
    try:
        await client.start_workflow(WORKFLOW_NOTIFY, notice, id=workflow_id,
                                    task_queue=CONTROL_TASK_QUEUE, id_reuse_policy=REUSE,
                                    id_conflict_policy=CONFLICT)
    except WorkflowAlreadyStartedError:
        log.debug("notice %s was sent this hour already", workflow_id)
        return False
    log.info("notice %s: %s", workflow_id, notice.message)
    return True


async def notice_or_log(client: Client, notice: Notice, settings: Settings) -> None:
    """:func:`start_notice` for the API's own paths (liveness, watchdog, quotas), which
    must answer whatever Temporal does: a start that fails is logged, and the notice lost
    (its audit event is not; docs/operations.md says so)."""
    try:
        await start_notice(client, notice, settings)
    except RPCError as err:
        log.warning("could not start the %s notice of %s (%s): it is not sent",
                    notice.kind.value, notice.subject, err)


async def start_cant_place_watch(client: Client, deployment_id: str,
                                 settings: Settings) -> None:
    """Watch the deployment's unplaceable stretch (joins the watch already running)."""
    if not notify_configured(settings):
        return
    await client.start_workflow(
        WORKFLOW_CANT_PLACE_WATCH,
        CantPlaceWatchInput(deployment_id=deployment_id,
                            after_s=settings.notify_cant_place_after_s),
        id=cant_place_watch_id(deployment_id), task_queue=CONTROL_TASK_QUEUE,
        id_reuse_policy=WATCH_REUSE, id_conflict_policy=WATCH_CONFLICT)
