"""GET /events/stream (api/event_stream.py) against a real PostgreSQL: the hub hears
each appended entry through migration 0028's NOTIFY and fans it out by filter, a stream
replays what a client missed (``after``, ``Last-Event-ID``, an overflowed buffer), and the
route over real HTTP: a viewer's token, names resolved, the cap on streams (503) and a
slot freed when a client goes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from api.event_stream import HEARTBEAT_FRAME, EventHub, Subscription, stream_frames
from api.server import served
from modelkeeper.domain.events import Event, EventFilter, NewEvent
from modelkeeper.domain.ids import DeploymentId, NodeId
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.infra.processes import free_port
from modelkeeper.settings import Settings
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(60)

#: From an INSERT's commit to the entry at a subscriber: LISTEN/NOTIFY delivers in about
#: 0.4 ms (docs/FACTS), then one SELECT; generous for two loaded cores.
DELIVERY_BOUND_S = 2.0


def _entry(kind: str, *, deployment: str | None = None, node: str | None = None) -> NewEvent:
    return NewEvent(kind=kind, message=f"{kind} happened",
                    deployment_id=None if deployment is None else DeploymentId(deployment),
                    node_id=None if node is None else NodeId(node))


async def _next(subscription: Subscription, timeout_s: float = DELIVERY_BOUND_S) -> Event:
    event = await subscription.next(timeout_s)
    assert event is not None, f"no entry within {timeout_s}s"
    return event


@pytest.fixture
async def hub(database_url: str, store: Store) -> AsyncIterator[EventHub]:
    hub = EventHub(dsn=database_url, events=store.events, max_streams=3, buffer=4,
                   heartbeat_s=0.2)
    try:
        yield hub
    finally:
        await hub.close()


async def test_the_hub_hears_each_entry_once_and_hands_it_to_matching_streams(
        hub: EventHub, store: Store) -> None:
    before = await store.events.record_event(_entry("deployment.created", deployment="d1"))
    everything = await hub.subscribe(EventFilter())
    replicas_of_d1 = await hub.subscribe(EventFilter(deployment_id=DeploymentId("d1"),
                                                     kind="replica."))
    assert everything.start_id == before.event_id  # nothing from before it subscribed

    ready = await store.events.record_event(_entry("replica.ready", deployment="d1"))
    await store.events.record_event(_entry("replica.ready", deployment="d2"))
    await store.events.record_event(_entry("deployment.scaled", deployment="d1"))
    # An idempotent append that finds its key taken inserts, and announces, nothing.
    await store.events.record_event(_entry("node.cordoned", node="n1"), idempotency_key="k")
    await store.events.record_event(_entry("node.cordoned", node="n1"), idempotency_key="k")

    got = [await _next(everything)
           for _ in range(4)]
    assert [e.kind for e in got] == ["replica.ready", "replica.ready",
                                     "deployment.scaled", "node.cordoned"]
    assert [e.event_id for e in got] == sorted(e.event_id for e in got)
    assert (await _next(replicas_of_d1)) == ready
    await asyncio.sleep(0.2)  # nothing more arrives for either
    assert not everything.held and not replicas_of_d1.held


async def _frames(hub: EventHub, only: EventFilter, *, after: int | None,
                  count: int) -> list[str]:
    """The first ``count`` entry frames a stream sends (heartbeats and the retry line
    left out), its subscription made first."""
    subscription = await hub.subscribe(only)
    frames = stream_frames(hub, subscription, after=after)
    got: list[str] = []
    try:
        async with asyncio.timeout(DELIVERY_BOUND_S * 3):
            async for frame in frames:
                if frame.startswith("id: "):
                    got.append(frame)
                    if len(got) == count:
                        break
    finally:
        await frames.aclose()
    assert hub.streams == 0  # closing the stream left the hub
    return got


def _ids(frames: list[str]) -> list[int]:
    return [int(f.split("\n", 1)[0].removeprefix("id: ")) for f in frames]


async def test_a_stream_replays_past_after_then_goes_on_live(hub: EventHub,
                                                             store: Store) -> None:
    first = await store.events.record_event(_entry("replica.starting", deployment="d1"))
    second = await store.events.record_event(_entry("replica.ready", deployment="d1"))
    await store.events.record_event(_entry("replica.ready", deployment="d2"))

    async def later() -> int:
        await asyncio.sleep(0.3)
        return (await store.events.record_event(
            _entry("replica.stopped", deployment="d1"))).event_id

    live = asyncio.create_task(later())
    frames = await _frames(hub, EventFilter(deployment_id=DeploymentId("d1")),
                           after=first.event_id, count=2)
    assert _ids(frames) == [second.event_id, await live]
    event = json.loads(frames[0].split("data: ", 1)[1])
    assert (event["kind"], event["deployment_id"]) == ("replica.ready", "d1")


async def test_a_slow_client_misses_nothing_its_buffer_could_not_hold(
        hub: EventHub, store: Store) -> None:
    """Buffer 4, 12 entries before the stream reads any: it sends the 4 it holds, then
    replays the other 8 from the table, in order, each once."""
    subscription = await hub.subscribe(EventFilter(kind="replica."))
    frames = stream_frames(hub, subscription, after=None)
    assert (await anext(frames)).startswith("retry: ")
    ids = [(await store.events.record_event(_entry("replica.ready"))).event_id
           for _ in range(12)]
    async with asyncio.timeout(DELIVERY_BOUND_S):
        while not subscription.overflowed:
            await asyncio.sleep(0.01)
    got: list[str] = []
    async with asyncio.timeout(DELIVERY_BOUND_S * 3):
        async for frame in frames:
            if frame.startswith("id: "):
                got.append(frame)
            if len(got) == 12:
                break
    await frames.aclose()
    assert _ids(got) == ids


async def test_a_quiet_stream_sends_heartbeats(hub: EventHub) -> None:
    subscription = await hub.subscribe(EventFilter())
    frames = stream_frames(hub, subscription, after=None)
    try:
        assert (await anext(frames)).startswith("retry: ")
        async with asyncio.timeout(2):
            assert await anext(frames) == HEARTBEAT_FRAME
    finally:
        await frames.aclose()


async def test_a_listener_that_reconnects_hands_out_what_was_appended_meanwhile(
        hub: EventHub, store: Store, db: asyncpg.Connection) -> None:
    subscription = await hub.subscribe(EventFilter())
    listener = hub._listener
    pid = listener.backend_pid
    await store.events.record_event(_entry("a.before"))
    assert (await _next(subscription)).kind == \
        "a.before"
    # The listening session is killed; an entry is appended before it reconnects.
    await db.execute("SELECT pg_terminate_backend($1)", pid)
    missed = await store.events.record_event(_entry("a.meanwhile"))
    assert (await _next(subscription, 10)) == missed
    assert listener.connections == 2
    hub.unsubscribe(subscription)


# -- over HTTP ----------------------------------------------------------------------------

@pytest.fixture
async def served_api(local_temporal_env: WorkflowEnvironment, database_url: str,
                     ) -> AsyncIterator[tuple[str, dict[str, str], Store]]:
    """The API with operator tokens on, served on loopback, at most 2 streams: its URL, a
    viewer's headers, and its store."""
    client = local_temporal_env.client
    settings = Settings(database_url=database_url,
                        temporal_address=client.service_client.config.target_host,
                        temporal_namespace=client.namespace, api_port=free_port(),
                        api_event_streams=2)
    app = create_app(settings)
    async with served(app, settings) as url:
        store: Store = app.state.store
        _, token = await store.tokens.create_token("watcher", OperatorRole.VIEWER)
        yield url, {"Authorization": f"Bearer {token}"}, store


