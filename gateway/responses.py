"""What the gateway says when it cannot pass a request on: OpenAI-shaped error bodies,
and the reason a model cannot be served right now, taken from its deployment."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.store.routing import DeploymentRoute

#: What ASGI wants for headers.
Headers = list[tuple[bytes, bytes]]

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]


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

    def body(self) -> bytes:
        """The JSON body: ``{"error": {...}}`` as the OpenAI API shapes it."""
        return dumps({"error": {"message": self.message, "type": self.type, "param": None,
                                "code": self.code, **self.extra}})


def bad_request(message: str, code: str = "invalid_request") -> ErrorReply:
    """400: the request itself is wrong."""
    return ErrorReply(400, message, "invalid_request_error", code)


def unauthorized(message: str) -> ErrorReply:
    """401 with the header that tells a client which scheme to use."""
    return ErrorReply(401, message, "authentication_error", "invalid_api_key",
                      headers=[(b"www-authenticate", b"Bearer")])


def unknown_model(model: str, known: Iterable[str]) -> ErrorReply:
    """404 naming the known models, so a typo reads as a typo and not as "loading"."""
    names = sorted(known)
    listed = ", ".join(names) if names else "none are deployed"
    return ErrorReply(404, f"The model `{model}` does not exist. Known models: {listed}.",
                      "invalid_request_error", "model_not_found", {"known_models": names})


def upstream_failed(model: str, why: str, status: int = 502, *,
                    waited_s: float | None = None) -> ErrorReply:
    """502/504: the engines were there but failed this request. ``waited_s``: the request
    was then held that long (since it arrived) for a replica to retry on, in vain."""
    message = f"No replica of `{model}` could answer: {why}"
    if waited_s is not None:
        message += f". None it could be retried on was ready within {waited_s:.1f}s."
    return ErrorReply(status, message, "upstream_error", "upstream_unavailable")


def hopeless(route: DeploymentRoute) -> ErrorReply | None:
    """The answer for a model that will not have a ready replica without an operator (or a
    node change), so it is given at once: waiting, or "retry shortly", would be a lie.
    None when a replica may become ready by itself."""
    model, status = route.model_id, route.status
    extra = {"model": model, "status": status}
    if status == DeploymentStatus.PARKED:
        reason = route.last_failure or "too many failed starts in a row"
        return ErrorReply(
            503, f"`{model}` is parked after {route.consecutive_failures} failed starts in a "
            f"row; last failure: {reason}. It stays down until an operator changes or "
            "retries the deployment.", "service_unavailable", "model_parked",
            {**extra, "reason": reason})
    if status == DeploymentStatus.CANT_PLACE:
        reason = route.placement_error or "no node has room for it"
        return ErrorReply(
            503, f"`{model}` cannot be placed: {reason}. It is served once a node with room "
            "joins or frees up.", "service_unavailable", "model_cant_place",
            {**extra, "reason": reason})
    if status == DeploymentStatus.DELETING:
        return ErrorReply(503, f"`{model}` is being deleted.", "service_unavailable",
                          "model_deleting", {**extra, "reason": "deleting"})
    return None


def not_ready(route: DeploymentRoute, *, waited_s: float, retry_after_s: int,
              open_breakers: int) -> ErrorReply:
    """503 after waiting in vain for a replica that may still come: with Retry-After."""
    model, status = route.model_id, route.status
    if open_breakers:
        reason = (f"its {open_breakers} ready replica(s) keep failing and are out until they "
                  "recover")
    elif route.desired_replicas == 0:
        reason = "it is scaled to zero replicas"
    elif status == DeploymentStatus.PLACING:
        reason = "it is being placed"
    elif status == DeploymentStatus.STARTING:
        reason = "its replicas are starting"
    else:
        reason = "no replica is ready"
    if route.consecutive_failures and route.last_failure:
        reason += (f" (after {route.consecutive_failures} failed start(s); last: "
                   f"{route.last_failure})")
    elif route.placement_error:
        reason += f" ({route.placement_error})"
    return ErrorReply(
        503, f"`{model}` has no ready replica after waiting {waited_s:.1f}s: {reason}.",
        "service_unavailable", "model_not_ready",
        {"model": model, "status": status, "reason": reason},
        headers=[(b"retry-after", str(retry_after_s).encode())])


def sse_error_event(message: str) -> bytes:
    """The event that ends a stream cut midway, followed by ``[DONE]``: clients see an
    error, not a silent end (the openai SDK raises it as an APIError)."""
    payload = {"error": {"message": message, "type": "upstream_error", "param": None,
                         "code": "stream_interrupted"}}
    return b"data: " + dumps(payload) + b"\n\ndata: [DONE]\n\n"
