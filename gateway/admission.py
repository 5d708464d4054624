"""Admission: whether the gateway takes a request on at all, before any replica is
looked at.

In order, per completion request (what ``Host``, Content-Type and ``/metrics`` must show
is :mod:`gateway.edge`'s):

1. **The key** (:meth:`Admission.refusal`): keys too stale to trust are a 503, no valid
   key a 401, a key over its rate a 429. A clock read, one SHA-256 and a dict lookup.
2. **The body** (:func:`read_body`): at most :data:`MAX_BODY_BYTES`, else a 413.
3. **The JSON** (:func:`parse_completion`): an object naming its ``model``, else a 400.
4. **The request's own problems** (:meth:`Admission.bounded`): nothing to answer, or
   more output than the bounds allow, a 400 naming the field; whichever model it names,
   since a malformed request is the client's to fix. Within the bounds, the body to send.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from typing import Any, NamedTuple

from modelkeeper.domain.output_bounds import OutputRefusal, bound_output
from modelkeeper.settings import Settings
from modelkeeper.store.routing import DeploymentRoute

from . import responses
from .asgi import Receive
from .responses import ErrorReply

#: Largest request body accepted (prompts with long contexts are large, but not this).
MAX_BODY_BYTES = 32 * 1024 * 1024
CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATHS = frozenset({CHAT_PATH, "/v1/completions"})
#: Sent to the engine as completions are, but with no output to bound: an embedding's
#: size is the model's, not the request's. llama.cpp serves it when started with
#: ``--embeddings``, and says so in a 501 otherwise, which the client gets as it is.
EMBEDDINGS_PATH = "/v1/embeddings"
#: Routes engines serve that the gateway does not pass on, each with why: a client gets a
#: 404 that names the route and what to use, not "no route" (issue 27). Their streamed
#: answers end without chat completions' ``data: [DONE]``, which the relay reads as a
#: stream cut midway, and their length fields are not bounded yet.
UNROUTED_PATHS = {
    "/v1/responses": "the Responses API",
    "/v1/messages": "Anthropic's Messages API",
}
#: Retry-After (seconds) of the 503 for keys too stale to trust: the gateway re-reads
#: them every few seconds, so a client may try again soon.
STALE_KEYS_RETRY_AFTER_S = 5


class TooLarge(Exception):
    """The request's body is over :data:`MAX_BODY_BYTES`."""


class ClientGone(Exception):
    """The client went away before its body was read."""


async def read_body(receive: Receive) -> bytes:
    """The request's whole body; :class:`TooLarge` past :data:`MAX_BODY_BYTES`,
    :class:`ClientGone` when the client leaves first."""
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        return body
    parts = [body]
    size = len(body)
    while message.get("more_body"):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        part = message.get("body", b"")
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise TooLarge
        parts.append(part)
    return b"".join(parts)


def body_too_large() -> ErrorReply:
    """The 413 for a body over :data:`MAX_BODY_BYTES`."""
    return ErrorReply(413, f"body larger than {MAX_BODY_BYTES} bytes",
                      "invalid_request_error", "body_too_large")


