"""What the gateway says when it cannot pass a request on: OpenAI-shaped error bodies,
and the reason a model cannot be served right now, taken from its deployment.

Every error the gateway answers, its own and an engine's, has one shape, OpenAI's:
``{"error": {"message": str, "type": str, "param": str | null, "code": str}}``. Its own
errors may add fields to the object (the known models, a deployment's status and
reason); an engine's error is rewritten into that shape by :func:`engine_error`, since
engines differ (llama.cpp gives a numeric code and no ``param``, older vLLM and SGLang
put the fields at the top level, a FastAPI server answers ``{"detail": ...}``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.store.routing import DeploymentRoute

#: What ASGI wants for headers.
Headers = list[tuple[bytes, bytes]]

JSON_CONTENT_TYPE = b"application/json"
JSON_HEADERS: Headers = [(b"content-type", JSON_CONTENT_TYPE)]


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes."""
    return json.dumps(obj, separators=(",", ":")).encode()


@dataclass(frozen=True)
class ErrorReply:
    """An error answer: status, OpenAI ``error`` object, extra headers."""

    status: int
    message: str
    type: str
    code: str
    #: Fields added to the ``error`` object (known models, deployment status, reason).
    extra: dict[str, Any] = field(default_factory=dict)
    headers: Headers = field(default_factory=list)
    #: The request field the error is about (``messages``, ``max_tokens``); None: none.
    param: str | None = None

    def body(self) -> bytes:
        """The JSON body: ``{"error": {...}}`` as the OpenAI API shapes it."""
        return error_json(self.message, self.type, self.code, param=self.param,
                          extra=self.extra)


def error_json(message: str, type_: str, code: str, *, param: str | None = None,
               extra: dict[str, Any] | None = None) -> bytes:
    """An error body, ``{"error": {...}}``, as the OpenAI API shapes it: for
    :class:`ErrorReply`, and for the answers the HTTP protocol writes below the app."""
    return dumps({"error": {"message": message, "type": type_, "param": param,
                            "code": code, **(extra or {})}})


def bad_request(message: str, code: str = "invalid_request", *,
                param: str | None = None) -> ErrorReply:
    """400: the request itself is wrong (``param``: in this field)."""
    return ErrorReply(400, message, "invalid_request_error", code, param=param)


def unauthorized(message: str) -> ErrorReply:
    """401 with the header that tells a client which scheme to use."""
    return ErrorReply(401, message, "authentication_error", "invalid_api_key",
                      headers=[(b"www-authenticate", b"Bearer")])


def unknown_model(model: str, known: Iterable[str]) -> ErrorReply:
    """404 naming the known models, so a typo reads as a typo and not as "loading"."""
    names = sorted(known)
    listed = ", ".join(names) if names else "none are deployed"
    return ErrorReply(404, f"The model `{model}` does not exist. Known models: {listed}.",
                      "invalid_request_error", "model_not_found", {"known_models": names},
                      param="model")


def unrouted(path: str, what: str) -> ErrorReply:
    """404 for a route an engine may serve that the gateway does not pass on."""
    return ErrorReply(404, f"This gateway does not route {path} ({what}) to its engines; "
                      "use /v1/chat/completions or /v1/completions.",
                      "invalid_request_error", "unsupported_route")


def upstream_failed(model: str, why: str, status: int = 502, *,
                    waited_s: float | None = None) -> ErrorReply:
    """502/504: the engines were there but failed this request. ``waited_s``: the request
    was then held that long (since it arrived) for a replica to retry on, in vain."""
    message = f"No replica of `{model}` could answer: {why}"
    if waited_s is not None:
        message += f". None it could be retried on was ready within {waited_s:.1f}s."
    return ErrorReply(status, message, "upstream_error", "upstream_unavailable")


