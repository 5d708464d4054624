"""Notifications' pure parts: ids (the dedupe per hour), bodies, the signature and its
check, when cant_place is worth a notice; the settings; `modelkeeper notify test`."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from cli import main as cli
from cli import stack
from modelkeeper.domain.notify import (
    Due,
    Notice,
    NoticeKind,
    Recovered,
    TargetFormat,
    WaitFor,
    cant_place_verdict,
    delivered,
    idempotency_key,
    notice_workflow_id,
    parked_notice,
    signature,
    slack_body,
    targets_from,
    trial_notice,
    verify,
    webhook_body,
    worth_retrying,
)
from modelkeeper.settings import Settings
from tests.support.doc_blocks import marked_blocks

AT = datetime(2026, 12, 4, 17, 59, 30, tzinfo=UTC)


def test_a_notice_id_is_its_kind_subject_and_utc_hour() -> None:
    notice = parked_notice("d-1", "exit 1", 5, now=AT)
    assert notice_workflow_id(notice) == "notify/deployment.parked/d-1/2026120417"
    # The same condition later in the hour has the same id (Temporal refuses it) ...
    assert notice_workflow_id(notice.model_copy(update={"at": AT + timedelta(seconds=29)})) \
        == notice_workflow_id(notice)
    # ... the next hour another, and the hour is UTC's whatever the caller's zone.
    assert notice_workflow_id(notice.model_copy(update={"at": AT + timedelta(seconds=31)})) \
        .endswith("/2026120418")
    cet = AT.astimezone(datetime.now().astimezone().tzinfo)
    assert notice_workflow_id(notice.model_copy(update={"at": cet})) \
        == notice_workflow_id(notice)
    # A test notice is never de-duplicated by the hour.
    assert notice_workflow_id(trial_notice(now=AT, actor="ops")) == \
        "notify/notify.test/test/20261204175930"


def test_the_webhook_body_is_the_same_bytes_on_every_attempt_and_says_what_happened() -> None:
    notice = parked_notice("d-1", "exit 1", 5, now=AT)
    key = idempotency_key(notice_workflow_id(notice), "webhook-1")
    body = webhook_body(notice, key)
    assert body == webhook_body(notice, key)
    assert json.loads(body) == {
        "id": "notify/deployment.parked/d-1/2026120417/webhook-1",
        "kind": "deployment.parked", "subject": "d-1", "at": "2026-12-04T17:59:30+00:00",
        "message": "parked after 5 failed start(s) in a row; last: exit 1; fix the spec or "
                   "`modelkeeper retry` it",
        "data": {"consecutive_failures": 5, "last_failure": "exit 1"}}
    assert json.loads(slack_body(notice)) == {
        "text": "[modelkeeper] deployment.parked d-1: parked after 5 failed start(s) in a "
                "row; last: exit 1; fix the spec or `modelkeeper retry` it"}


def test_a_signature_verifies_and_a_change_or_a_replay_does_not() -> None:
    body = b'{"kind":"deployment.parked"}'
    signed = signature("s3cret", 1_000_000, body)
    assert signed.startswith("v1=") and len(signed) == 3 + 64
    assert verify("s3cret", timestamp="1000000", body=body, signed=signed,
                  now=1_000_010) is None
    assert "does not match" in str(verify("s3cret", timestamp="1000000", body=body + b" ",
                                          signed=signed, now=1_000_010))
    assert "does not match" in str(verify("other", timestamp="1000000", body=body,
                                          signed=signed, now=1_000_010))
    # The timestamp is signed: moving it forward to pass the age check breaks the MAC.
    assert "does not match" in str(verify("s3cret", timestamp="1000900", body=body,
                                          signed=signed, now=1_000_910))
    assert "replay" in str(verify("s3cret", timestamp="1000000", body=body, signed=signed,
                                  now=1_000_301))
    assert "whole number" in str(verify("s3cret", timestamp="soon", body=body,
                                        signed=signed, now=1_000_000))


@pytest.mark.parametrize(("status", "ok", "retry"), [
    (200, True, False), (204, True, False), (400, False, False), (404, False, False),
    (408, False, True), (429, False, True), (500, False, True), (503, False, True)])
def test_which_answers_are_delivered_and_which_are_retried(status: int, ok: bool,
                                                           retry: bool) -> None:
    assert (delivered(status), worth_retrying(status)) == (ok, retry)


def test_cant_place_is_due_only_after_an_unbroken_stretch() -> None:
    since = AT - timedelta(minutes=4)
    assert cant_place_verdict(None, AT, after_s=600) == Recovered()
    assert cant_place_verdict(since, AT, after_s=600) == WaitFor(seconds=360.0)
    assert cant_place_verdict(since, AT + timedelta(minutes=6), after_s=600) == Due(
        since=since, for_s=600.0)


def test_targets_are_named_in_the_settings_order() -> None:
    settings = Settings(
        notify_webhook_urls="https://a.example/mk, https://b.example/mk",
        notify_slack_urls="https://hooks.slack.com/services/T/B/x")
    targets = targets_from(settings.notify_webhook_urls, settings.notify_slack_urls)
    assert [(t.name, t.format) for t in targets] == [
        ("webhook-1", TargetFormat.WEBHOOK), ("webhook-2", TargetFormat.WEBHOOK),
        ("slack-1", TargetFormat.SLACK)]
    assert targets[1].url == "https://b.example/mk"


def test_a_url_that_is_not_http_is_refused_without_echoing_it_whole() -> None:
    with pytest.raises(ValidationError) as info:
        Settings(notify_slack_urls="hooks.slack.com/services/T000/B000/SECRETPART")
    assert "'hooks.slack.'... is not an http(s) URL" in str(info.value)
    assert "SECRETPART" not in str(info.value).split("input_value")[0]


def test_a_notice_is_tolerant_of_fields_a_newer_worker_adds() -> None:
    raw = parked_notice("d-1", None, 5, now=AT).model_dump(mode="json")
    assert Notice.model_validate({**raw, "severity": "page"}).kind is NoticeKind.PARKED


def _answer(results: list[dict[str, Any]]) -> httpx.MockTransport:
    def answer(req: httpx.Request) -> httpx.Response:
        assert (req.method, req.url.path) == ("POST", "/notify/test")
        return httpx.Response(200, json={"results": results})
    return httpx.MockTransport(answer)


@pytest.mark.parametrize(("results", "code"), [
    ([{"target": "webhook-1", "format": "webhook", "delivered": True, "status": 200,
       "detail": "webhook-1: HTTP 200 ok"}], 0),
    ([{"target": "webhook-1", "format": "webhook", "delivered": True, "status": 200,
       "detail": "webhook-1: HTTP 200 ok"},
      {"target": "slack-1", "format": "slack", "delivered": False, "status": 404,
       "detail": "slack-1: HTTP 404 no_service"}], 1)])
def test_notify_test_reports_each_target_and_fails_if_one_failed(
        results: list[dict[str, Any]], code: int, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = httpx.Client
    monkeypatch.setattr(httpx, "Client",
                        lambda **kw: real(**{**kw, "transport": _answer(results)}))
    monkeypatch.setenv("MODELKEEPER_TOKEN", "mko-test")
    assert cli.run(["notify", "test", "--api-url", "http://api.test"]) == code
    shown = capsys.readouterr()
    assert "webhook-1 (webhook): delivered: webhook-1: HTTP 200 ok" in shown.out + shown.err
    if code:
        assert "1 of 2 notification target(s) failed" in shown.err
        assert "slack-1 (slack): FAILED: slack-1: HTTP 404 no_service" in shown.err


def test_the_docs_recipe_verifies_what_the_worker_signs() -> None:
    """docs/operations.md's verification recipe, run as written."""
    page = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    [block] = marked_blocks(page, "notify-recipe")
    assert block.lang == "python"
    scope: dict[str, Any] = {}
    exec(compile(block.body, "docs/operations.md", "exec"), scope)
    genuine = scope["genuine"]
    notice = parked_notice("d-1", None, 5, now=AT)
    body = webhook_body(notice, "k")
    now = int(time.time())
    headers = {"X-Modelkeeper-Timestamp": str(now),
               "X-Modelkeeper-Signature": signature("s3cret", now, body)}
    assert genuine(b"s3cret", headers, body)
    assert not genuine(b"other", headers, body)
    assert not genuine(b"s3cret", headers, body.replace(b"d-1", b"d-2"))
    old = {"X-Modelkeeper-Timestamp": str(now - 301),
           "X-Modelkeeper-Signature": signature("s3cret", now - 301, body)}
    assert not genuine(b"s3cret", old, body)


def test_only_the_api_and_the_worker_get_the_notification_settings_under_up() -> None:
    env = {"MODELKEEPER_NOTIFY_SLACK_URLS": "https://hooks.slack.com/services/T/B/x",
           "MODELKEEPER_NOTIFY_WEBHOOK_URLS": "https://a.example/mk",
           "MODELKEEPER_NOTIFY_SECRET_FILE": "/etc/modelkeeper/notify-secret"}
    for child in ("api", "worker", "gateway", "agent", "temporal-ui"):
        assert (stack.env_for(child, env) == env) == (child in ("api", "worker")), child
