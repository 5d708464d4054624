"""Traces through a real `modelkeeper up`, received by an in-process OTLP collector: one
trace from ``POST /deployments`` to the engine serving, across the API, the worker's
workflow and activities, and the agent's start of the engine; and a request through the
gateway continuing its client's trace.

The setting reaches every component the way an operator sets it: in `up`'s environment,
which `up` passes on to its children.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.test_up import Up
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: A sim model small enough that its engine's memory claim costs nothing here.
SIM = {"model_id": "sim-traced", "engine": "sim", "source": "sim", "memory_bytes": 64 << 20}
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
#: Generous: a 2-core machine starting a whole stack beside other tests.
SERVING_TIMEOUT_S = 120.0
#: Each component exports its batch this often (OTEL_BSP_SCHEDULE_DELAY, ms), not every
#: 5 s: the test waits for spans, not for a timer.
EXPORT_DELAY_MS = "200"


class TracedUp(Up):
    """`up` without the demo (a real llama.cpp start this test does not need)."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--no-demo"]


@pytest.fixture
def traced_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[
        tuple[TracedUp, OtlpReceiver]]:
    with otlp_receiver() as receiver:
        monkeypatch.setenv("MODELKEEPER_OTLP_ENDPOINT", receiver.url)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", EXPORT_DELAY_MS)
        stack = TracedUp(tmp_path / "data")
        try:
            yield stack, receiver
        finally:
            stack.kill_everything()


def named(spans: list[ReceivedSpan], name: str, service: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name and s.service == service]


def test_one_trace_follows_a_deploy_from_post_to_the_engine_serving(
        traced_up: tuple[TracedUp, OtlpReceiver]) -> None:
    up, receiver = traced_up
    up.start()
    api = f"http://127.0.0.1:{up.ports['api']}"
    with httpx.Client(base_url=api, headers=up.operator(), timeout=30) as http:
        assert http.post("/models", json=SIM).status_code == 201
        created = http.post("/deployments", json={"model_id": SIM["model_id"]})
        assert created.status_code == 201, created.text
        deployment_id = created.json()["deployment_id"]
        deadline = time.monotonic() + SERVING_TIMEOUT_S
        while (status := http.get(f"/deployments/{deployment_id}").json()["status"]) \
                != "serving":
            assert time.monotonic() < deadline, f"still {status}" + up.logs()
            time.sleep(0.2)

    [post] = named(receiver.wait_for(
        lambda spans: bool(named(spans, "POST /deployments", "modelkeeper-api")),
        timeout=30, what="the API's span of POST /deployments"),
        "POST /deployments", "modelkeeper-api")
    trace = post.trace_id

    def in_trace(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.trace_id == trace]

    # The engine is serving, so the agent's start of it has ended: its span follows.
    spans = in_trace(receiver.wait_for(
        lambda spans: bool(named(in_trace(spans), "RunActivity:start_shard",
                                 "modelkeeper-agent")),
        timeout=30, what="the agent's start_shard span in the deploy's trace"))
    by_id = {s.span_id: s for s in spans}

    def parent(span: ReceivedSpan) -> ReceivedSpan:
        return by_id[span.parent_id]

    def ancestors(span: ReceivedSpan) -> list[ReceivedSpan]:
        found = []
        while span.parent_id:
            span = parent(span)
            found.append(span)
        return found

    assert post.parent_id == "" and post.attributes["http.response.status_code"] == 201
    # Every API request is a trace of its own, named by its route's template.
    polled = [s for s in receiver.received() if s.service == "modelkeeper-api"
              and s.name == "GET /deployments/{deployment_id}"]
    assert polled and all(s.parent_id == "" for s in polled)
    [start] = named(spans, "StartWorkflow:DeploymentWorkflow", "modelkeeper-api")
    # Started by the route, inside FastAPI's span of the endpoint, inside the request's.
    assert [(s.name, s.service) for s in ancestors(start)] == [
        ("fastapi.endpoint", "modelkeeper-api"), ("POST /deployments", "modelkeeper-api")]
    [run] = named(spans, "RunWorkflow:DeploymentWorkflow", "modelkeeper-worker")
    assert parent(run) is start
    # The workflow's own activities on the control worker, and the node's on the agent,
    # each under the workflow's span for it.
    worker_activities = named_prefix(spans, "RunActivity:", "modelkeeper-worker")
    assert worker_activities, sorted({f"{s.service}: {s.name}" for s in spans})
    for activity in worker_activities:
        assert parent(activity).name == "StartActivity:" + activity.name.split(":", 1)[1]
    [engine_start] = named(spans, "RunActivity:start_shard", "modelkeeper-agent")
    scheduled = parent(engine_start)
    assert (scheduled.name, scheduled.service) == ("StartActivity:start_shard",
                                                   "modelkeeper-worker")
    assert scheduled.attributes["temporalWorkflowID"] == run.attributes["temporalWorkflowID"]
    assert engine_start.end_ns > post.end_ns  # the deploy went on after the API answered

    # The engine's first answer, through the gateway, continues its client's trace.
    answer = httpx.post(
        f"http://127.0.0.1:{up.ports['gateway']}/v1/chat/completions", timeout=30,
        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
        json={"model": SIM["model_id"], "max_tokens": 2,
              "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200, answer.text
    gateway = receiver.wait_for(
        lambda spans: any(s.trace_id == CLIENT_TRACE and s.name == "upstream"
                          for s in spans),
        timeout=30, what="the gateway's upstream span in the client's trace")
    request = [s for s in gateway if s.trace_id == CLIENT_TRACE
               and s.name == "POST /v1/chat/completions"]
    assert [(s.service, s.parent_id) for s in request] == [("modelkeeper-gateway",
                                                            CLIENT_SPAN)]
    print(f"{len(spans)} spans in the deploy's trace: "
          + ", ".join(sorted({f'{s.service}: {s.name}' for s in spans})), file=sys.stderr)
    print("all: " + ", ".join(sorted({f'{s.service}: {s.name}' for s in receiver.received()})),
          file=sys.stderr)


def named_prefix(spans: list[ReceivedSpan], prefix: str, service: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name.startswith(prefix) and s.service == service]