#: An engine's error type by HTTP status, for one that gives none as a string: OpenAI's
#: types for what the client did wrong, ``upstream_error`` (as for the gateway's own 502)
#: for what failed at the engine.
_ENGINE_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                       403: "permission_error", 404: "invalid_request_error",
                       413: "invalid_request_error", 422: "invalid_request_error",
                       429: "rate_limit_error"}
#: An engine's error code by HTTP status, for one that gives none as a string (llama.cpp
#: and vLLM give the status itself, a number). Any other status: ``engine_error``.
_ENGINE_ERROR_CODES = {400: "invalid_request", 401: "engine_key_refused",
                       403: "forbidden", 404: "not_found", 413: "body_too_large",
                       422: "invalid_request", 429: "rate_limit_exceeded",
                       501: "not_implemented", 503: "engine_unavailable"}
ENGINE_ERROR_CODE = "engine_error"
#: Characters of a body that is not an error object kept as the message: enough for a
#: sentence or a short traceback line, not a whole HTML page.
_ENGINE_TEXT_CHARS = 500


def engine_error(status: int, data: bytes) -> ErrorReply:
    """An engine's error answer (``status`` >= 400, body ``data``) in the gateway's shape:
    its message, type, param and code where it gives them as strings, else a type and
    code from the status and, for a body that is no error object, its text as the
    message. Never raises: whatever an engine sends, the client gets the one shape."""
    found: dict[str, Any] = {}
    try:
        parsed = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict):
        inner = parsed.get("error")
        if isinstance(inner, dict):
            found = inner  # OpenAI, llama.cpp, newer vLLM
        elif isinstance(inner, str):
            found = {"message": inner, "type": parsed.get("error_type")}  # TGI
        elif "message" in parsed:
            found = parsed  # older vLLM and SGLang: the fields at the top level
        elif isinstance(parsed.get("detail"), str):
            found = {"message": parsed["detail"]}  # a FastAPI server's own errors
    message = _text(found.get("message"))
    if message is None:
        shown = data.decode("utf-8", errors="replace").strip()[:_ENGINE_TEXT_CHARS]
        message = shown or f"the engine answered HTTP {status} with no message"
    kind = _text(found.get("type")) or _ENGINE_ERROR_TYPES.get(status, "upstream_error")
    code = _text(found.get("code")) or _ENGINE_ERROR_CODES.get(status, ENGINE_ERROR_CODE)
    return ErrorReply(status, message, kind, code, param=_text(found.get("param")),
                      extra=_engine_details(found))


#: Fields of an engine's error object besides OpenAI's four that the client gets too:
#: llama.cpp's context overflow names the prompt's tokens and the context
#: (``n_prompt_tokens``, ``n_ctx``), which a client needs to shorten its prompt (issue
#: 27: they were dropped). Numbers and short words only, and a few of them: the body is
#: an engine's, and the one shape must stay small.
_DETAIL_FIELDS = 8
_DETAIL_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
_DETAIL_TEXT_CHARS = 64


def _engine_details(found: dict[str, Any]) -> dict[str, Any]:
    details: dict[str, Any] = {}
    for name, value in found.items():
        if len(details) == _DETAIL_FIELDS:
            break
        if name in ("message", "type", "code", "param", "object") or not isinstance(name, str) \
                or not _DETAIL_NAME.fullmatch(name):
            continue
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float) or (
                isinstance(value, str) and len(value) <= _DETAIL_TEXT_CHARS):
            details[name] = value
    return details


def _text(value: object) -> str | None:
    """``value`` when it is a non-empty string, else None."""
    return value if isinstance(value, str) and value else None


