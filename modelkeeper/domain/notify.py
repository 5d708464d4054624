"""Notifications: what an operator is told, in which shapes, and when (docs/operations.md,
"Notifications").

Pure: the notice, its workflow id (which is its de-duplication per hour), the two bodies
(signed JSON and Slack's ``{"text": ...}``), the signature and its check, and when a
deployment unplaceable for a while is worth a notice. The HTTP and Temporal calls live in
:mod:`modelkeeper.infra.notify`, :mod:`activities.notify` and :mod:`workflows.notify`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from pydantic import Field

from .base import Tolerant


class NoticeKind(StrEnum):
    """What a notice is about: the audit-log event kind it answers, where there is one."""

    #: Too many failed starts in a row: the deployment waits for a spec change or /retry.
    PARKED = "deployment.parked"
    #: Unplaceable for longer than ``notify_cant_place_after_s`` without a break.
    CANT_PLACE = "deployment.cant_place"
    #: The API marked a node silent (its liveness stream went quiet): its replicas are
    #: placed again elsewhere. The issue's "node lost".
    NODE_SILENT = "node.silent"
    #: A saga's compensation could not finish: something is left half-way.
    ROLLBACK_INCOMPLETE = "operation.rollback_incomplete"
    #: A node's memory watchdog reported the critical level.
    WATCHDOG_CRITICAL = "node.memory_critical"
    #: A deployment or a scale-up was refused because a scope's quota limit would pass.
    QUOTA_AT_LIMIT = "quota.at_limit"
    #: ``modelkeeper notify test``: sent straight away, never de-duplicated.
    TEST = "notify.test"


class Notice(Tolerant):
    """One notification, as it travels in the notification workflow's input."""

    kind: NoticeKind
    #: What it is about, by id: a deployment, a node, an operation, a quota scope.
    subject: str = Field(min_length=1, max_length=256)
    message: str = Field(max_length=4096)
    #: When the condition was seen (the workflow id's hour comes from it).
    at: datetime
    data: dict[str, Any] = Field(default_factory=dict)


class TargetFormat(StrEnum):
    """The body a target receives."""

    WEBHOOK = "webhook"  # signed JSON
    SLACK = "slack"  # {"text": ...}, Slack's incoming-webhook shape (Mattermost takes it)


@dataclass(frozen=True)
class Target:
    """Where notices go. ``name`` travels in workflow histories; ``url`` never does (a
    Slack webhook's URL is its secret): a worker looks it up by name in its settings."""

    name: str
    format: TargetFormat
    url: str


#: The headers of a delivery. The signature covers the timestamp and the body, so a
#: captured delivery replayed later fails the receiver's age check, and one whose
#: timestamp was changed fails the signature.
HEADER_SIGNATURE = "X-Modelkeeper-Signature"
HEADER_TIMESTAMP = "X-Modelkeeper-Timestamp"
#: The same on every attempt at one notice to one target: a receiver drops a repeat.
HEADER_IDEMPOTENCY_KEY = "Idempotency-Key"
#: The signature's scheme prefix, so a later scheme can be told apart.
SIGNATURE_SCHEME = "v1"
#: A receiver accepts a timestamp at most this far from its own clock: 5 minutes, as
#: Slack's and Stripe's signing recipes do; each retry is signed afresh.
SIGNATURE_TOLERANCE_S = 300


def targets_from(webhook_urls: list[str], slack_urls: list[str]) -> list[Target]:
    """The configured targets, named ``webhook-1``, ``slack-1``... in the settings' order."""
    return ([Target(f"webhook-{i}", TargetFormat.WEBHOOK, u)
             for i, u in enumerate(webhook_urls, 1)]
            + [Target(f"slack-{i}", TargetFormat.SLACK, u) for i, u in enumerate(slack_urls, 1)])


