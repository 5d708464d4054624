"""``GET /events/stream``: the audit log live, as server-sent events (a viewer's route).

Each message is one entry of the ``events`` table::

    id: 1234
    event: deployment.serving
    data: {"kind": "deployment.serving", "message": "...", "event_id": 1234, ...}

``data`` is the entry as :class:`~modelkeeper.domain.events.Event` (GET /events answers
the same JSON). A client that reconnects sends ``Last-Event-ID`` (a browser's EventSource
does it by itself) or ``?after=ID``: the stream first replays every entry past it that the
filters let through, from the table, then goes on live. Without either it sends only what
is appended from then on (GET /events gives the history first; ``modelkeeper events``
does both). A comment line (``: keepalive``) every :data:`HEARTBEAT_S` keeps proxies from
closing a quiet stream.

How the API hears of new rows: one :class:`EventHub` per API process LISTENs on
:data:`~modelkeeper.names.EVENTS_CHANNEL` (migration 0028's trigger sends each new event
id) on one dedicated connection, reads the announced rows in one query per batch, and
hands each to the streams whose filters it passes. So the database sees one connection and
one read per batch of entries, however many clients watch; polling would cost each process
a query every interval even when nothing happens, and add up to that interval of delay.

Bounded: at most ``api_event_streams`` streams per process (one more gets a 503 with
Retry-After), and each stream buffers at most :data:`STREAM_BUFFER` entries. A client that
reads more slowly than entries arrive does not grow the API's memory: its buffer stops
taking entries, and once it has sent what it holds, the stream replays what it missed from
the table, as a reconnecting client's would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Annotated, Any

import asyncpg
from fastapi import APIRouter, Header, HTTPException, Query, Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from modelkeeper.domain.events import Event, EventFilter
from modelkeeper.domain.ids import DeploymentId
from modelkeeper.names import EVENTS_CHANNEL
from modelkeeper.store import Store
from modelkeeper.store.events import EventStore
from modelkeeper.store.routing import ChangeListener

from .deps import StoreDep
from .nodes import resolve_node_ids

log = logging.getLogger(__name__)

router = APIRouter()

#: A comment line this often on a quiet stream: proxies and load balancers commonly close
#: a connection idle for 30 to 60 s, and a client learns within this long that the API
#: went away.
HEARTBEAT_S = 15.0
#: Entries one stream holds for a client that has not read them yet: a burst of a busy
#: cluster (a drain of a full node is a few dozen); past it the stream catches up from
#: the table instead. At about 1 KB an entry, 256 KB per client at worst.
STREAM_BUFFER = 256
#: Entries a replay reads per query (a client resuming far back pages through them).
REPLAY_PAGE = 500
#: Entry ids the hub remembers having handed out, so an entry both read after a
#: reconnection and then announced is handed out once.
HUB_SEEN_IDS = 4096
#: How long a stream waits for the hub's LISTEN connection before answering 503.
LISTEN_TIMEOUT_S = 10.0
#: What a 503 for too many streams asks the client to wait.
RETRY_AFTER_S = 5
#: A browser's EventSource waits this long (ms) before reconnecting after a drop.
RECONNECT_MS = 3000
#: The comment line a quiet stream sends.
HEARTBEAT_FRAME = ": keepalive\n\n"


def sse_frame(event: Event) -> str:
    """One server-sent event of an entry: ``id``, ``event`` (its kind) and ``data`` (its
    JSON, one line). A kind is a code constant, but a line break in one would end the
    frame early: it is written as a space."""
    kind = " ".join(event.kind.splitlines())
    return f"id: {event.event_id}\nevent: {kind}\ndata: {event.model_dump_json()}\n\n"


class StreamsFull(Exception):
    """The process serves as many streams as ``api_event_streams`` allows."""


class Subscription:
    """One stream's place at the hub: its filter and its bounded buffer of entries.

    A deque and an event rather than an ``asyncio.Queue``: the stream waits for an entry
    with a timeout (its heartbeat), and on Python 3.11 ``wait_for(queue.get(), t)`` can
    drop an item that arrives as the timeout fires. Waiting on the event loses nothing."""

    def __init__(self, only: EventFilter, *, buffer: int, start_id: int) -> None:
        self.only = only
        self.buffer = buffer
        self.held: deque[Event] = deque()
        #: Set whenever an entry is held, or dropped: the stream has something to do.
        self.ready = asyncio.Event()
        #: Set when an entry found the buffer full (and was dropped): the stream replays
        #: from the table once it has sent what the buffer holds.
        self.overflowed = False
        #: The newest entry id when the stream began: where a stream that has sent
        #: nothing yet replays from after an overflow.
        self.start_id = start_id

    def offer(self, event: Event) -> None:
        if not self.only.matches(event):
            return
        if len(self.held) >= self.buffer:
            self.overflowed = True
        else:
            self.held.append(event)
        self.ready.set()

    async def next(self, timeout_s: float) -> Event | None:
        """The oldest entry held, waiting up to ``timeout_s`` for one; None when none
        came (or the buffer overflowed and is empty: :attr:`overflowed` says)."""
        if not self.held and not self.overflowed:
            self.ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ready.wait(), timeout_s)
        return self.held.popleft() if self.held else None


class EventHub:
    """One API process's listener on the audit log, fanning entries out to its streams.

    Started by the first stream (a process nobody watches holds no extra connection),
    closed with the app. ``listener`` builds the LISTEN connection (tests pass their own).
    """

    def __init__(self, *, dsn: str, events: EventStore, max_streams: int,
                 buffer: int = STREAM_BUFFER, heartbeat_s: float = HEARTBEAT_S,
                 listener: Callable[..., ChangeListener] = ChangeListener) -> None:
        self.events = events
        self.max_streams = max_streams
        self.buffer = buffer
        self.heartbeat_s = heartbeat_s
        self._listener = listener(dsn, (EVENTS_CHANNEL,), self._notified, self._connected)
        self._subscriptions: set[Subscription] = set()
        self._pending: list[int] = []
        self._wake = asyncio.Event()
        self._start_lock = asyncio.Lock()
        self._pump: asyncio.Task[None] | None = None
        self._seen: set[int] = set()
        self._seen_order: deque[int] = deque()
        #: The newest entry id handed out (or in the table when the hub started).
        self.last_id: int | None = None

    @property
    def streams(self) -> int:
        """Streams open now."""
        return len(self._subscriptions)

    async def subscribe(self, only: EventFilter) -> Subscription:
        """A new stream's subscription; ``StreamsFull`` past ``max_streams``."""
        if len(self._subscriptions) >= self.max_streams:
            raise StreamsFull
        await self._start()
        if len(self._subscriptions) >= self.max_streams:  # others came while it started
            raise StreamsFull
        assert self.last_id is not None  # set by the listener's first connection
        subscription = Subscription(only, buffer=self.buffer, start_id=self.last_id)
        self._subscriptions.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscriptions.discard(subscription)

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        await self._listener.close()

    async def _start(self) -> None:
        async with self._start_lock:
            if self._pump is not None:
                return
            await self._listener.start(timeout_s=LISTEN_TIMEOUT_S)
            self._pump = asyncio.create_task(self._read_announced(), name="event-hub")

    def _notified(self, _channel: str, payload: str) -> None:
        try:
            self._pending.append(int(payload))
        except ValueError:
            log.warning("ignored a notification on %s that is no event id: %r",
                        EVENTS_CHANNEL, payload[:100])
            return
        self._wake.set()

    async def _connected(self) -> None:
        """After each (re)connection, LISTEN in place: the first time, note where the log
        ends; later, read what was appended while no notification could arrive."""
        if self.last_id is None:
            self.last_id = await self.events.last_event_id()
            return
        while True:
            page = await self.events.events_after(self.last_id, limit=REPLAY_PAGE)
            for event in page:
                self._publish(event)
            if len(page) < REPLAY_PAGE:
                return

    async def _read_announced(self) -> None:
        """Read the announced entries, a batch per query, and hand them out in id order.
        A read that fails (the database restarting) keeps its ids for the next try."""
        delay = 0.1
        while True:
            await self._wake.wait()
            self._wake.clear()
            ids, self._pending = self._pending, []
            try:
                found = await self.events.events_by_ids(ids)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("cannot read %d announced event(s) (%s); retrying in %.1fs",
                            len(ids), exc, delay)
                self._pending[:0] = ids
                self._wake.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.1
            for event in found:
                self._publish(event)

    def _publish(self, event: Event) -> None:
        if event.event_id in self._seen:
            return
        self._seen.add(event.event_id)
        self._seen_order.append(event.event_id)
        if len(self._seen_order) > HUB_SEEN_IDS:
            self._seen.discard(self._seen_order.popleft())
        self.last_id = max(self.last_id or 0, event.event_id)
        for subscription in self._subscriptions:
            subscription.offer(event)