class Messages:
    """An open stream's messages, read through one line iterator (a new iterator per
    read would leave the last one suspended mid-stream)."""

    def __init__(self, resp: httpx.Response) -> None:
        self._lines = resp.aiter_lines()

    async def next(self, count: int) -> list[dict[str, str]]:
        """The next ``count`` messages (comments skipped), each as its fields."""
        messages: list[dict[str, str]] = []
        fields: dict[str, str] = {}
        async with asyncio.timeout(DELIVERY_BOUND_S * 3):
            while len(messages) < count:
                line = await anext(self._lines)
                if line == "":
                    if "id" in fields:
                        messages.append(fields)
                    fields = {}
                elif not line.startswith(":"):
                    name, _, value = line.partition(": ")
                    fields[name] = value
        return messages


async def test_the_route_streams_to_a_viewer_by_names_resumes_and_is_capped(
        served_api: tuple[str, dict[str, str], Store]) -> None:
    url, viewer, store = served_api
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId("n-box"), name="box",
        inventory=Inventory(memory_total_bytes=1 << 30, cpu_count=2)))
    await store.events.record_event(_entry("replica.ready", node="n-box"))
    first = await store.events.record_event(_entry("node.cordoned", node="n-box"))
    async with httpx.AsyncClient(base_url=url, headers=viewer, timeout=10) as http:
        # GET /events filters as the stream does, names included.
        listed = await http.get("/events", params={"node": "box", "kind": "node."})
        assert [e["event_id"] for e in listed.json()] == [first.event_id], listed.text
        unknown = await http.get("/events/stream", params={"deployment": "nope"})
        assert unknown.status_code == 422 and "nope" in unknown.text
        no_token = await http.get("/events/stream", headers={"Authorization": ""})
        assert no_token.status_code == 401

        async with http.stream("GET", "/events/stream",
                               params={"node": "box", "kind": "node."},
                               headers={"Last-Event-ID": str(first.event_id - 1)}) as one:
            assert one.status_code == 200
            assert one.headers["content-type"].startswith("text/event-stream")
            one_messages = Messages(one)
            [replayed] = await one_messages.next(1)
            assert replayed["id"] == str(first.event_id)
            assert replayed["event"] == "node.cordoned"
            assert json.loads(replayed["data"])["node_id"] == "n-box"

            async with http.stream("GET", "/events/stream") as two:
                assert two.status_code == 200
                third = await http.get("/events/stream")
                assert third.status_code == 503, third.text
                assert third.headers["retry-after"]
                assert "api_event_streams" in third.json()["detail"]
                await store.events.record_event(_entry("replica.ready"))
                live = await store.events.record_event(_entry("node.uncordoned",
                                                              node="n-box"))
                [message] = await Messages(two).next(1)
                assert message["event"] == "replica.ready"
                [followed] = await one_messages.next(1)
                assert followed["id"] == str(live.event_id)
        # Both clients went: their slots come free again (two streams open at once).
        async with asyncio.timeout(5):
            while True:
                async with http.stream("GET", "/events/stream") as one, \
                        http.stream("GET", "/events/stream") as two:
                    if (one.status_code, two.status_code) == (200, 200):
                        break
                await asyncio.sleep(0.05)
