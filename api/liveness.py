"""The liveness channel: each agent's long-lived ping stream, and what the API does when a
node goes silent.

Every agent keeps one ``POST /nodes/{node_id}/liveness`` open, its body a line every
``liveness_interval_s`` (``ping``, and ``bye`` before a planned stop). The rules that turn
pings, quiet stretches and broken streams into verdicts are the pure
:mod:`modelkeeper.domain.liveness`; this module reads the streams and carries the verdicts
out:

* a ping costs a dict update in memory: no database write, no Temporal call;
* a node that goes silent costs one UPDATE (``nodes.silent_since``, so placement skips it
  at once), one query for the replicas claiming on it, one audit event, and one
  ``node_silent`` signal to each affected deployment's workflow;
* a silent node that shows life again costs one UPDATE clearing the mark, and a nudge to
  the deployments waiting for room.

The state is this process's memory: an API that restarts starts with none, and hears from
each agent again when it reconnects (within a second or two). While no API runs, the
watch activities' heartbeat timeout (``watch_heartbeat_timeout_s``) is the backstop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from types import FrameType
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Request, Response
from starlette.requests import ClientDisconnect
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from modelkeeper.domain.events import NewEvent
from modelkeeper.domain.ids import DeploymentId, NodeId, ReplicaId
from modelkeeper.domain.liveness import (
    BYE,
    CameBack,
    Checked,
    Deadlines,
    Ended,
    Ending,
    LivenessEvent,
    NodeLiveness,
    Opened,
    Pinged,
    Verdict,
    WentSilent,
    check_at,
    is_current,
    step,
)
from modelkeeper.domain.nodes import NodeSilentInput
from modelkeeper.domain.notify import silent_notice
from modelkeeper.infra import notify
from modelkeeper.infra.http_server import release_body_deadline
from modelkeeper.names import deployment_workflow_id
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from workflows.deployment import DeploymentWorkflow

from .agents import NODE_AUTH_RESPONSES, authenticate_node
from .deps import StoreDep, TemporalDep
from .signals import signal_waiting_deployments

log = logging.getLogger(__name__)

router = APIRouter()

#: On every answer of the liveness route: the server then closes the socket. An answer
#: that comes before the body ends (a refusal, the API shutting down) reaches the agent
#: only that way: its HTTP client reads an answer once its body is sent, or once a write
#: fails. Nothing is lost by it: a stream's connection is never reused.
_CLOSE = {"Connection": "close"}

#: The longest line an agent may write; a ping is 5 bytes. A body with no newline in this
#: many bytes is not an agent's stream, and is refused rather than buffered.
MAX_LINE_BYTES = 256


#: How often the API measures its own event loop's lag (rule 8 of the liveness rules):
#: ten times a second is a few microseconds of CPU a second, and sees a stall of 0.1 s.
LAG_SAMPLE_S = 0.1
#: A check allows for the most lag seen over this long: a loop that fell behind a moment
#: ago still has pings queued from then, and bursts (a wave of verdicts, a GC pause) come
#: back within seconds.
LAG_WINDOW_S = 10.0


class LoopLag:
    """How far behind this process's event loop has run lately: :meth:`run` asks to wake
    every ``sample_s`` and records how late it woke; :meth:`recent_s` is the most of the
    last ``window_s``. A timer that wakes late waited behind the same queue of work as a
    ping's read, so its lateness is the delay a ping may have waited unread.

    The samples kept are the ones that can still be the most (a later, larger one hides
    every earlier one): the largest is always first, and few are kept.
    """

    def __init__(self, *, sample_s: float = LAG_SAMPLE_S,
                 window_s: float = LAG_WINDOW_S) -> None:
        self._sample_s = sample_s
        self._window_s = window_s
        #: (when, lag) in time order, lags decreasing.
        self._samples: deque[tuple[float, float]] = deque()

    def record(self, now: float, lag_s: float) -> None:
        """One sample: at ``now`` the loop woke ``lag_s`` late."""
        while self._samples and self._samples[-1][1] <= lag_s:
            self._samples.pop()
        self._samples.append((now, lag_s))

    def recent_s(self, now: float) -> float:
        """The most lag seen in the ``window_s`` before ``now``; 0 when none."""
        while self._samples and self._samples[0][0] < now - self._window_s:
            self._samples.popleft()
        return self._samples[0][1] if self._samples else 0.0

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            asked = time.monotonic()
            await asyncio.sleep(self._sample_s)
            now = time.monotonic()
            self.record(now, max(0.0, now - asked - self._sample_s))


class Liveness:
    """Every node's liveness as this API process sees it: a dict of small frozen records,
    stepped by :func:`modelkeeper.domain.liveness.step` at each ping.

    One per application (``app.state.liveness``). ``closing`` is set when the API begins to
    shut down: each stream then ends at once, without any verdict, so that the server's
    graceful shutdown does not wait on streams that never end by themselves. ``lag`` is the
    process's own lag, which each check allows for (rule 8); the application runs it.
    """

    def __init__(self, *, deadlines: Deadlines, lag: LoopLag | None = None) -> None:
        self.deadlines = deadlines
        self.lag = lag or LoopLag()
        self.closing = asyncio.Event()
        self._nodes: dict[NodeId, NodeLiveness] = {}
        self._streams = itertools.count(1)

    def open(self, node_id: NodeId, now: float) -> tuple[int, Verdict | None]:
        """A new stream for ``node_id``; it replaces any older one."""
        stream = next(self._streams)
        return stream, self.apply(node_id, Opened(stream, now))

    def apply(self, node_id: NodeId, event: LivenessEvent) -> Verdict | None:
        """Step the node's liveness by ``event``; the verdict to carry out, if any."""
        state, verdict = step(self._nodes.get(node_id), event, deadlines=self.deadlines)
        if state is None:
            self._nodes.pop(node_id, None)
        else:
            self._nodes[node_id] = state
        return verdict

    def check_at(self, node_id: NodeId, now: float) -> float | None:
        """When the node goes silent unless a ping arrives first (monotonic seconds), as
        this process's lag at ``now`` allows."""
        return check_at(self._nodes.get(node_id), deadlines=self.deadlines,
                        lag_s=self.lag.recent_s(now))

    def checked(self, stream: int, now: float) -> Checked:
        """A check of ``stream`` at ``now``, with this process's lag."""
        return Checked(stream, now, lag_s=self.lag.recent_s(now))

    def is_current(self, node_id: NodeId, stream: int) -> bool:
        """Whether ``stream`` is still the node's newest stream."""
        return is_current(self._nodes.get(node_id), stream)

    def state(self, node_id: NodeId) -> NodeLiveness | None:
        """The node's liveness; None when this process does not follow it."""
        return self._nodes.get(node_id)