async def stream_frames(hub: EventHub, subscription: Subscription, *,
                        after: int | None) -> AsyncGenerator[str, None]:
    """What one stream sends: the replay past ``after`` (None: none), then each live
    entry, a heartbeat while it is quiet, and a replay of what it missed whenever its
    buffer overflowed. Leaves the hub when the client goes (the generator is closed)."""
    try:
        yield f"retry: {RECONNECT_MS}\n\n"
        sent_last = after
        replay_from = after
        while True:
            # Ids sent by the replay that the buffer may hold too (it fills meanwhile).
            replayed: deque[int] = deque(maxlen=2 * hub.buffer + REPLAY_PAGE)
            while replay_from is not None:
                page = await hub.events.events_after(replay_from, only=subscription.only,
                                                     limit=REPLAY_PAGE)
                for event in page:
                    yield sse_frame(event)
                    replayed.append(event.event_id)
                    sent_last = replay_from = event.event_id
                if len(page) < REPLAY_PAGE:
                    break
            skip = set(replayed)
            while True:
                if subscription.overflowed and not subscription.held:
                    subscription.overflowed = False
                    replay_from = subscription.start_id if sent_last is None else sent_last
                    break
                live = await subscription.next(hub.heartbeat_s)
                if live is None:
                    if not subscription.overflowed:
                        yield HEARTBEAT_FRAME
                    continue
                if live.event_id in skip:
                    continue
                yield sse_frame(live)
                sent_last = max(sent_last or 0, live.event_id)
    finally:
        hub.unsubscribe(subscription)