def notice_workflow_id(notice: Notice) -> str:
    """``notify/<kind>/<subject>/<yyyymmddhh>`` (UTC): the notice's workflow id. Temporal
    refuses a second start under one id, so a condition seen again within the same hour is
    not sent again. A test notice is never de-duplicated: its id carries the second."""
    at = notice.at.astimezone(UTC)
    stamp = at.strftime("%Y%m%d%H%M%S" if notice.kind is NoticeKind.TEST else "%Y%m%d%H")
    return f"notify/{notice.kind.value}/{notice.subject}/{stamp}"


def idempotency_key(workflow_id: str, target: str) -> str:
    """One notice to one target, the same on every attempt."""
    return f"{workflow_id}/{target}"


def webhook_body(notice: Notice, key: str) -> bytes:
    """The signed JSON body: compact, keys sorted, so it is the same bytes on every
    attempt."""
    return json.dumps({
        "id": key, "kind": notice.kind.value, "subject": notice.subject,
        "message": notice.message, "at": notice.at.astimezone(UTC).isoformat(),
        "data": notice.data,
    }, sort_keys=True, separators=(",", ":"), default=str).encode()


def slack_text(notice: Notice) -> str:
    """One line a person reads in a channel."""
    return f"[modelkeeper] {notice.kind.value} {notice.subject}: {notice.message}"


def slack_body(notice: Notice) -> bytes:
    """Slack's incoming-webhook body: ``{"text": ...}``."""
    return json.dumps({"text": slack_text(notice)}).encode()


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """``v1=`` and the hex HMAC-SHA256, keyed with the shared secret, of
    ``<timestamp>.<body>``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"{SIGNATURE_SCHEME}={mac.hexdigest()}"


def verify(secret: str, *, timestamp: str, body: bytes, signed: str, now: float,
           tolerance_s: float = SIGNATURE_TOLERANCE_S) -> str | None:
    """A receiver's check: None when the delivery is genuine and fresh, else why not.
    (The recipe in docs/operations.md does the same in a dozen lines.)"""
    try:
        sent_at = int(timestamp)
    except ValueError:
        return f"timestamp {timestamp!r} is not a whole number of seconds"
    if abs(now - sent_at) > tolerance_s:
        return (f"timestamp {sent_at} is {abs(now - sent_at):.0f}s from now, more than "
                f"the {tolerance_s:.0f}s allowed: a replay or a wrong clock")
    if not hmac.compare_digest(signature(secret, sent_at, body), signed):
        return "the signature does not match the body and timestamp"
    return None


#: How long one POST may take, connect to last byte: receivers answer at once (Slack in
#: well under a second). The delivery activity's start-to-close is this plus a margin.
POST_TIMEOUT_S = 10.0

#: Answers worth another attempt: the receiver is down, busy or timed out. Any other 4xx
#: (a wrong URL, a revoked Slack hook) will not mend itself; retrying it for hours would
#: only hide the mistake.
RETRYABLE_STATUSES = frozenset({408, 425, 429})


def delivered(status: int) -> bool:
    """A 2xx: the receiver has it."""
    return 200 <= status < 300


def worth_retrying(status: int) -> bool:
    """Whether a refused delivery may be tried again (5xx and the transient 4xx)."""
    return status >= 500 or status in RETRYABLE_STATUSES


# -- the notices, one builder per condition (the callers pass ``now``) -------------------------


def parked_notice(deployment_id: str, last_failure: str | None, failures: int, *,
                  now: datetime) -> Notice:
    """The keeper parked a deployment after ``failures`` failed starts in a row."""
    return Notice(kind=NoticeKind.PARKED, subject=deployment_id, at=now,
                  message=f"parked after {failures} failed start(s) in a row"
                  + (f"; last: {last_failure}" if last_failure else "")
                  + "; fix the spec or `modelkeeper retry` it",
                  data={"consecutive_failures": failures, "last_failure": last_failure})


def silent_notice(node_id: str, reason: str, replicas: dict[str, list[str]], *,
                  now: datetime) -> Notice:
    """The API marked a node silent; ``replicas``: its replicas by deployment."""
    count = sum(len(r) for r in replicas.values())
    return Notice(kind=NoticeKind.NODE_SILENT, subject=node_id, at=now,
                  message=f"node went silent ({reason}); {count} replica(s) of "
                  f"{len(replicas)} deployment(s) are placed again",
                  data={"reason": reason, "replicas": replicas})


def rollback_notice(operation_id: str, kind: str, error: str | None, *,
                    deployment_id: str | None, node_id: str | None, now: datetime) -> Notice:
    """A saga's compensation could not finish (``rollback_incomplete``)."""
    on = deployment_id or node_id or "?"
    return Notice(kind=NoticeKind.ROLLBACK_INCOMPLETE, subject=operation_id, at=now,
                  message=f"{kind} on {on} could not undo all it did: {error or 'no detail'}",
                  data={"operation_kind": kind, "deployment_id": deployment_id,
                        "node_id": node_id, "error": error})


