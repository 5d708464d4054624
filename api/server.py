"""How the API is served: uvicorn with httptools, bounded in time and header size by
:class:`modelkeeper.infra.http_server.TimedHttpProtocol` (a slowloris client, or a header
that never ends, gets a 408 or a 431 and a closed connection), and believing
``X-Forwarded-For`` only from the proxies ``api_trusted_proxies`` names.

Every server of the API goes through :func:`uvicorn_config`: `modelkeeper api`, and the
tests and benchmarks that serve it over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from modelkeeper.infra.http_server import TimedHttpProtocol, timed_protocol
from modelkeeper.settings import Settings


def api_protocol(settings: Settings) -> type[TimedHttpProtocol]:
    """The API's HTTP protocol: the settings' deadlines; errors in FastAPI's shape."""
    return timed_protocol("ApiHttpProtocol", header_timeout_s=settings.api_header_timeout_s,
                          body_timeout_s=settings.api_body_timeout_s)


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """The API's server settings; ``overrides`` for an embedded server (a test's
    ``lifespan="off"``, its log level)."""
    proxies = settings.api_trusted_proxies
    options: dict[str, Any] = {
        "host": settings.bind_host, "port": settings.api_port,
        "log_level": settings.log_level.lower(), "access_log": False,
        "http": api_protocol(settings),
        # uvicorn believes X-Forwarded-For from 127.0.0.1 by default: any local process
        # could then name itself another peer, and registration trusts loopback peers.
        "proxy_headers": bool(proxies),
        "forwarded_allow_ips": list(proxies),
        "server_header": False,
    }
    options.update(overrides)
    return uvicorn.Config(app, **options)


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone: it is not the
    process's main server (a test runner's or a benchmark's is)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


#: How long :func:`served` waits for the server to listen: a bind and a few imports.
SERVE_START_TIMEOUT_S = 30.0


@contextlib.asynccontextmanager
async def served(app: FastAPI, settings: Settings, *, log_level: str = "warning",
                 ) -> AsyncIterator[str]:
    """``app`` served over HTTP in this event loop, its lifespan entered (the store and
    Temporal connected, on this loop) as :func:`uvicorn_config` serves it: its URL, until
    the block ends and every connection is closed. For tests and benchmarks."""
    async with app.router.lifespan_context(app):
        server = _EmbeddedServer(uvicorn_config(app, settings, lifespan="off",
                                                log_level=log_level))
        task = asyncio.create_task(server.serve())
        try:
            deadline = time.monotonic() + SERVE_START_TIMEOUT_S
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("the API failed to start (see the log)")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the API did not start in {SERVE_START_TIMEOUT_S}s")
                await asyncio.sleep(0.01)
            host = settings.bind_host
            yield f"http://{f'[{host}]' if ':' in host else host}:{settings.api_port}"
        finally:
            server.should_exit = True
            await task
