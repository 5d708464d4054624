"""A simulated OpenAI-compatible inference engine, for scale and fault tests.

Run it as::

    python -m agent.engines.sim_server --host 127.0.0.1 --port 8000 --model NAME [options]

It speaks enough of the OpenAI HTTP API for the agent, the gateway and load tests
(``/health``, ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, streaming
or not) and can be told to misbehave the way real engines do: load slowly, hold memory,
generate at a set speed, fail while loading, crash later, or hang.

It also speaks vLLM's sleep dialect, so that the agent's code path for vLLM is the one
tested here. vLLM serves it when started with ``--enable-sleep-mode`` and the environment
``VLLM_SERVER_DEV_MODE=1`` (its dev endpoints, vllm/entrypoints/serve/sleep/api_router.py
and docs/features/sleep_mode.md, as read in 2026): ``POST /sleep?level=1`` (level 1, the
default: the KV cache is discarded and the weights kept, offloaded to CPU memory; level 2
discards the weights too), ``POST /wake_up`` (200 with an empty body once awake; optional
``tags``), and ``GET /is_sleeping`` answering ``{"is_sleeping": bool}``. While asleep,
vLLM answers the completion endpoints 503 and keeps answering ``/health``. The sim takes
level 1 only (others 400: modelkeeper never asks for them), frees the share of its memory
beyond ``--weights-bytes`` (on unified memory that is what vLLM's level 1 frees: the
offloaded weights stay in the same memory), and answers a wake after ``--wake-time``
seconds with that memory taken back. Its ``/metrics`` has vLLM's two queue gauges,
``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, from its own queue
(``--max-num-seqs`` requests run at once, as in vLLM; the rest wait).

``--dialect`` makes it speak one engine's dialect as that engine's installed source has
it (vLLM 0.33.0, SGLang 0.5.23; each path below is cited from it), for the tests that hold
our adapters, readiness probe, metrics scraping and sleep/wake against them. Without it
the sim speaks vLLM's paths as above, with two differences kept for the tests written
against them: ``{"status": "ok"}`` from ``/health`` and empty sleep answers, and
completions refused while asleep.

``--dialect vllm`` (vllm/entrypoints/serve/instrumentator/health.py and metrics.py,
vllm/entrypoints/serve/dev/sleep/api_router.py, vllm/v1/metrics/loggers.py,
vllm/v1/engine/core.py):

- ``GET /health``: 200 with an empty body. (vLLM listens only once loaded; the sim answers
  503 while it loads, which the probe reads the same: not ready.)
- ``GET /metrics``: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (0.33 has no ``vllm:gpu_cache_usage_perc``) and
  ``vllm:engine_sleep_state``, labelled ``model_name`` and ``engine``.
- ``POST /sleep?level=1`` answers ``{"status": "sleeping", "level": 1}``; ``POST /wake_up``
  ``{"status": "awake", "tags": null}``; ``GET /is_sleeping`` ``{"is_sleeping": bool}``.
- Asleep, a completion is not refused: it waits in the queue (counted in
  ``vllm:num_requests_waiting``) until a wake, as vLLM's paused scheduler queues new
  requests (``pause_scheduler``: "All pause modes queue new adds"). vLLM's default sleep
  also aborts the requests running when it comes (``mode=abort``); the sim lets them end.

``--dialect sglang`` (sglang/srt/entrypoints/http_server.py, sglang/srt/utils/auth.py,
sglang/srt/observability/metrics_collector.py,
sglang/srt/managers/scheduler_components/weight_updater.py):

- ``GET /health`` and ``GET /health_generate``: 200 with an empty body once up, 503 while
  starting; ``GET /ready`` the same. These and ``/metrics`` need no key; every other path
  does, and a refusal is ``401 {"error": "Unauthorized"}``.
- ``GET /get_model_info`` (and ``/model_info``): ``model_path``, ``served_model_name``,
  ``tokenizer_path``, ``is_generation``, among others.
- ``GET /metrics``: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
  ``sglang:token_usage``, labelled ``model_name``.
- ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation`` (GET too)
  with ``{"tags": ["kv_cache"]}``: 200 with ``null``. The sim takes the KV cache tag only
  (the agent asks for no other; no tags means all, weights included, and is refused with
  a 400); a release while requests run is refused with a 400, where SGLang's scheduler
  asserts that it is idle. SGLang has no ``/is_sleeping``; asleep, the sim refuses
  completions (503), SGLang's behaviour there being undocumented.

One route is the sim's own: ``POST /sim/grow`` with ``{"bytes": N}`` (behind the key)
makes it hold N more bytes, really resident, as an engine that outgrows its claim does:
the memory watchdog's tests cross a node's line with it.

Tests start hundreds of these at once on one machine, so the module deliberately uses
only the standard library (asyncio streams and a minimal HTTP/1.1 parser) and nothing
that pulls in pydantic, starlette or httpx: every imported megabyte is multiplied by
the number of engines. Keep it that way.

The API key comes from the ``MODELKEEPER_ENGINE_API_KEY`` environment variable, never
from argv, because argv is visible to every user of the machine through ``ps``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from modelkeeper.domain.addresses import split_address

from .sim_rendezvous import RANK_LOST_EXIT_CODE, Follower, Leader

logger = logging.getLogger("agent.engines.sim_server")

#: Environment variable holding the API key; empty or unset means no authentication.
API_KEY_ENV = "MODELKEEPER_ENGINE_API_KEY"
#: Exit code of ``--fail-at-start`` (what a real engine returns when loading fails).
FAIL_AT_START_EXIT_CODE = 1
#: Exit code of ``--crash-after``: not 0, 1 or a signal, so tests can tell it apart.
CRASH_EXIT_CODE = 70
#: ``max_tokens`` when a request gives none (OpenAI's completions default).
DEFAULT_MAX_TOKENS = 16
#: Largest ``max_tokens`` accepted; bounds the work one request can ask of a sim.
MAX_TOKENS_LIMIT = 65_536
#: Largest request head (request line and headers) and body accepted.
MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 8 * 1024 * 1024
#: Memory is held in pieces this large, yielding to the event loop between them so
#: ``/health`` keeps answering 503 while a large ``--memory-bytes`` is being touched.
MEMORY_CHUNK_BYTES = 64 * 1024 * 1024
#: Stride used to touch held memory; no platform we run on has smaller pages.
PAGE_BYTES = 4096

#: How long a wake takes by default: vLLM's level-1 wake of a small model (0.1-0.4 s in
#: vLLM's own measurements); issue 21's wake benchmark uses 0.2 s.
DEFAULT_WAKE_TIME_S = 0.2
#: The only sleep level the sim takes: vLLM's level 1 (KV cache freed, weights kept).
SLEEP_LEVEL = "1"

#: vLLM's sleep endpoints (see the module docstring).
SLEEP_PATHS = frozenset({"/sleep", "/wake_up", "/is_sleeping"})
#: The dialects ``--dialect`` takes (the module docstring); None: the sim's own.
VLLM, SGLANG = "vllm", "sglang"
DIALECTS = (VLLM, SGLANG)
#: SGLang's sleep (memory saver) endpoints, and the one tag the sim releases.
SGLANG_SLEEP_PATHS = frozenset({"/release_memory_occupation", "/resume_memory_occupation"})
KV_CACHE_TAG = "kv_cache"
#: SGLang's health paths (all answered alike while the sim runs) and model info paths.
SGLANG_HEALTH_PATHS = frozenset({"/health", "/health_generate", "/ready"})
SGLANG_INFO_PATHS = frozenset({"/get_model_info", "/model_info"})
#: What SGLang answers a release with requests in flight (its scheduler's assertion).
SGLANG_NOT_IDLE = "release_memory_occupation should be called only when server is idle."
#: The sim's own control, for the memory watchdog's tests: ``POST /sim/grow`` with
#: ``{"bytes": N}`` allocates and touches N more bytes, really resident, and answers the
#: process's resident memory after it (``{"rss_bytes": ...}``).
GROW_PATH = "/sim/grow"
#: The most one grow may add: tests share a machine, and a mistyped size must not take it.
MAX_GROW_BYTES = 4 << 30
#: What a completion asked of a sleeping engine is answered, with a 503.
SLEEPING_MESSAGE = "The model is sleeping: wake it up with POST /wake_up first"

#: The generated text cycles through these words, so output is deterministic.
WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog",
    "while", "seven", "models", "keep", "serving", "requests", "all", "night",
)  # fmt: skip

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    500: "internal_error",
    501: "not_implemented_error",
    503: "unavailable_error",
}

SSE_DONE = b"data: [DONE]\n\n"
LAST_CHUNK = b"0\r\n\r\n"


# --------------------------------------------------------------------------- HTTP


class HttpError(Exception):
    """A request the server answers with an error status and an OpenAI-shaped body."""

    def __init__(
        self, status: int, message: str, *, code: str | None = None, close: bool = False,
        body: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        #: True when the connection can't be reused (we lost track of the byte stream).
        self.close = close
        #: The whole body, where an engine's dialect is not OpenAI's error shape.
        self.body = body


@dataclass(frozen=True)
class RequestHead:
    """The request line and headers of one HTTP/1.x request."""

    method: str
    target: str
    version: str
    #: Header names are lower-cased; repeated headers are joined with ", ".
    headers: Mapping[str, str]

    @property
    def path(self) -> str:
        """The target without its query string."""
        return self.target.partition("?")[0]


def parse_request_head(raw: bytes) -> RequestHead:
    """Parse a request head (everything before the blank line) or raise a 400."""
    # Header bytes are ASCII in practice; latin-1 decodes any byte, so a stray one
    # becomes a wrong character instead of an exception.
    lines = raw.decode("latin-1").split("\r\n")
    while lines and not lines[-1]:
        lines.pop()
    if not lines:
        raise HttpError(400, "empty request", close=True)
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, f"malformed request line {lines[0][:100]!r}", close=True)
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, f"malformed header line {line[:100]!r}", close=True)
        key = name.lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return RequestHead(method=method, target=target, version=version, headers=headers)


def query_param(target: str, name: str) -> str | None:
    """The last value of ``name`` in ``target``'s query string, or None."""
    values = parse_qs(target.partition("?")[2]).get(name)
    return values[-1] if values else None