def watchdog_notice(node_id: str, reason: str, available_bytes: int | None,
                    margin_bytes: int, *, auto_protect: bool, now: datetime) -> Notice:
    """A node's memory watchdog reported critical."""
    return Notice(kind=NoticeKind.WATCHDOG_CRITICAL, subject=node_id, at=now,
                  message=f"memory critical: {reason}"
                  + ("; auto_protect stops a replica" if auto_protect
                     else "; auto_protect is off: stop or move a replica"),
                  data={"available_bytes": available_bytes, "margin_bytes": margin_bytes,
                        "auto_protect": auto_protect})


def quota_notice(scope: str, part: str, message: str, data: dict[str, Any], *,
                 now: datetime) -> Notice:
    """A change was refused: it would pass ``scope``'s ``part`` limit."""
    return Notice(kind=NoticeKind.QUOTA_AT_LIMIT, subject=f"{scope}/{part}", at=now,
                  message=f"refused: {message}", data=data)


def trial_notice(*, now: datetime, actor: str | None) -> Notice:
    """``modelkeeper notify test``."""
    return Notice(kind=NoticeKind.TEST, subject="test", at=now,
                  message="a test notification" + (f", sent by {actor}" if actor else ""),
                  data={"actor": actor})


# -- cant_place for longer than N ------------------------------------------------------------


@dataclass(frozen=True)
class Recovered:
    """The deployment is no longer unplaceable (or gone): no notice."""


@dataclass(frozen=True)
class WaitFor:
    """Unplaceable, but not for long enough yet: look again after ``seconds``."""

    seconds: float


@dataclass(frozen=True)
class Due:
    """Unplaceable since ``since``, longer than the threshold: send the notice."""

    since: datetime
    for_s: float


def cant_place_verdict(since: datetime | None, now: datetime, *,
                       after_s: float) -> Recovered | WaitFor | Due:
    """``since``: when the deployment's current unplaceable stretch began (None when its
    latest status is another, or it is gone)."""
    if since is None:
        return Recovered()
    lasted = (now - since).total_seconds()
    if lasted >= after_s:
        return Due(since=since, for_s=lasted)
    return WaitFor(seconds=after_s - lasted)


def cant_place_notice(deployment_id: str, since: datetime, now: datetime,
                      reason: str | None) -> Notice:
    """The notice of a deployment unplaceable since ``since``."""
    minutes = (now - since) / timedelta(minutes=1)
    return Notice(kind=NoticeKind.CANT_PLACE, subject=deployment_id, at=now,
                  message=f"cant_place for {minutes:.0f} min" + (f": {reason}" if reason else ""),
                  data={"since": since.astimezone(UTC).isoformat(), "reason": reason})


# -- what the notification workflows send their activities -----------------------------------


class DeliverInput(Tolerant):
    """One notice to one target, by the target's name (its URL stays in the settings)."""

    notice: Notice
    workflow_id: str
    target: str


class CantPlaceWatchInput(Tolerant):
    """Watch one deployment's unplaceable stretch; notify once it lasts ``after_s``."""

    deployment_id: str
    after_s: float


class CantPlaceSeen(Tolerant):
    """What the store says of a deployment's unplaceable stretch, by the database's
    clock: ``since`` None when its latest status is another (or it is gone)."""

    since: datetime | None
    now: datetime
    reason: str | None = None