def parse_completion(body: bytes) -> dict[str, Any] | ErrorReply:
    """The body as a JSON object whose ``model`` is a string; else the 400 saying why."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        return responses.bad_request("the body is not valid JSON", "invalid_json")
    except RecursionError:
        # The parser recurses per level: a body nested a thousand deep is hostile,
        # and its failure must be the client's 400, not the server's 500.
        return responses.bad_request("the body's JSON is nested too deeply", "json_too_deep")
    if not isinstance(payload, dict) or not isinstance(payload.get("model"), str):
        return responses.bad_request("`model` is required: the name of a deployed model",
                                     "model_required", param="model")
    return payload


#: The response header that says how the gateway set a request's length, when it did: a
#: client that sent no ``max_tokens`` (or more than the model's limit) otherwise gets a
#: shorter answer than it expected with no word why (issue 27: aiperf counted a 14.7 %
#: output-length mismatch against the demo model). Value, e.g.
#: ``max_tokens=256; the model's default, the request named none``.
OUTPUT_LIMIT_HEADER = b"x-modelkeeper-output-limit"


class Bounded(NamedTuple):
    """The body to send, and the :data:`OUTPUT_LIMIT_HEADER` value when the gateway set
    a length (None: the body went as it came, as far as lengths go)."""

    body: bytes
    output_limit: bytes | None = None


def bound_max_tokens(payload: dict[str, Any], body: bytes, bound: int | None, *,
                     model_default: int | None = None,
                     model_limit: int | None = None,
                     max_choices: int = 1) -> Bounded | ErrorReply:
    """The body to send under the bounds on output per request
    (:func:`modelkeeper.domain.output_bounds.bound_output` decides, rule by rule): the
    gateway's ``bound`` (``gateway_max_tokens``, for every key), the model's own (its
    catalog ``default_max_tokens`` and ``max_tokens_limit``), and ``max_choices``
    (``gateway_max_choices``). A refusal is a 400 naming the field, its value and the limit.

    Unchanged (the same bytes) when nothing needs to change. A field is set by appending
    it to the body's bytes rather than dumping the payload again: the body has been parsed
    as an object with a ``model``, so it ends in ``}`` after its last member, and a
    duplicate member is overridden by the last one.
    """
    decided = bound_output(payload, bound=bound, model_default=model_default,
                           model_limit=model_limit, max_choices=max_choices)
    if isinstance(decided, OutputRefusal):
        return responses.bad_request(decided.message, decided.code, param=decided.field)
    if not decided:
        return Bounded(body)
    end = body.rstrip().rindex(b"}")
    added = b"".join(b',"' + name.encode() + b'":' + str(value).encode()
                     for name, value in decided.items())
    return Bounded(body[:end] + added + body[end:], _output_limit(payload, decided))


def _output_limit(payload: dict[str, Any], decided: dict[str, int]) -> bytes:
    """The header value for the lengths ``decided`` set: each with why."""
    said = []
    for name, value in decided.items():
        asked = payload.get(name)
        why = ("the default for a request that names no length" if asked is None
               else f"lowered from {asked}, the most this model allows per request")
        said.append(f"{name}={value}; {why}")
    return ", ".join(said).encode("ascii", errors="replace")


def request_problem(path: str, payload: dict[str, Any]) -> ErrorReply | None:
    """Why a request an engine would accept must not reach it: one with nothing to
    answer, which an engine takes as leave to generate from nothing until its limit (an
    empty ``messages`` kept a demo replica busy for 22 s). None when there is no problem.
    The rest of the body is the engine's to judge."""
    if path == EMBEDDINGS_PATH:
        given = payload.get("input")
        if given is None or given == "" or given == []:
            return responses.bad_request(
                f"`input` is {given!r}: an embedding needs an input that is not empty",
                "invalid_input", param="input")
        return None
    if path == CHAT_PATH:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return responses.bad_request(
                f"`messages` is {messages!r}: a chat completion needs a list of at least "
                "one message", "invalid_messages", param="messages")
        return None
    prompt = payload.get("prompt")
    if prompt is None or prompt == "" or prompt == []:
        return responses.bad_request(
            f"`prompt` is {prompt!r}: a completion needs a prompt that is not empty",
            "invalid_prompt", param="prompt")
    return None


class KeyRateLimiter:
    """A token bucket per API key: ``burst`` requests at once, refilled at ``rate_per_s``.

    In this worker's memory: each gateway worker limits the connections it serves.
    """

    __slots__ = ("_buckets", "burst", "rate_per_s")

    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        #: key id -> [tokens left, when they were counted (time.monotonic())]
        self._buckets: dict[str, list[float]] = {}

    def take(self, key_id: str, now: float) -> ErrorReply | None:
        """Spend one request of ``key_id``'s bucket; a 429 saying when to retry if empty."""
        bucket = self._buckets.get(key_id)
        if bucket is None:
            bucket = self._buckets[key_id] = [self.burst, now]
        tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate_per_s)
        bucket[1] = now
        if tokens < 1.0:
            bucket[0] = tokens
            wait = math.ceil((1.0 - tokens) / self.rate_per_s)
            return ErrorReply(
                429, f"This API key is over its rate of {self.rate_per_s:g} requests per "
                f"second (bursts of {self.burst:g}); retry in {wait} s.",
                "rate_limit_error", "rate_limit_exceeded",
                headers=[(b"retry-after", str(wait).encode())])
        bucket[0] = tokens - 1.0
        return None


