"""The ASGI plumbing every part of the gateway shares: the types of the server's callables,
writing a whole answer, and watching for the client going away.

Kept apart so that admission, routing and forwarding each write to the client the same
way without importing one another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .responses import JSON_HEADERS, ErrorReply, Headers

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: HTTP status the gateway records for a request whose client went away (nginx's).
CLIENT_CLOSED = 499


async def send_response(send: Send, status: int, body: bytes, headers: Headers) -> None:
    """Write a whole answer: the status, ``headers`` and a Content-Length, then ``body``."""
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def send_reply(send: Send, reply: ErrorReply) -> None:
    """Write an error answer, in OpenAI's shape, with its own headers."""
    await send_response(send, reply.status, reply.body(), [*JSON_HEADERS, *reply.headers])


async def send_json(send: Send, status: int, body: bytes) -> None:
    """Write a JSON answer."""
    await send_response(send, status, body, JSON_HEADERS)


def with_header(send: Send, name: bytes, value: bytes) -> Send:
    """``send``, with the header ``name: value`` added to the response's start, whoever
    writes it (the engine's relayed answer, or an error of the gateway's)."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), (name, value)]
        await send(message)

    return sending


class ClientWatch:
    """Watches for the client going away while its request is being served.

    After the body has been read, the server's ``receive`` answers only when the client
    disconnects (or the response is complete): a task waiting on it cancels the request's
    own task, which closes the upstream connection, so the engine stops generating for
    nobody.
    """

    __slots__ = ("finished", "gone", "task", "watcher")

    def __init__(self, receive: Receive) -> None:
        self.finished = False
        self.gone = False
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        message = await receive()
        if message["type"] == "http.disconnect" and not self.finished:
            self.gone = True
            self.task.cancel()

    def stop(self) -> None:
        self.finished = True
        self.watcher.cancel()
