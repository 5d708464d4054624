"""The console's pages: what a viewer may read. Each reads what the API's own read
routes read (the same store calls, the same ``room`` and ``nodes`` views), and bounds its
lists: a page shows :data:`PAGE_SIZE` rows and links to the next.

``?part=live`` answers a page's live block alone, which the page polls (render.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Annotated, TypeVar
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import RedirectResponse, Response, StreamingResponse

from modelkeeper.domain.events import Event, EventFilter
from modelkeeper.domain.nodes import NodeState
from modelkeeper.domain.operations import OperationState

from .. import event_stream, room
from ..deps import SettingsDep, StoreDep
from ..monitoring import MAX_EVENTS_LIMIT
from ..nodes import node_info
from .render import page
from .session import (
    PREFIX,
    LoginNeeded,
    Session,
    check_origin,
    clear_session_cookie,
    session,
    set_session_cookie,
)

router = APIRouter(prefix=PREFIX, include_in_schema=False)

_T = TypeVar("_T")

LOGIN = f"{PREFIX}/login"
#: Rows a list shows at once: 300 nodes or deployments are three pages, each rendered in
#: a few milliseconds (bench/console, bench/results/console.md).
PAGE_SIZE = 100
#: Events the live panel shows, newest first; operations a page lists.
EVENTS_SHOWN = 100
OPERATIONS_SHOWN = 50
#: On a deployment's card: its newest events and operations.
CARD_EVENTS = 25
CARD_OPERATIONS = 10
#: A login form is a few hundred bytes; a token is 43 characters.
MAX_LOGIN_BODY = 4096

Part = Annotated[str | None, Query(pattern="^live$")]
Page = Annotated[int, Query(alias="page", ge=1, le=10_000)]


async def viewer(request: Request) -> Session:
    """The session of a read: a browser without one is sent to the login page (htmx's
    polling, by ``HX-Redirect``, so the whole page goes rather than its live block)."""
    try:
        return await session(request)
    except LoginNeeded as needed:
        if request.headers.get("hx-request"):
            raise HTTPException(401, needed.reason, headers={"HX-Redirect": LOGIN}) from None
        raise HTTPException(303, needed.reason, headers={"Location": LOGIN}) from None


Viewer = Annotated[Session, Depends(viewer)]


def _paged(rows: list[_T], number: int) -> tuple[list[_T], int]:
    """Page ``number`` of ``rows``, and how many pages there are."""
    pages = max(1, -(-len(rows) // PAGE_SIZE))
    start = (min(number, pages) - 1) * PAGE_SIZE
    return rows[start:start + PAGE_SIZE], pages


# -- login -------------------------------------------------------------------------------

@router.get("/login")
async def login_form(request: Request) -> Response:
    return page("login.html", session=None, error=None)


@router.post("/login")
async def login(request: Request, store: StoreDep) -> Response:
    """Check the token as the API would, then keep it in the session cookie."""
    check_origin(request)
    body = await request.body()
    if len(body) > MAX_LOGIN_BODY:
        return page("login.html", session=None, status_code=413,
                    error=f"the login form sent {len(body)} bytes; at most {MAX_LOGIN_BODY}")
    token = (parse_qs(body.decode(errors="replace")).get("token") or [""])[0].strip()
    if not token or await store.tokens.authenticate(token) is None:
        return page("login.html", session=None, status_code=401,
                    error="that is not an active operator token (`modelkeeper tokens ls` "
                          "lists them; `modelkeeper tokens create NAME --role viewer` makes "
                          "one; `up` wrote an admin one to <data_dir>/operator-token)")
    answer = RedirectResponse(PREFIX, status_code=303)
    set_session_cookie(answer, request, token)
    return answer


@router.post("/logout")
async def logout(request: Request) -> Response:
    check_origin(request)
    answer = RedirectResponse(LOGIN, status_code=303)
    clear_session_cookie(answer, request)
    return answer


# -- reads -------------------------------------------------------------------------------

@router.get("")
async def fleet(who: Viewer, store: StoreDep, settings: SettingsDep,
                part: Part = None) -> Response:
    """The fleet summary (GET /fleet's), with the operations running now."""
    summary = await room.fleet(store, settings)
    running = await store.operations.list_operations(state=OperationState.RUNNING,
                                                     limit=OPERATIONS_SHOWN)
    return page("fleet.html", session=who, part=part, fleet=summary, running=running)


@router.get("/nodes")
async def nodes(who: Viewer, store: StoreDep, settings: SettingsDep, part: Part = None,
                number: Page = 1) -> Response:
    """Nodes by name: state, memory bars, CPUs, GPUs, labels, last seen."""
    records = sorted(await store.nodes.list_nodes(), key=lambda r: (r.name, r.node_id))
    shown, pages = _paged(records, number)
    return page("nodes.html", session=who, part=part, nodes=[node_info(r, settings)
                                                               for r in shown],
                total=len(records), page=min(number, pages), pages=pages,
                states=list(NodeState))


@router.get("/deployments")
async def deployments(who: Viewer, store: StoreDep, part: Part = None,
                      number: Page = 1) -> Response:
    """Deployments by model: status, ready/desired, replicas by state, policy, reasons."""
    views = sorted(await store.deployments.list_deployments(),
                   key=lambda d: (d.model_id, d.deployment_id))
    shown, pages = _paged(views, number)
    return page("deployments.html", session=who, part=part, deployments=shown,
                total=len(views), page=min(number, pages), pages=pages)


@router.get("/deployments/{deployment_id}")
async def deployment(deployment_id: str, who: Viewer, store: StoreDep,
                     part: Part = None) -> Response:
    """A deployment's card: replicas and their nodes, its newest operations and events,
    and the actions. Its room for more loads apart (:func:`deployment_room`)."""
    view = await store.deployments.get_deployment(deployment_id)
    if view is None:
        return page("missing.html", session=who, part=part, status_code=404,
                    what=f"deployment {deployment_id!r} does not exist (or was deleted)")
    node_names = {}
    for node_id in sorted({n for r in view.replicas for n in r.nodes}):
        record = await store.nodes.get_node(node_id)
        node_names[node_id] = node_id if record is None else record.name
    events = await store.events.list_events(deployment_id=deployment_id, limit=CARD_EVENTS)
    operations = await store.operations.list_operations(deployment_id=deployment_id,
                                                        limit=CARD_OPERATIONS)
    models = [m.model_id for m in await store.catalog.list_models()]
    return page("deployment.html", session=who, part=part, d=view,
                node_names=node_names, events=list(reversed(events)),
                operations=operations, models=models)


@router.get("/deployments/{deployment_id}/room")
async def deployment_room(deployment_id: str, who: Viewer, store: StoreDep,
                          settings: SettingsDep) -> Response:
    """The card's room for more: GET /deployments/{id}/headroom's answer. Apart from the
    card, and refreshed less often (ROOM_POLL_MS): it judges the whole fleet once for
    each further replica it counts, which at 300 nodes costs more than the rest of the
    card together (bench/results/console.md)."""
    try:
        headroom: room.HeadroomView | None = await room.deployment_headroom(
            deployment_id, store, settings)
        why = None
    except HTTPException as refused:  # gone, or its model left the catalog
        headroom, why = None, str(refused.detail)
    return page("room.html", session=who, deployment_id=deployment_id, headroom=headroom,
                why=why)


@router.get("/operations")
async def operations(who: Viewer, store: StoreDep, part: Part = None) -> Response:
    """The newest operations (sagas) with their steps and compensations."""
    return page("operations.html", session=who, part=part,
                operations=await store.operations.list_operations(limit=OPERATIONS_SHOWN))


@router.get("/operations/{operation_id:path}")
async def operation(operation_id: str, who: Viewer, store: StoreDep,
                    part: Part = None) -> Response:
    """One operation: each step, its state and detail, and the outcome."""
    record = await store.operations.get(operation_id)
    if record is None:
        return page("missing.html", session=who, part=part, status_code=404,
                    what=f"operation {operation_id!r} does not exist")
    return page("operation.html", session=who, part=part, op=record)


@router.get("/events")
async def events(who: Viewer, store: StoreDep, part: Part = None,
                 deployment: str | None = None,
                 limit: int = Query(default=EVENTS_SHOWN, ge=1,
                                    le=MAX_EVENTS_LIMIT)) -> Response:
    """The audit log, newest first, optionally one deployment's (by id or model id, as
    GET /events/stream takes it); the page then follows it live (:func:`events_stream`)."""
    try:
        # A deployment's own id (the card's link) is looked up alone; a model id or a
        # deleted deployment's id as the stream resolves them (it reads every deployment).
        found_id = (None if not deployment
                    else await store.deployments.get_deployment(deployment))
        only = (EventFilter(deployment_id=found_id.deployment_id) if found_id is not None
                else await event_stream.event_filter(store, deployment=deployment or None,
                                                     node=None, kind=None))
    except HTTPException as refused:
        detail = refused.detail
        what = (detail[0].get("msg", str(detail)) if isinstance(detail, list) and detail
                and isinstance(detail[0], dict) else str(detail))
        return page("missing.html", session=who, part=part, status_code=404, what=what)
    found: list[Event] = await store.events.list_events(deployment_id=only.deployment_id,
                                                        limit=limit)
    return page("events.html", session=who, part=part, events=list(reversed(found)),
                deployment=deployment or "", limit=limit,
                last_id=max((e.event_id for e in found), default=None))


@router.get("/events/stream")
async def events_stream(request: Request, who: Viewer, store: StoreDep,
                        deployment: str | None = None,
                        after: int | None = Query(default=None, ge=0)) -> Response:
    """The events page's live feed: GET /events/stream (the API's own route, its filters,
    replay and bounds), for the session's cookie rather than a bearer token. Each entry
    comes as an unnamed message (a browser's EventSource hears every kind on one
    handler); its ``data`` is the entry's JSON, as the API sends it."""
    answer = await event_stream.stream_events(
        request, store, deployment=deployment or None, after=after,
        last_event_id=request.headers.get("last-event-id"))
    assert isinstance(answer, StreamingResponse)
    answer.body_iterator = _unnamed(answer.body_iterator)
    return answer


async def _unnamed(frames: AsyncIterable[str | bytes | memoryview[int]]
                   ) -> AsyncIterator[str]:
    """The frames with their ``event:`` line left out (the kind is in ``data`` too)."""
    async for frame in frames:
        text = frame if isinstance(frame, str) else bytes(frame).decode()
        yield "".join(line for line in text.splitlines(keepends=True)
                      if not line.startswith("event: "))