def hopeless(route: DeploymentRoute) -> ErrorReply | None:
    """The answer for a model that will not have a ready replica without an operator (or a
    node change), so it is given at once: waiting, or "retry shortly", would be a lie.
    None when a replica may become ready by itself (placing, starting, degraded: a
    replacement for the unreachable replica is on its way).

    ``stopped`` is answered at once only while it still wants 0 replicas: the API records a
    scale-up the keeper accepted before the keeper writes its next status, and a stopped
    deployment that wants replicas is one with a replica on its way. One that loads on
    demand is never stopped for good: a request loads it. One switched off (max 0) is
    answered at once whatever its status says, unless a replica is wanted all the same.
    """
    match route.status:
        case DeploymentStatus.PARKED:
            return _parked(route)
        case DeploymentStatus.CANT_PLACE:
            return _cant_place(route)
        case DeploymentStatus.DELETING:
            return ErrorReply(503, f"`{route.model_id}` is being deleted.",
                              "service_unavailable", "model_deleting",
                              {**_about(route), "reason": "deleting"})
        case _ if route.switched_off and route.desired_replicas == 0:
            return _switched_off(route)
        case DeploymentStatus.STOPPED if (route.desired_replicas == 0
                                          and not route.loads_on_demand):
            return _scaled_to_zero(route)
        case _:
            return None


def _about(route: DeploymentRoute) -> dict[str, Any]:
    """The fields every deployment answer adds to the ``error`` object."""
    return {"model": route.model_id, "status": route.status}


def _parked(route: DeploymentRoute) -> ErrorReply:
    reason = route.last_failure or "too many failed starts in a row"
    return ErrorReply(
        503, f"`{route.model_id}` is parked after {route.consecutive_failures} failed starts "
        f"in a row; last failure: {reason}. It stays down until an operator changes or "
        "retries the deployment.", "service_unavailable", "model_parked",
        {**_about(route), "reason": reason})


def _cant_place(route: DeploymentRoute) -> ErrorReply:
    reason = route.placement_error or "no node has room for it"
    return ErrorReply(
        503, f"`{route.model_id}` cannot be placed: {reason}. It is served once a node with "
        "room joins or frees up.", "service_unavailable", "model_cant_place",
        {**_about(route), "reason": reason})


def _scaled_to_zero(route: DeploymentRoute) -> ErrorReply:
    reason = "scaled to zero replicas"
    return ErrorReply(
        503, f"`{route.model_id}` is {reason}: its deployment is stopped. It is served again "
        "once an operator scales it up.", "service_unavailable", "model_stopped",
        {**_about(route), "reason": reason})


def _switched_off(route: DeploymentRoute) -> ErrorReply:
    reason = "switched off: its scaling policy allows 0 replicas (max_replicas 0)"
    return ErrorReply(
        503, f"`{route.model_id}` is {reason}, so no request loads it. It is served once an "
        "operator raises its max_replicas.", "service_unavailable", "model_stopped",
        {**_about(route), "reason": reason})


def loading(route: DeploymentRoute, *, waited_s: float, retry_after_s: int) -> ErrorReply:
    """503 for a model that loads on demand (or wakes) and had no ready replica within the
    request's load wait: with Retry-After, what it is doing, and since when and why it
    loads. Distinct from :func:`unknown_model` (which never loads anything) and from
    :func:`not_ready` (a replica that should be there is not)."""
    reason = _why_loading(route)
    since = route.loading_since.isoformat() if route.loading_since is not None else None
    shown = reason if since is None else f"{reason}, since {since}"
    return ErrorReply(
        503, f"`{route.model_id}` is loading ({shown}): no replica was ready within "
        f"{waited_s:.1f}s. Retry after {retry_after_s}s.", "service_unavailable",
        "model_loading", {**_about(route), "reason": reason, "loading_since": since},
        headers=[(b"retry-after", str(retry_after_s).encode())])


def _why_loading(route: DeploymentRoute) -> str:
    """What a deployment that loads on demand is doing while no replica of it is ready:
    the control plane's own reason while it shows ``loading``, else its status in words."""
    match route.status:
        case DeploymentStatus.LOADING:
            return route.loading_reason or "its first replica is on its way"
        case DeploymentStatus.SLEEPING:
            return "it is asleep and being woken"
        case DeploymentStatus.IDLE:
            return "none of it runs, and this request asked for it"
        case DeploymentStatus.PLACING:
            return "its replica is being placed"
        case DeploymentStatus.STARTING:
            return "its replica is starting"
        case _:
            return route.loading_reason or "no replica of it is ready yet"