async def _liveness(request: Request) -> Liveness:
    # async: a plain def would run in FastAPI's thread pool (see api/deps.py).
    liveness: Liveness = request.app.state.liveness
    return liveness


LivenessDep = Annotated[Liveness, Depends(_liveness)]


@router.post("/nodes/{node_id}/liveness", status_code=204, responses={
    **NODE_AUTH_RESPONSES,
    409: {"description": "A newer liveness stream of the node replaced this one."},
    503: {"description": "The API is shutting down: reconnect."}})
async def liveness_stream(node_id: NodeId, request: Request, store: StoreDep, *,
                          temporal: TemporalDep, liveness: LivenessDep,
                          authorization: Annotated[str | None, Header()] = None,
                          ) -> Response:
    """An agent's liveness stream, opened with its node's credential (``Authorization:
    Bearer``): a ``ping`` line every ``liveness_interval_s``, ``bye`` before a planned stop.
    Answered when the stream ends: 204 after ``bye``, 409 when a newer stream of the node
    replaced it, 503 when the API is shutting down; at once with 404 when the node is not
    registered (the agent registers again through its heartbeat), 401 or 403 without the
    node's own credential (no stream of another node is replaced, nothing is written).

    The one route whose body is not bounded (``limits.BodyLimit``) nor given a deadline
    (``release_body_deadline``): nothing of the body is read before the credential is
    checked, and then each line is bounded (``MAX_LINE_BYTES``)."""
    try:
        await authenticate_node(node_id, authorization, store)
    except HTTPException as refused:
        raise HTTPException(refused.status_code, refused.detail,
                            headers={**(refused.headers or {}), **_CLOSE}) from None
    # The node is who it says: its stream may outlive the server's body deadline.
    release_body_deadline(request.scope)
    cleared = await store.nodes.mark_node_alive(node_id, at=datetime.now(UTC))
    if cleared is None:
        raise HTTPException(404, f"node {node_id!r} is not registered", headers=_CLOSE)
    if cleared:
        # Silent before (this API's verdict, or an earlier API's): placement may use the
        # node again, so deployments waiting for room retry now.
        await signal_waiting_deployments(store, temporal)

    async def act(verdict: Verdict | None) -> None:
        try:
            await carry_out(verdict, node_id, store=store, temporal=temporal,
                            settings=request.app.state.settings)
        except Exception:  # the stream must outlive a verdict that failed
            # The database or Temporal is away. The stream lives on (the node is still
            # followed); a silence not told is backed up by the watches' heartbeat timeout.
            log.exception("node %s: could not carry out %s", node_id, verdict)

    stream, verdict = liveness.open(node_id, time.monotonic())
    await act(verdict)
    try:
        ending = await _follow(request.stream(), node_id, stream, liveness, act)
    except asyncio.CancelledError:
        # The server cancels what is left when its graceful shutdown runs out: the API is
        # going away, which says nothing about the node.
        liveness.apply(node_id, Ended(stream, time.monotonic(), Ending.API_CLOSING))
        raise
    if ending is None:
        return Response(f"replaced by a newer liveness stream of node {node_id}",
                        status_code=409, headers=_CLOSE)
    await act(liveness.apply(node_id, Ended(stream, time.monotonic(), ending)))
    match ending:
        case Ending.API_CLOSING:
            return Response("the API is shutting down; reconnect", status_code=503,
                            headers={**_CLOSE, "Retry-After": "1"})
        case Ending.BYE | Ending.BROKEN:
            return Response(status_code=204, headers=_CLOSE)