def wants_keep_alive(head: RequestHead) -> bool:
    """Whether the client lets us reuse the connection (HTTP/1.1 does by default)."""
    tokens = {t.strip().lower() for t in head.headers.get("connection", "").split(",")}
    if head.version == "HTTP/1.0":
        return "keep-alive" in tokens
    return "close" not in tokens


def body_length(head: RequestHead) -> int:
    """The Content-Length of the body, validated; chunked request bodies are refused."""
    if "transfer-encoding" in head.headers:
        # OpenAI clients always send a Content-Length; supporting chunked uploads would
        # only add code that no test needs.
        raise HttpError(501, "chunked request bodies are not supported", close=True)
    value = head.headers.get("content-length")
    if value is None:
        return 0
    if not value.isdigit():
        raise HttpError(400, f"invalid Content-Length {value!r}", close=True)
    length = int(value)
    if length > MAX_BODY_BYTES:
        raise HttpError(413, f"body larger than {MAX_BODY_BYTES} bytes", close=True)
    return length


def json_bytes(obj: Any) -> bytes:
    """Compact JSON, as bytes."""
    return json.dumps(obj, separators=(",", ":")).encode()


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    """An OpenAI-shaped error body."""
    return json_bytes(
        {
            "error": {
                "message": message,
                "type": _ERROR_TYPES.get(status, "error"),
                "param": None,
                "code": code if code is not None else status,
            }
        }
    )


def render_response(
    status: int,
    body: bytes,
    *,
    keep_alive: bool = True,
    content_type: str = "application/json",
) -> bytes:
    """A complete HTTP/1.1 response with a Content-Length."""
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    )
    return head.encode() + body