class Admission:
    """The client keys this worker trusts, their rates, and the bounds on output."""

    def __init__(self, settings: Settings) -> None:
        self.auth = settings.gateway_auth
        self._key_hashes: dict[str, str] = {}
        #: When (``time.monotonic()``) the read that gave ``_key_hashes`` began, and until
        #: when they may be trusted: a revoked key must stop working within the bound
        #: even while the store is unreachable, so past it every keyed request is refused.
        self._keys_read_at = float("-inf")
        self._keys_trusted_until = float("-inf")
        self.key_max_staleness_s = settings.gateway_key_max_staleness_s
        self._max_tokens = settings.gateway_max_tokens
        self._max_choices = settings.gateway_max_choices
        self._limiter = (None if settings.gateway_key_rate_per_s is None else
                         KeyRateLimiter(settings.gateway_key_rate_per_s,
                                        settings.gateway_key_burst))

    def keys_read(self, key_hashes: dict[str, str], read_at: float) -> None:
        """Take the key hashes the table listener read from the store, in a read that
        began at ``read_at``. An older read finishing after a newer one is ignored: its
        keys could bring back one the newer read no longer has."""
        if read_at < self._keys_read_at:
            return
        self._key_hashes = key_hashes
        self._keys_read_at = read_at
        self._keys_trusted_until = read_at + self.key_max_staleness_s

    def keys_current(self, now: float) -> bool:
        """Whether keyed requests are served at ``now`` (always, with auth off)."""
        return not self.auth or now <= self._keys_trusted_until

    def refusal(self, authorization: bytes | None) -> ErrorReply | None:
        """Why a request to /v1 with this ``Authorization`` header is refused: keys too
        stale to trust (503), no valid key (401), or its key over its rate (429); None to
        serve it. Costs a clock read, one SHA-256 and a dict lookup, and the rate
        limiter's arithmetic when one is set."""
        if not self.auth:
            return None
        now = time.monotonic()
        if now > self._keys_trusted_until:
            return self._stale_keys(now)
        key_id = self._key_id(authorization)
        if key_id is None:
            return responses.unauthorized(
                "Missing or invalid API key: send `Authorization: Bearer <key>` with a key "
                "from `modelkeeper keys create`.")
        if self._limiter is not None:
            return self._limiter.take(key_id, now)
        return None

    def bounded(self, path: str, payload: dict[str, Any], body: bytes,
                route: DeploymentRoute | None) -> Bounded | ErrorReply:
        """The body to send for a parsed request to ``route``'s model (None: a model not
        known), or the 400 for the request's own problem (rule 4)."""
        problem = request_problem(path, payload)
        if problem is not None:
            return problem
        if path == EMBEDDINGS_PATH:
            return Bounded(body)
        return bound_max_tokens(
            payload, body, self._max_tokens,
            model_default=None if route is None else route.default_max_tokens,
            model_limit=None if route is None else route.max_tokens_limit,
            max_choices=self._max_choices)

    def _key_id(self, authorization: bytes | None) -> str | None:
        """The id of the key the request presents; None when it presents no valid one."""
        if authorization is None:
            return None
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        # Keys are 256-bit random strings, so a plain hash is a safe stored form and a
        # dict of hashes is the whole check: one SHA-256, no database trip.
        return self._key_hashes.get(hashlib.sha256(token.strip()).hexdigest())

    def _stale_keys(self, now: float) -> ErrorReply:
        age = now - self._keys_read_at
        shown = "never read" if age == float("inf") else f"last read {age:.0f} s ago"
        return ErrorReply(
            503, f"The gateway cannot confirm API keys: they were {shown}, and it trusts "
            f"them for {self.key_max_staleness_s:g} s (the store is unreachable). Requests "
            "are refused until it reads them again, so that a revoked key cannot be used.",
            "service_unavailable", "keys_unconfirmed",
            headers=[(b"retry-after", str(STALE_KEYS_RETRY_AFTER_S).encode())])