async def _follow(chunks: AsyncIterator[bytes], node_id: NodeId, stream: int,
                  liveness: Liveness,
                  act: Callable[[Verdict | None], Awaitable[None]]) -> Ending | None:
    """Read ``stream`` until it ends; how it ended, or None once a newer stream replaced it.

    Waits on one pending read at a time and never cancels it while the stream lives (a
    cancelled read would close the body's generator), so a quiet stretch is a timeout of
    the wait, stepped as :class:`Checked`.
    """
    read: asyncio.Future[bytes] | None = None
    closing: asyncio.Future[Any] = asyncio.ensure_future(liveness.closing.wait())
    partial = b""
    try:
        while liveness.is_current(node_id, stream):
            if read is None:
                read = asyncio.ensure_future(anext(chunks))
            checking = time.monotonic()
            due = liveness.check_at(node_id, checking)
            timeout = None if due is None else max(0.0, due - checking)
            waiting: set[asyncio.Future[Any]] = {read, closing}
            done, _ = await asyncio.wait(waiting, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            now = time.monotonic()
            if closing in done:
                return Ending.API_CLOSING
            if read not in done:
                await act(liveness.apply(node_id, liveness.checked(stream, now)))
                continue
            try:
                chunk = read.result()
            except (StopAsyncIteration, ClientDisconnect):
                return Ending.BROKEN  # only "bye" ends a stream on purpose
            read = None
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            if len(partial) > MAX_LINE_BYTES:
                log.warning("node %s: liveness stream is not line-based; ending it", node_id)
                return Ending.BROKEN
            if any(line.strip() == BYE for line in lines):
                return Ending.BYE
            if lines:
                await act(liveness.apply(node_id, Pinged(stream, now)))
        return None
    finally:
        for pending in (read, closing):
            if pending is not None and not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, ClientDisconnect,
                                         StopAsyncIteration):
                    await pending


