"""Minimal passthrough proxies that the gateway is measured against.

* ``starlette_httpx``: the "bare 30-line Starlette + httpx passthrough" the issue quotes
  as the reference to beat: one route per path, one shared ``httpx.AsyncClient``.
* ``asgi_aiohttp`` and ``asgi_httpx``: a raw ASGI function with no framework, forwarding
  with aiohttp or with a tuned httpx client. Run on uvicorn (httptools, uvloop) or
  granian, they isolate what the server and the client library each cost, which is how
  the gateway's stack was chosen.

All read the upstream base URL from ``PASSTHROUGH_UPSTREAM`` and the bearer key to send
from ``PASSTHROUGH_KEY``. None does any routing, auth or accounting: they are floors.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

UPSTREAM = os.environ.get("PASSTHROUGH_UPSTREAM", "http://127.0.0.1:8000")
HEADERS = {"Authorization": f"Bearer {os.environ.get('PASSTHROUGH_KEY', '')}",
           "Content-Type": "application/json"}

# -- the reference: Starlette + one shared httpx client -----------------------------------

_shared = httpx.AsyncClient(base_url=UPSTREAM, timeout=60)


async def _proxy(request: Request) -> Response:
    upstream = await _shared.post(request.url.path, content=await request.body(),
                                  headers=HEADERS)
    return Response(upstream.content, status_code=upstream.status_code,
                    media_type=upstream.headers.get("content-type"))


starlette_httpx = Starlette(routes=[
    Route("/v1/chat/completions", _proxy, methods=["POST"]),
    Route("/v1/completions", _proxy, methods=["POST"]),
])

# -- raw ASGI, client chosen by PASSTHROUGH_CLIENT ------------------------------------------

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_aiohttp: aiohttp.ClientSession | None = None
_httpx: httpx.AsyncClient | None = None


async def _forward_aiohttp(path: str, body: bytes) -> tuple[int, bytes]:
    global _aiohttp
    if _aiohttp is None:
        _aiohttp = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"))
    async with _aiohttp.post(UPSTREAM + path, data=body, headers=HEADERS) as resp:
        return resp.status, await resp.read()


async def _forward_httpx(path: str, body: bytes) -> tuple[int, bytes]:
    global _httpx
    if _httpx is None:
        # Tuned as far as httpx goes: no pool cap, keep-alive for every connection.
        _httpx = httpx.AsyncClient(base_url=UPSTREAM, timeout=60, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=None))
    resp = await _httpx.post(path, content=body, headers=HEADERS)
    return resp.status_code, resp.content


async def _raw(scope: Scope, receive: Receive, send: Send,
               forward: Callable[[str, bytes], Awaitable[tuple[int, bytes]]]) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    status, data = await forward(scope["path"], body)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": data})


async def asgi_aiohttp(scope: Scope, receive: Receive, send: Send) -> None:
    """Raw ASGI passthrough with an aiohttp client."""
    await _raw(scope, receive, send, _forward_aiohttp)


async def asgi_httpx(scope: Scope, receive: Receive, send: Send) -> None:
    """Raw ASGI passthrough with a tuned httpx client."""
    await _raw(scope, receive, send, _forward_httpx)