def not_ready(route: DeploymentRoute, *, waited_s: float, retry_after_s: int,
              open_breakers: int) -> ErrorReply:
    """503 after waiting in vain for a replica that may still come: with Retry-After."""
    reason = _why_not_ready(route, open_breakers)
    return ErrorReply(
        503, f"`{route.model_id}` has no ready replica after waiting {waited_s:.1f}s: "
        f"{reason}.", "service_unavailable", "model_not_ready",
        {**_about(route), "reason": reason},
        headers=[(b"retry-after", str(retry_after_s).encode())])


def _why_not_ready(route: DeploymentRoute, open_breakers: int) -> str:
    """Why no replica of a deployment that is not hopeless is ready: its status, then the
    failure or placement error behind it, when there is one."""
    if route.status == DeploymentStatus.DEGRADED:
        return _why_degraded(route, open_breakers)
    if open_breakers:
        reason = _breakers_open(open_breakers)
    elif route.desired_replicas == 0:
        # 0 replicas but not stopped: a workflow run from before the stopped status, or a
        # deployment created at 0 that the keeper has not reported on yet.
        reason = "it is scaled to zero replicas"
    else:
        match route.status:
            case DeploymentStatus.PLACING:
                reason = "it is being placed"
            case DeploymentStatus.STARTING:
                reason = "its replicas are starting"
            case DeploymentStatus.STOPPED:
                reason = "it is being scaled up from zero replicas"
            case _:
                reason = "no replica is ready"
    if route.consecutive_failures and route.last_failure:
        reason += (f" (after {route.consecutive_failures} failed start(s); last: "
                   f"{route.last_failure})")
    elif route.placement_error:
        reason += f" ({route.placement_error})"
    return reason


def _why_degraded(route: DeploymentRoute, open_breakers: int) -> str:
    """A degraded deployment's reason. Its last_failure is the keeper's word on the
    unreachable replica and its nodes (not a failed start), and a placement error is why
    that replica's replacement has no room yet."""
    reason = (f"it is degraded: {route.last_failure or 'a replica is unreachable'}; "
              "a replacement is being placed or started")
    if route.placement_error:
        reason += f", but cannot be placed yet ({route.placement_error})"
    if open_breakers:
        reason += f"; {_breakers_open(open_breakers)}"
    return reason


def _breakers_open(count: int) -> str:
    return f"its {count} ready replica(s) keep failing and are out until they recover"


#: The bytes that mark an event as possibly an engine's error: checked on every relayed
#: chunk, so that only the rare chunk holding one is parsed.
_ERROR_MARK = b'"error"'


def engine_error_events(chunk: bytes) -> bytes:
    """``chunk`` (whole server-sent events) with each error event an engine sent midway
    (llama.cpp's ``data: {"error": {"code": 500, ...}}``) rewritten in the gateway's one
    error shape, as :func:`engine_error` does for an error answer. Other events, a token
    that merely says "error" included, are left byte for byte."""
    if _ERROR_MARK not in chunk:
        return chunk
    events = chunk.split(b"\n\n")
    for i, event in enumerate(events):
        if _ERROR_MARK not in event or not event.startswith(b"data: {"):
            continue
        data = event[len(b"data: "):]
        try:
            parsed = json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError):
            continue
        if isinstance(parsed, dict) and "error" in parsed:
            events[i] = b"data: " + engine_error(500, data).body()
    return b"\n\n".join(events)


def sse_error_event(message: str) -> bytes:
    """The event that ends a stream cut midway, followed by ``[DONE]``: clients see an
    error, not a silent end (the openai SDK raises it as an APIError)."""
    payload = {"error": {"message": message, "type": "upstream_error", "param": None,
                         "code": "stream_interrupted"}}
    return b"data: " + dumps(payload) + b"\n\ndata: [DONE]\n\n"
