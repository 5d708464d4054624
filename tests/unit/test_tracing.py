"""Tracing's one setting, what turning it on and off does to a process, and the API's
request spans, against an in-process OTLP collector. The gateway's spans:
tests/integration/test_traces_gateway.py; the whole path through `up`:
tests/integration/test_traces_up.py."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from temporalio.contrib.opentelemetry import TracingInterceptor

from api.app import create_app
from api.tracing import untraced
from cli.main import UsageError, build_parser, load_settings
from modelkeeper.infra import temporal, tracing
from modelkeeper.settings import Settings
from tests.support.otlp_receiver import OtlpReceiver, otlp_receiver


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as collector:
        tracing.setup(Settings(otlp_endpoint=collector.url), service="modelkeeper-api")
        try:
            yield collector
        finally:
            tracing.shutdown()


@pytest.mark.parametrize(("given", "kept"), [
    (None, None), ("", None), ("  ", None),
    ("http://127.0.0.1:4318", "http://127.0.0.1:4318"),
    ("https://otel.example.com:4318/", "https://otel.example.com:4318"),
    ("http://collector/otlp", "http://collector/otlp"),
])
def test_the_endpoint_is_a_base_url_or_nothing(given: str | None, kept: str | None) -> None:
    assert Settings(otlp_endpoint=given).otlp_endpoint == kept


@pytest.mark.parametrize(("given", "words"), [
    ("127.0.0.1:4318", "is not an http:// or https:// URL"),
    ("grpc://collector:4317", "is not an http:// or https:// URL"),
    ("http://collector:4318/v1/traces", "ends with /v1/traces"),
])
def test_a_bad_endpoint_is_one_sentence_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, given: str, words: str) -> None:
    monkeypatch.setenv("MODELKEEPER_OTLP_ENDPOINT", given)
    with pytest.raises(UsageError) as info:
        load_settings(build_parser().parse_args(["api"]))
    message = str(info.value)
    assert "MODELKEEPER_OTLP_ENDPOINT" in message and repr(given) in message, message
    assert words in message and "http://127.0.0.1:4318" in message


def test_off_by_default_nothing_is_set_up() -> None:
    assert Settings().otlp_endpoint is None
    assert tracing.setup(Settings(), service="modelkeeper-api") is False
    assert not tracing.ON
    assert temporal._tracing_interceptors() == []
    app = create_app(Settings(api_auth=False))
    assert not app._native_telemetry.enabled()
    with pytest.raises(RuntimeError, match="tracing is off"):
        tracing.tracer("x")


def test_on_the_temporal_client_carries_the_sdk_interceptor(receiver: OtlpReceiver) -> None:
    assert tracing.ON
    [interceptor] = temporal._tracing_interceptors()
    assert isinstance(interceptor, TracingInterceptor)
    tracing.shutdown()
    assert not tracing.ON and temporal._tracing_interceptors() == []


async def test_api_requests_are_spans_named_by_route_continuing_a_callers_trace(
        receiver: OtlpReceiver) -> None:
    app = create_app(Settings(api_auth=True))
    caller_trace, caller_span = "1" * 32, "2" * 16
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        spec = await http.get("/openapi.json",
                              headers={"traceparent": f"00-{caller_trace}-{caller_span}-01"})
        assert spec.status_code == 200
        # Refused at the door, before any route: traced too.
        refused = await http.get("/deployments/d-123", headers={"host": "evil.example"})
        assert refused.status_code == 400
        # Probes are not traced.
        assert (await http.get("/healthz", headers={"host": "evil.example"})).status_code == 400
    tracing.shutdown()
    spans = {s.name: s for s in receiver.received()}
    assert set(spans) == {"GET /openapi.json", "GET"}, set(spans)
    served = spans["GET /openapi.json"]
    assert (served.trace_id, served.parent_id) == (caller_trace, caller_span)
    assert served.service == "modelkeeper-api"
    assert served.attributes["http.route"] == "/openapi.json"
    assert served.attributes["http.response.status_code"] == 200
    # No route matched: the method alone names it, never the raw path with its id.
    unrouted = spans["GET"]
    assert unrouted.attributes["http.response.status_code"] == 400
    assert unrouted.attributes["url.path"] == "/deployments/d-123"
    assert unrouted.parent_id == ""


@pytest.mark.parametrize(("path", "left_out"), [
    ("/healthz", True), ("/metrics", True), ("/nodes/n-1/heartbeat", True),
    ("/nodes/n-1/liveness", True), ("/nodes/register", False), ("/deployments", False),
    ("/nodes/n-1", False), ("/deployments/heartbeat", False),
])
def test_machine_traffic_on_a_timer_is_left_out(path: str, left_out: bool) -> None:
    assert untraced({"type": "http", "path": path}) is left_out