def _after(after: int | None, last_event_id: str | None) -> int | None:
    """Where the replay starts: ``Last-Event-ID`` (a reconnecting EventSource's), else
    ``after``; a 422 naming the header for one that is not an entry id."""
    if last_event_id is None or not last_event_id.strip():
        return after
    try:
        value = int(last_event_id.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise HTTPException(422, f"Last-Event-ID {last_event_id[:40]!r}: must be an event "
                                 "id, a whole number 0 or more")
    return value


async def _deployment_id(store: Store, ref: str) -> DeploymentId:
    """The deployment ``ref`` names by id or model id; a deployment gone but in the log
    by that id is followed too (its history replays). A 422 naming it otherwise."""
    deployments = await store.deployments.list_deployments()
    by_id = next((d for d in deployments if d.deployment_id == ref), None)
    if by_id is not None:
        return by_id.deployment_id
    named = [d for d in deployments if d.model_id == ref]
    if len(named) == 1:
        return named[0].deployment_id
    if not named and await store.events.events_after(
            0, only=EventFilter(deployment_id=DeploymentId(ref)), limit=1):
        return DeploymentId(ref)
    known = ", ".join(sorted(d.model_id for d in deployments)) or "none"
    raise HTTPException(422, [{
        "loc": ["query", "deployment"], "type": "value_error", "input": ref,
        "msg": f"no deployment has the id or model id {ref!r} (deployed models: {known})"}])


async def event_filter(store: Store, *, deployment: str | None, node: str | None,
                       kind: str | None) -> EventFilter:
    """The filter the query names: a deployment by id or model id, a node by id or name
    (a 422 naming the one that names nothing), a kind or a kind prefix. An empty value
    (a form's blank field) filters nothing."""
    deployment, node = deployment or None, node or None
    return EventFilter(
        deployment_id=None if deployment is None else await _deployment_id(store, deployment),
        node_id=None if node is None else (await resolve_node_ids(
            store, [node], loc=("query", "node")))[0],
        kind=kind)


# Not in the OpenAPI spec, as /metrics: a response that never ends is no JSON a generated
# client or a fuzzer could read (schemathesis would wait out its timeout on each case).
# docs/operations.md documents it.
@router.get("/events/stream", include_in_schema=False)
async def stream_events(
    request: Request, store: StoreDep,
    deployment: Annotated[str | None, Query(
        description="only this deployment's entries: its id or model id")] = None,
    node: Annotated[str | None, Query(description="only this node's: its id or name")] = None,
    kind: Annotated[str | None, Query(
        min_length=1, max_length=64,
        description="only this kind, or kinds starting with it when it ends in '.' "
                    "(replica.)")] = None,
    after: Annotated[int | None, Query(
        ge=0, description="replay the entries past this event id first")] = None,
    last_event_id: Annotated[str | None, Header(
        description="as after; sent by a reconnecting EventSource, and wins")] = None,
) -> StreamingResponse:
    """The audit log live, as server-sent events; filters combine (all must hold)."""
    start = _after(after, last_event_id)
    only = await event_filter(store, deployment=deployment, node=node, kind=kind)
    hub: EventHub = request.app.state.event_hub
    try:
        subscription = await hub.subscribe(only)
    except StreamsFull:
        raise HTTPException(503, f"this API process serves at most {hub.max_streams} event "
                                 "streams at once (api_event_streams), and that many are "
                                 f"open; retry in {RETRY_AFTER_S}s",
                            headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except TimeoutError:
        raise HTTPException(503, "the event stream cannot listen to the database now; "
                                 f"retry in {RETRY_AFTER_S}s",
                            headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    return _EventStream(
        stream_frames(hub, subscription, after=start), media_type="text/event-stream",
        # No proxy may cache or buffer it (X-Accel-Buffering: nginx's buffering).
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        on_end=lambda: hub.unsubscribe(subscription))


class _EventStream(StreamingResponse):
    """A stream that leaves the hub however it ends, even before its first frame (a
    generator closed before it started runs no ``finally``)."""

    def __init__(self, content: AsyncIterator[str], *, on_end: Callable[[], None],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()