def render_stream_head(*, chunked: bool, keep_alive: bool = True) -> bytes:
    """The head of a server-sent-events response.

    HTTP/1.1 clients get a chunked body; HTTP/1.0 ones cannot parse chunks, so they get
    a raw body delimited by closing the connection (and so never keep it alive).
    """
    framing = "Transfer-Encoding: chunked\r\n" if chunked else ""
    connection = "keep-alive" if chunked and keep_alive else "close"
    return (
        "HTTP/1.1 200 OK\r\n"
        "Content-Type: text/event-stream\r\n"
        "Cache-Control: no-cache\r\n"
        f"{framing}Connection: {connection}\r\n\r\n"
    ).encode()


def encode_chunk(data: bytes) -> bytes:
    """One chunk of a chunked transfer encoding."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def sse_event(payload: Any) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + json_bytes(payload) + b"\n\n"


def is_authorized(headers: Mapping[str, str], api_key: str | None) -> bool:
    """True when no key is required or the request carries ``Bearer <key>``."""
    if not api_key:
        return True
    scheme, _, token = headers.get("authorization", "").partition(" ")
    # compare_digest so the time taken does not reveal how much of the key matched.
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    )


# ---------------------------------------------------------------------- completions


@dataclass(frozen=True)
class CompletionRequest:
    """What the sim needs from a completions or chat completions request."""

    chat: bool
    #: Prompt length in (whitespace-separated) tokens, one entry per choice to generate.
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    stream: bool
    #: ``stream_options.include_usage``: send a final chunk with usage.
    include_usage: bool


def token_text(index: int) -> str:
    """The ``index``-th generated token: a word, space-separated from the one before."""
    word = WORDS[index % len(WORDS)]
    return word if index == 0 else " " + word


def generate_text(count: int) -> str:
    """The first ``count`` tokens of the deterministic output."""
    return "".join(token_text(i) for i in range(count))


def count_tokens(text: str) -> int:
    """A stand-in tokenizer: whitespace-separated words."""
    return len(text.split())


def _content_tokens(content: Any) -> int:
    """Tokens in a chat message's content: a string or a list of parts."""
    if content is None:
        return 0
    if isinstance(content, str):
        return count_tokens(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if not isinstance(part, dict):
                raise HttpError(400, "message content parts must be objects")
            text = part.get("text")
            total += count_tokens(text) if isinstance(text, str) else 0
        return total
    raise HttpError(400, "message content must be a string or a list of parts")


def _prompt_tokens(prompt: Any) -> tuple[int, ...]:
    """Token counts of a completions ``prompt``: one per prompt in a batch."""
    if isinstance(prompt, str):
        return (count_tokens(prompt),)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return tuple(count_tokens(p) for p in prompt)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return (len(prompt),)
        if all(isinstance(p, list) for p in prompt):
            return tuple(len(p) for p in prompt)
    raise HttpError(
        400, "prompt must be a string, a list of strings, or a list of token ids", code="prompt"
    )


def parse_completion_request(body: bytes, *, chat: bool, served_model: str) -> CompletionRequest:
    """Validate a (chat) completions request body, raising a 400 or 404 HttpError."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HttpError(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise HttpError(400, "body must be a JSON object")

    model = data.get("model")
    if model is not None and model != served_model:
        # What vLLM answers, so clients that send a stale model name fail the same way.
        raise HttpError(404, f"The model `{model}` does not exist.", code="model_not_found")

    max_tokens = data.get("max_tokens")
    if chat and data.get("max_completion_tokens") is not None:
        max_tokens = data["max_completion_tokens"]
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if (
        not isinstance(max_tokens, int)
        or isinstance(max_tokens, bool)
        or not 1 <= max_tokens <= MAX_TOKENS_LIMIT
    ):
        raise HttpError(400, f"max_tokens must be an integer from 1 to {MAX_TOKENS_LIMIT}")

    stream = data.get("stream") or False
    if not isinstance(stream, bool):
        raise HttpError(400, "stream must be a boolean")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict):
        raise HttpError(400, "stream_options must be an object")
    include_usage = bool(options.get("include_usage", False))

    if chat:
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages must be a non-empty list")
        total = 0
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise HttpError(400, "each message must be an object with a role")
            total += _content_tokens(message.get("content"))
        prompt_tokens: tuple[int, ...] = (total,)
    else:
        if "prompt" not in data:
            raise HttpError(400, "prompt is required")
        prompt_tokens = _prompt_tokens(data["prompt"])

    return CompletionRequest(
        chat=chat,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
    )


def usage(req: CompletionRequest) -> dict[str, int]:
    """The ``usage`` object of a response to ``req``."""
    prompt = sum(req.prompt_tokens)
    completion = req.max_tokens * len(req.prompt_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def build_response(
    req: CompletionRequest, *, model: str, request_id: str, created: int
) -> dict[str, Any]:
    """The body of a non-streaming (chat) completion."""
    text = generate_text(req.max_tokens)
    choices: list[dict[str, Any]]
    if req.chat:
        choices = [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                # Every answer runs to max_tokens: the sim has no end-of-sequence token.
                "finish_reason": "length",
            }
        ]
    else:
        choices = [
            {"index": i, "text": text, "logprobs": None, "finish_reason": "length"}
            for i in range(len(req.prompt_tokens))
        ]
    return {
        "id": request_id,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(req),
    }


def _stream_choice(chat: bool, index: int, text: str | None, finish: str | None) -> dict[str, Any]:
    """One choice of a streamed chunk; ``text`` None means the closing (empty) delta."""
    choice: dict[str, Any] = {"index": index}
    if chat:
        choice["delta"] = {} if text is None else {"content": text}
    else:
        choice["text"] = text or ""
    choice["logprobs"] = None
    choice["finish_reason"] = finish
    return choice


def stream_chunks(
    req: CompletionRequest, *, model: str, request_id: str, created: int
) -> Iterator[tuple[bool, dict[str, Any]]]:
    """The chunks of a streamed response, each with whether a new token starts there.

    The flag lets the server pace tokens without this function knowing about time.
    The ``[DONE]`` sentinel is the caller's to send.
    """
    kind = "chat.completion.chunk" if req.chat else "text_completion"

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": model,
            "choices": choices,
        }

    n = len(req.prompt_tokens)
    if req.chat:
        # OpenAI opens a chat stream with the role and empty content.
        opening = {"role": "assistant", "content": ""}
        yield (
            False,
            chunk([{"index": 0, "delta": opening, "logprobs": None, "finish_reason": None}]),
        )
    for t in range(req.max_tokens):
        text = token_text(t)
        for i in range(n):
            yield i == 0, chunk([_stream_choice(req.chat, i, text, None)])
    for i in range(n):
        yield False, chunk([_stream_choice(req.chat, i, None, "length")])
    if req.include_usage:
        yield False, {**chunk([]), "usage": usage(req)}


# ----------------------------------------------------------------------- the engine


@dataclass(frozen=True)
class SimConfig:
    """How one sim engine behaves; built from the command line."""

    host: str
    port: int
    model: str
    load_time_s: float = 0.0
    memory_bytes: int = 0
    tokens_per_second: float = 0.0
    fail_at_start: bool = False
    crash_after_s: float | None = None
    hang: bool = False
    log_level: str = "INFO"
    #: What it keeps of ``memory_bytes`` asleep; None: all of it (a sleep frees nothing).
    weights_bytes: int | None = None
    #: How long a wake takes, its memory taken back included.
    wake_time_s: float = DEFAULT_WAKE_TIME_S
    #: Requests that run at once (vLLM's ``--max-num-seqs``); None: no limit.
    max_num_seqs: int | None = None
    #: Multi-rank mode (:mod:`agent.engines.sim_rendezvous`): this rank of ``world_size``,
    #: and rank 0's rendezvous address. One rank (the default) rendezvouses with nobody.
    rank: int = 0
    world_size: int = 1
    leader: tuple[str, int] | None = None
    #: How long a rank above 0 keeps trying to join rank 0.
    join_timeout_s: float = 600.0
    #: The engine whose HTTP dialect it speaks (:data:`DIALECTS`); None: the sim's own.
    dialect: str | None = None

    @property
    def kv_bytes(self) -> int:
        """What a sleep frees: the memory beyond the weights."""
        if self.weights_bytes is None:
            return 0
        return max(0, self.memory_bytes - self.weights_bytes)


def current_rss_bytes() -> int | None:
    """This process's resident set size from /proc, or None where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def memory_to_hold(target_bytes: int, rss_bytes: int | None) -> int:
    """Bytes to allocate so the process ends up about ``target_bytes`` resident.

    The interpreter itself already takes ~20 MB; holding the whole target on top of it
    would put every sim over the allocation it was given. Without /proc we cannot tell,
    and hold the whole target.
    """
    if target_bytes <= 0:
        return 0
    return max(0, target_bytes - (rss_bytes or 0))


def grow_bytes(body: bytes) -> int:
    """The ``bytes`` of a ``/sim/grow`` body: a whole number from 0 to MAX_GROW_BYTES."""
    try:
        value = json.loads(body or b"{}").get("bytes")
    except (ValueError, AttributeError):
        raise HttpError(400, "the body must be a JSON object: {\"bytes\": N}") from None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_GROW_BYTES:
        raise HttpError(400, f"bytes must be a whole number from 0 to {MAX_GROW_BYTES}, "
                             f"not {value!r}", code="bytes")
    return value


async def _hold(blocks: list[bytearray], size: int) -> None:
    """Allocate and touch ``size`` bytes into ``blocks``, in chunks, yielding between them."""
    remaining = size
    while remaining > 0:
        chunk = min(remaining, MEMORY_CHUNK_BYTES)
        block = bytearray(chunk)
        # Write one byte per page: an untouched allocation may be mapped lazily and would
        # not show up in RSS, which is what the agent and the tests measure.
        block[::PAGE_BYTES] = b"\x01" * len(range(0, chunk, PAGE_BYTES))
        blocks.append(block)
        remaining -= chunk
        await asyncio.sleep(0)


class Pacer:
    """Spaces tokens ``1 / rate`` seconds apart on an absolute schedule.

    Scheduling against the start time, instead of sleeping a fixed interval after each
    token, keeps the rate exact when writes to a slow client take time.
    """

    def __init__(self, tokens_per_second: float) -> None:
        self.rate = tokens_per_second
        self.start = time.monotonic()

    async def wait_for_token(self, index: int) -> None:
        """Sleep until token ``index`` (0-based) is due."""
        if self.rate <= 0:
            return
        delay = self.start + (index + 1) / self.rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


class SimEngine:
    """The HTTP side of a sim engine: routes requests and tracks loading."""

    def __init__(self, config: SimConfig, api_key: str | None) -> None:
        self.config = config
        self.api_key = api_key or None
        self.ready = False
        #: What /health says while not ready: the rendezvous sets how many ranks joined.
        self.loading_detail = "Loading model"
        self._ids = itertools.count(1)
        self._connections: set[asyncio.Task[None]] = set()
        #: Memory held for --memory-bytes: its weights share, kept while asleep, and its
        #: KV share, freed by a sleep. Kept referenced so neither is freed otherwise.
        self._held: list[bytearray] = []
        self._kv: list[bytearray] = []
        #: What the KV share holds once loaded (it may be less than kv_bytes: the
        #: interpreter's own resident memory counts towards --memory-bytes).
        self._kv_hold = 0
        #: Memory added by POST /sim/grow, kept referenced so it stays resident.
        self._grown: list[bytearray] = []
        #: Never set: --hang waits on it.
        self._never = asyncio.Event()
        #: Asleep, or waking: completions are refused until a wake has ended.
        self.sleeping = False
        #: One sleep or wake at a time: a second call waits for the first and then finds
        #: the state it wanted (both are idempotent).
        self._sleep_lock = asyncio.Lock()
        #: The queue: requests generating now, and requests waiting for a slot.
        self.running = 0
        self.waiting = 0
        self._slots = (asyncio.Semaphore(config.max_num_seqs)
                       if config.max_num_seqs is not None else None)
        #: Set while awake: in vLLM's dialect a completion asked of a sleeping engine waits
        #: on it, as vLLM's paused scheduler queues new requests.
        self._awake = asyncio.Event()
        self._awake.set()

    async def load(self, started: float) -> None:
        """Grow to --memory-bytes resident, then stay "loading" until --load-time has passed."""
        remaining = memory_to_hold(self.config.memory_bytes, current_rss_bytes())
        self._kv_hold = min(remaining, self.config.kv_bytes)
        await _hold(self._held, remaining - self._kv_hold)
        await _hold(self._kv, self._kv_hold)
        delay = started + self.config.load_time_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    async def sleep(self) -> None:
        """vLLM's level-1 sleep: free the KV share, keep the weights. Idempotent."""
        async with self._sleep_lock:
            if self.sleeping:
                return
            self.sleeping = True
            self._awake.clear()
            # Chunks this large are mapped apart from the heap: dropping them gives the
            # memory back to the system at once, as the node's available memory shows.
            self._kv.clear()
            logger.info("asleep: freed %d bytes, kept the rest", self._kv_hold)

    async def wake(self) -> None:
        """Take the KV share back; answers --wake-time after the call at the earliest.
        Idempotent: an awake engine answers at once."""
        async with self._sleep_lock:
            if not self.sleeping:
                return
            began = time.monotonic()
            await _hold(self._kv, self._kv_hold)
            delay = began + self.config.wake_time_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self.sleeping = False
            self._awake.set()
            logger.info("awake after %.3fs", time.monotonic() - began)

    def metrics_text(self) -> str:
        """The Prometheus exposition of the engine's gauges (what a scaler reads), by its
        dialect's names (see the module docstring)."""
        model = self.config.model.replace("\\", "\\\\").replace('"', '\\"')
        # The share of its KV cache in use: the sim's slots stand for its blocks.
        usage = (self.running / self.config.max_num_seqs
                 if self.config.max_num_seqs else float(self.running > 0))
        gauges: list[tuple[str, str, list[tuple[str, float]]]]
        if self.config.dialect == SGLANG:
            label = f'model_name="{model}"'
            gauges = [
                ("sglang:num_running_reqs", "The number of running requests.",
                 [(label, self.running)]),
                ("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
                 [(label, self.waiting)]),
                ("sglang:token_usage", "The token usage.", [(label, usage)]),
            ]
        elif self.config.dialect == VLLM:
            label = f'engine="0",model_name="{model}"'
            state = {"awake": not self.sleeping, "weights_offloaded": self.sleeping,
                     "discard_all": False}
            gauges = [
                ("vllm:num_requests_running", "Number of requests in model execution batches.",
                 [(label, self.running)]),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                 [(label, self.waiting)]),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 [(label, usage)]),
                ("vllm:engine_sleep_state", "Engine sleep state.",
                 [(f'{label},sleep_state="{name}"', float(on)) for name, on in state.items()]),
            ]
        else:
            label = f'model_name="{model}"'
            gauges = [
                ("vllm:num_requests_running", "Requests generating now.",
                 [(label, self.running)]),
                ("vllm:num_requests_waiting", "Requests waiting for a slot.",
                 [(label, self.waiting)]),
            ]
        lines = []
        for name, help_text, samples in gauges:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            lines += [f"{name}{{{labels}}} {float(value)}" for labels, value in samples]
        return "\n".join(lines) + "\n"

    async def handle_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve requests on one connection until the client or an error closes it."""
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if self.config.hang:
                # A wedged engine: the kernel accepts the connection, nobody answers.
                await self._never.wait()
            while await self._serve_one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away mid-request; nothing to answer
        except asyncio.CancelledError:
            # Only close_connections cancels a connection: the engine is stopping, and the
            # connection just ends. Ending it cancelled instead makes asyncio's stream
            # callback log a traceback per open connection.
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def close_connections(self) -> None:
        """Cancel every open connection (used at shutdown)."""
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read and answer one request; return whether the connection stays open."""
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False  # closed between requests: the normal end of keep-alive
        except asyncio.LimitOverrunError:
            body = error_body(431, "request head too large")
            writer.write(render_response(431, body, keep_alive=False))
            await writer.drain()
            return False
        keep_alive = False
        try:
            head = parse_request_head(raw[:-4])
            keep_alive = wants_keep_alive(head)
            length = body_length(head)
            body = await reader.readexactly(length) if length else b""
            return await self._respond(head, body, keep_alive, writer)
        except HttpError as err:
            keep_alive = keep_alive and not err.close
            body = err.body if err.body is not None else error_body(err.status, err.message,
                                                                    err.code)
            writer.write(render_response(err.status, body, keep_alive=keep_alive))
            await writer.drain()
            return keep_alive
        except (ConnectionError, asyncio.IncompleteReadError):
            raise  # handled by handle_connection: nobody is left to answer
        except Exception:  # one bad request must not take the engine down
            logger.exception("error handling a request")
            writer.write(render_response(500, error_body(500, "internal error"), keep_alive=False))
            await writer.drain()
            return False

    async def _respond(
        self, head: RequestHead, body: bytes, keep_alive: bool, writer: asyncio.StreamWriter
    ) -> bool:
        """Route one parsed request; HttpErrors are rendered by the caller."""
        path, method = head.path, head.method
        dialect = self.config.dialect
        if path == "/health" or (dialect == SGLANG and path in SGLANG_HEALTH_PATHS):
            if method != "GET":
                raise HttpError(405, "use GET")
            if dialect is not None:
                # vLLM's and SGLang's health answers carry no body, either way.
                status, payload = (200 if self.ready else 503), b""
            elif not self.ready:
                # llama.cpp's answer while loading; the agent's health probe waits on it.
                status, payload = 503, error_body(503, self.loading_detail)
            else:
                status, payload = 200, json_bytes({"status": "ok"})
            return await self._reply(writer, status, payload, keep_alive)

        if path == "/metrics":
            # Unauthenticated, as vLLM's and SGLang's: counts only, nothing a key protects.
            if method != "GET":
                raise HttpError(405, "use GET")
            return await self._reply(writer, 200, self.metrics_text().encode(), keep_alive,
                                     content_type="text/plain; version=0.0.4")

        if path in SLEEP_PATHS and dialect != SGLANG:
            # Behind the key, unlike vLLM's dev endpoints: whoever can reach an engine
            # must not be able to put it to sleep.
            self._authorize(head)
            return await self._reply(writer, 200, await self._sleep_route(head, method),
                                     keep_alive)

        if path in SGLANG_SLEEP_PATHS and dialect == SGLANG:
            self._authorize(head)
            return await self._reply(writer, 200, await self._memory_route(head, body),
                                     keep_alive)

        if path in SGLANG_INFO_PATHS and dialect == SGLANG:
            self._authorize(head)
            if method != "GET":
                raise HttpError(405, "use GET")
            if not self.ready:
                raise HttpError(503, "Loading model")
            return await self._reply(writer, 200, json_bytes(self._model_info()), keep_alive)

        if path == GROW_PATH:
            # Behind the key: whoever can reach an engine must not make it eat the node.
            self._authorize(head)
            if method != "POST":
                raise HttpError(405, "use POST")
            await _hold(self._grown, grow_bytes(body))
            payload = json_bytes({"rss_bytes": current_rss_bytes()})
            return await self._reply(writer, 200, payload, keep_alive)

        if not path.startswith("/v1/"):
            raise HttpError(404, f"no route for {path}")
        self._authorize(head)
        if not self.ready:
            raise HttpError(503, "Loading model")

        if path == "/v1/models":
            if method != "GET":
                raise HttpError(405, "use GET")
            entry = {
                "id": self.config.model,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "modelkeeper-sim",
                # vLLM's and SGLang's model cards say what they serve, under this name.
                "root": self.config.model,
            }
            payload = json_bytes({"object": "list", "data": [entry]})
            return await self._reply(writer, 200, payload, keep_alive)

        if path in ("/v1/completions", "/v1/chat/completions"):
            if method != "POST":
                raise HttpError(405, "use POST")
            # In vLLM's dialect it waits for a wake in the queue instead (_queued).
            if self.sleeping and dialect != VLLM:
                raise HttpError(503, SLEEPING_MESSAGE)
            chat = path == "/v1/chat/completions"
            req = parse_completion_request(body, chat=chat, served_model=self.config.model)
            async with self._queued():
                return await self._complete(req, chat, head, keep_alive, writer)

        raise HttpError(404, f"no route for {path}")

    async def _reply(self, writer: asyncio.StreamWriter, status: int, payload: bytes,
                     keep_alive: bool, *, content_type: str = "application/json") -> bool:
        """Send one whole answer; whether the connection stays open."""
        writer.write(render_response(status, payload, keep_alive=keep_alive,
                                     content_type=content_type))
        await writer.drain()
        return keep_alive

    def _authorize(self, head: RequestHead) -> None:
        """Raise the dialect's 401 unless the request carries the key."""
        if is_authorized(head.headers, self.api_key):
            return
        if self.config.dialect == SGLANG:
            # sglang/srt/utils/auth.py's refusal.
            raise HttpError(401, "Unauthorized", body=json_bytes({"error": "Unauthorized"}))
        raise HttpError(401, "Invalid API key", code="invalid_api_key")

    def _model_info(self) -> dict[str, Any]:
        """SGLang's ``/get_model_info``, its fields that describe a plain text model."""
        return {"model_path": self.config.model, "served_model_name": self.config.model,
                "tokenizer_path": self.config.model, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": "sim", "architectures": ["SimForCausalLM"]}

    async def _sleep_route(self, head: RequestHead, method: str) -> bytes:
        """``/sleep``, ``/wake_up`` and ``/is_sleeping``: the answer's body."""
        if head.path == "/is_sleeping":
            if method != "GET":
                raise HttpError(405, "use GET")
            return json_bytes({"is_sleeping": self.sleeping})
        if method != "POST":
            raise HttpError(405, "use POST")
        if not self.ready:
            raise HttpError(503, "Loading model")
        if head.path == "/sleep":
            level = query_param(head.target, "level") or SLEEP_LEVEL
            if level != SLEEP_LEVEL:
                raise HttpError(400, f"sleep level {level!r} is not supported: the sim "
                                     f"sleeps at level {SLEEP_LEVEL} only", code="level")
            await self.sleep()
            answer: dict[str, Any] = {"status": "sleeping", "level": int(SLEEP_LEVEL)}
        else:
            await self.wake()
            # No tags asked: all of it woke (vLLM answers the tags it was asked for).
            answer = {"status": "awake", "tags": None}
        # vLLM 0.33 answers with what it did; the sim's own dialect with an empty body.
        return json_bytes(answer) if self.config.dialect == VLLM else b""

    async def _memory_route(self, head: RequestHead, body: bytes) -> bytes:
        """SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation``: the
        KV cache's memory only (see the module docstring)."""
        if head.method not in ("GET", "POST"):
            raise HttpError(405, "use POST")
        if not self.ready:
            raise HttpError(503, "Loading model")
        try:
            tags = json.loads(body or b"{}").get("tags")
        except (ValueError, AttributeError):
            raise HttpError(400, 'the body must be a JSON object: {"tags": [...]}') from None
        if tags != [KV_CACHE_TAG]:
            raise HttpError(400, f"the sim releases and resumes the KV cache only: "
                                 f'tags must be ["{KV_CACHE_TAG}"], not {tags!r}', code="tags")
        if head.path == "/release_memory_occupation":
            if self.running or self.waiting:
                raise HttpError(400, SGLANG_NOT_IDLE)
            await self.sleep()
        else:
            await self.wake()
        # SGLang's handlers return nothing: FastAPI answers 200 with null.
        return b"null"

    @contextlib.asynccontextmanager
    async def _queued(self) -> AsyncIterator[None]:
        """Hold one of --max-num-seqs slots while a request generates, counting it as
        waiting until it has one and as running while it does."""
        self.waiting += 1
        try:
            if self.config.dialect == VLLM:
                await self._awake.wait()
            if self._slots is not None:
                await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            if self._slots is not None:
                self._slots.release()

    async def _complete(self, req: CompletionRequest, chat: bool, head: RequestHead,
                        keep_alive: bool, writer: asyncio.StreamWriter) -> bool:
        """Answer one (chat) completion, streamed or not."""
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-sim{os.getpid()}-{next(self._ids)}"
        created = int(time.time())
        if req.stream:
            return await self._stream(req, request_id, created, head, keep_alive, writer)
        if self.config.tokens_per_second > 0:
            # A non-streamed answer arrives when its last token would have.
            await asyncio.sleep(req.max_tokens / self.config.tokens_per_second)
        response = build_response(
            req, model=self.config.model, request_id=request_id, created=created
        )
        writer.write(render_response(200, json_bytes(response), keep_alive=keep_alive))
        await writer.drain()
        return keep_alive

    async def _stream(
        self,
        req: CompletionRequest,
        request_id: str,
        created: int,
        head: RequestHead,
        keep_alive: bool,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Send a streamed response as server-sent events, pacing the tokens."""
        chunked = head.version != "HTTP/1.0"
        frame: Callable[[bytes], bytes] = encode_chunk if chunked else bytes
        writer.write(render_stream_head(chunked=chunked, keep_alive=keep_alive))
        pacer = Pacer(self.config.tokens_per_second)
        token = 0
        for starts_token, chunk in stream_chunks(
            req, model=self.config.model, request_id=request_id, created=created
        ):
            if starts_token:
                await pacer.wait_for_token(token)
                token += 1
            writer.write(frame(sse_event(chunk)))
            # drain() raises ConnectionResetError if the client left, ending the stream.
            await writer.drain()
        writer.write(frame(SSE_DONE))
        if chunked:
            writer.write(LAST_CHUNK)
        await writer.drain()
        return keep_alive and chunked


async def serve(
    config: SimConfig,
    api_key: str | None,
    *,
    started: float | None = None,
    stop: asyncio.Event | None = None,
    engine: SimEngine | None = None,
) -> int:
    """Run the engine until SIGTERM/SIGINT (0), a simulated load failure (1) or crash.

    ``stop``: run inside a process that holds many engines (the agent's fleet mode,
    :mod:`agent.engines.sim_inprocess`): the engine stops when it is set instead of on
    signals, which belong to the host process, and a simulated crash returns
    :data:`CRASH_EXIT_CODE` instead of ending the process with it. ``engine``: the
    engine to serve ``config`` with (built here when None), for a host that reads its
    state (whether it sleeps).
    """
    started = time.monotonic() if started is None else started
    loop = asyncio.get_running_loop()
    in_process = stop is not None
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

    if engine is None:
        engine = SimEngine(config, api_key)
    server = await asyncio.start_server(
        engine.handle_connection, config.host, config.port, limit=MAX_HEAD_BYTES
    )
    logger.info("sim engine listening on %s:%d with %s", config.host, config.port, config)

    crashed = asyncio.Event()
    if config.crash_after_s is not None:
        if in_process:
            loop.call_later(config.crash_after_s, crashed.set)
        else:
            loop.call_later(config.crash_after_s, _crash, config.crash_after_s)

    ranks = await _Ranks.start(config, engine)
    loading = asyncio.create_task(engine.load(started))
    stopping = asyncio.create_task(stop.wait())
    crashing = asyncio.create_task(crashed.wait())
    joining = asyncio.create_task(ranks.joined())
    lost = asyncio.create_task(ranks.lost())
    try:
        await asyncio.wait({loading, stopping, crashing}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done() and not crashing.done():
            loading.result()  # re-raise a failure to allocate memory
            if config.fail_at_start:
                logger.error("simulated failure while loading model %r; exiting", config.model)
                return FAIL_AT_START_EXIT_CODE
            # Loaded; serving waits for every rank, as the real engines' process group.
            await asyncio.wait({joining, stopping, crashing},
                               return_when=asyncio.FIRST_COMPLETED)
            if joining.done() and not stopping.done() and not crashing.done():
                failed = joining.result()
                if failed is not None:
                    logger.error("%s; exiting with code %d", failed, RANK_LOST_EXIT_CODE)
                    return RANK_LOST_EXIT_CODE
                engine.ready = True
                logger.info("model %r ready after %.3fs", config.model,
                            time.monotonic() - started)
                await asyncio.wait({stopping, crashing, lost},
                                   return_when=asyncio.FIRST_COMPLETED)
                if lost.done() and not stopping.done() and not crashing.done():
                    logger.error("%s; exiting with code %d", lost.result(), RANK_LOST_EXIT_CODE)
                    return RANK_LOST_EXIT_CODE
        if crashing.done() and not stopping.done():
            logger.error("simulated crash after %.2fs; exiting with code %d",
                         config.crash_after_s, CRASH_EXIT_CODE)
            return CRASH_EXIT_CODE
        logger.info("received a stop signal; shutting down")
        return 0
    finally:
        for task in (loading, stopping, crashing, joining, lost):
            task.cancel()
        await ranks.close()
        server.close()
        await engine.close_connections()
        await server.wait_closed()


class _Ranks:
    """The rendezvous of a multi-rank sim (:mod:`agent.engines.sim_rendezvous`), or nothing
    for one rank: :meth:`joined` answers None at once and :meth:`lost` never does."""

    def __init__(self, config: SimConfig, engine: SimEngine, leader: Leader | None,
                 follower: Follower | None) -> None:
        self._config, self._engine = config, engine
        self._leader, self._follower = leader, follower

    @classmethod
    async def start(cls, config: SimConfig, engine: SimEngine) -> _Ranks:
        if config.world_size <= 1 or config.leader is None:
            return cls(config, engine, None, None)
        host, port = config.leader
        if config.rank == 0:
            leader = Leader(host, port, config.world_size)
            await leader.start()  # an OSError (the port taken) ends the engine, as vLLM's
            engine.loading_detail = f"waiting for ranks: {leader.progress()}"
            return cls(config, engine, leader, None)
        return cls(config, engine, None, Follower(host, port, config.rank))

    async def joined(self) -> str | None:
        """None once every rank has joined (rank 0) or this one has (the others); else why
        not."""
        if self._leader is not None:
            complete = asyncio.create_task(self._leader.complete.wait())
            lost = asyncio.create_task(self._leader.lost.wait())
            try:
                while not complete.done() and not lost.done():
                    await asyncio.wait({complete, lost}, timeout=0.2,
                                       return_when=asyncio.FIRST_COMPLETED)
                    self._engine.loading_detail = (
                        f"waiting for ranks: {self._leader.progress()}")
            finally:
                complete.cancel()
                lost.cancel()
            return None if complete.done() and not lost.done() else self._leader.lost_reason
        if self._follower is not None:
            return await self._follower.join(self._config.join_timeout_s)
        return None

    async def lost(self) -> str:
        """Return, saying why, when a rank this one depends on leaves."""
        if self._leader is not None:
            await self._leader.lost.wait()
            return self._leader.lost_reason
        if self._follower is not None:
            return await self._follower.wait_lost()
        await asyncio.Event().wait()  # one rank loses nobody
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self._leader is not None:
            await self._leader.close()
        if self._follower is not None:
            self._follower.close()


def _crash(after: float) -> None:
    """End the process at once, the way an engine killed by a fault or the OOM killer does."""
    logger.error("simulated crash after %.2fs; exiting with code %d", after, CRASH_EXIT_CODE)
    # os._exit skips cleanup on purpose: a crashing engine closes nothing gracefully.
    os._exit(CRASH_EXIT_CODE)


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> SimConfig:
    """Parse the command line into a :class:`SimConfig`."""
    parser = argparse.ArgumentParser(
        prog="python -m agent.engines.sim_server",
        description="A simulated OpenAI-compatible inference engine for tests.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="the model name to serve")
    parser.add_argument(
        "--load-time",
        type=_non_negative_float,
        default=0.0,
        help="seconds /health answers 503 before the model is ready",
    )
    parser.add_argument(
        "--memory-bytes",
        type=_non_negative_int,
        default=0,
        help="while loading, allocate and touch memory until the process is about this "
        "many bytes resident",
    )
    parser.add_argument(
        "--tokens-per-second",
        type=_non_negative_float,
        default=0.0,
        help="generation speed; 0 answers at once",
    )
    parser.add_argument(
        "--fail-at-start",
        action="store_true",
        help=f"exit {FAIL_AT_START_EXIT_CODE} when loading ends, never healthy",
    )
    parser.add_argument(
        "--crash-after",
        type=_non_negative_float,
        default=None,
        help=f"exit {CRASH_EXIT_CODE} this many seconds after starting",
    )
    parser.add_argument(
        "--hang", action="store_true", help="accept connections but never answer, /health included"
    )
    parser.add_argument(
        "--weights-bytes",
        type=_non_negative_int,
        default=None,
        help="what it keeps of --memory-bytes while asleep (the rest is freed); "
        "default: all of it",
    )
    parser.add_argument(
        "--wake-time",
        type=_non_negative_float,
        default=DEFAULT_WAKE_TIME_S,
        help="seconds a wake from sleep takes",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        default=None,
        help="requests generating at once; the rest wait (default: no limit)",
    )
    parser.add_argument("--rank", type=_non_negative_int, default=0,
                        help="this rank of a multi-rank replica")
    parser.add_argument("--world-size", type=_positive_int, default=1,
                        help="ranks in the replica; above 1, --leader is needed")
    parser.add_argument("--leader", default=None,
                        help="rank 0's rendezvous address, host:port (rank 0 listens there)")
    parser.add_argument("--join-timeout", type=_non_negative_float, default=600.0,
                        help="seconds a rank above 0 keeps trying to join rank 0")
    parser.add_argument(
        "--dialect",
        choices=DIALECTS,
        default=None,
        help="speak this engine's HTTP dialect (paths, answers, metric names); "
        "default: the sim's own, vLLM's paths",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level")
    args = parser.parse_args(argv)
    leader = None
    if args.leader is not None:
        leader = split_address(args.leader)
        if leader is None:
            parser.error(f"--leader {args.leader!r}: must be host:port")
    if args.world_size > 1 and leader is None:
        parser.error(f"--world-size {args.world_size} needs --leader")
    if args.rank >= args.world_size:
        parser.error(f"--rank {args.rank} must be below --world-size {args.world_size}")
    return SimConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        load_time_s=args.load_time,
        memory_bytes=args.memory_bytes,
        tokens_per_second=args.tokens_per_second,
        fail_at_start=args.fail_at_start,
        crash_after_s=args.crash_after,
        hang=args.hang,
        log_level=args.log_level.upper(),
        weights_bytes=args.weights_bytes,
        wake_time_s=args.wake_time,
        max_num_seqs=args.max_num_seqs,
        rank=args.rank,
        world_size=args.world_size,
        leader=leader,
        join_timeout_s=args.join_timeout,
        dialect=args.dialect,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse flags, read the key from the environment, serve."""
    started = time.monotonic()
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s sim[%(process)d] %(message)s",
    )
    config = parse_args(argv)
    logging.getLogger().setLevel(config.log_level)
    api_key = os.environ.get(API_KEY_ENV) or None
    try:
        return asyncio.run(serve(config, api_key, started=started))
    except OSError as exc:
        # Usually the port is taken; say so in one line instead of a traceback.
        logger.error("cannot serve on %s:%d: %s", config.host, config.port, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