async def carry_out(verdict: Verdict | None, node_id: NodeId, *, store: Store,
                    temporal: Client, settings: Settings | None = None) -> None:
    """Do what a liveness verdict asks."""
    match verdict:
        case WentSilent(reason=reason):
            await on_silent(node_id, reason, store=store, temporal=temporal,
                            settings=settings)
        case CameBack(silent_for_s=silent_for_s):
            if await store.nodes.mark_node_alive(node_id, at=datetime.now(UTC)):
                log.info("node %s is alive again after %.1fs silent", node_id, silent_for_s)
                await signal_waiting_deployments(store, temporal)
        case None:
            pass


async def on_silent(node_id: NodeId, reason: str, *, store: Store, temporal: Client,
                    settings: Settings | None = None) -> int:
    """A node went silent: keep placement off it, and tell each deployment with a replica
    there which of its replicas; then notify (with ``settings``; docs/operations.md,
    "Notifications"). Returns how many deployments were told."""
    if not await store.nodes.mark_node_silent(node_id, since=datetime.now(UTC)):
        return 0  # unregistered meanwhile (a fresh database): nothing claims on it
    affected = await store.nodes.replicas_on_node(node_id)
    told = await signal_node_silent(temporal, node_id, affected)
    log.warning("node %s went silent (%s); told %d deployment(s)", node_id, reason, told)
    await store.events.record_event(NewEvent(
        kind="node.silent", node_id=node_id,
        message=f"node {node_id} went silent: {reason}; told {told} deployment(s)",
        data={"reason": reason, "replicas": affected}))
    if settings is not None:
        await notify.notice_or_log(temporal, silent_notice(
            node_id, reason, {str(d): [str(r) for r in rs] for d, rs in affected.items()},
            now=datetime.now(UTC)), settings)
    return told


async def signal_node_silent(temporal: Client, node_id: NodeId,
                             affected: dict[DeploymentId, list[ReplicaId]]) -> int:
    """Signal ``node_silent`` to each deployment's workflow, naming its replicas on the
    node; all at once, so the last is not told later than the first. A workflow that no
    longer exists (deleted meanwhile) is skipped. Another failure (Temporal unreachable)
    is logged and skipped: that deployment's watches still time out
    (``watch_heartbeat_timeout_s``). Returns how many were signalled."""

    async def tell(deployment_id: DeploymentId, replica_ids: list[ReplicaId]) -> bool:
        handle = temporal.get_workflow_handle_for(DeploymentWorkflow.run,
                                                  deployment_workflow_id(deployment_id))
        try:
            await handle.signal(DeploymentWorkflow.node_silent,
                                NodeSilentInput(node_id=node_id, replica_ids=replica_ids))
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                log.warning("could not tell deployment %s that node %s went silent: %s",
                            deployment_id, node_id, err)
            return False
        return True

    sent = await asyncio.gather(*(tell(d, r) for d, r in affected.items()))
    return sum(sent)


#: Signals that begin a server's graceful shutdown (uvicorn's, and the usual ones).
_SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def end_streams_on_shutdown_signal(liveness: Liveness) -> Callable[[], None]:
    """Set ``liveness.closing`` as soon as a shutdown signal arrives, then pass the signal
    on to the handler that was there (the server's); returns what undoes it.

    Why: uvicorn's graceful shutdown waits for open requests before it runs the lifespan's
    shutdown, and a liveness stream never ends by itself; without this an API with agents
    connected would not stop on SIGTERM. Installed from the lifespan's startup, which runs
    inside the server's own signal capture; a no-op off the main thread, where signals
    cannot be handled.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        loop.call_soon_threadsafe(liveness.closing.set)
        before = previous[signum]
        if callable(before):
            before(signum, frame)
        elif before == signal.SIG_DFL:
            # Nothing else handled it: do what the default would have done.
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    for sig in _SHUTDOWN_SIGNALS:
        previous[sig] = signal.getsignal(sig)
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, before in previous.items():
            signal.signal(sig, before)

    return restore
