"""The engines' own queues: requests each routed replica's engine holds waiting for a
slot, read from its ``/metrics`` once per usage tick.

The gateway counts the requests it holds and the ones in flight, but an engine that
accepts more than it runs at once (vLLM's ``--max-num-seqs``) queues the rest inside,
where the gateway sees them only as in flight. Its queue gauge says how many wait there,
and that is load per ready replica as much as a request held here (rule 3 of
:mod:`modelkeeper.domain.demand`). The usage reporter starts one round of scrapes per
tick (:meth:`EngineQueues.scrape`) and writes each endpoint's last answer with its usage
row; requests never wait on a scrape.

Which gauge comes from the engine the deployment runs (the route's ``engine``, the
catalog's kind), not from trying every name on every engine: an engine without a queue
gauge is never asked, and an engine that should have one and does not answer it is a
failure worth a log line, not a guess.

Every scrape is bounded: :data:`SCRAPE_TIMEOUT_S`, :data:`MAX_METRICS_BYTES`, at most one
in flight per endpoint. A scrape that fails leaves the value unknown (None, written as
NULL) and is logged once per endpoint per outage; routing never hears of it.

Cost, measured on the 2-core test machine against 50 endpoints on another process: one
round takes 66 ms (median) and 25 ms of the gateway's CPU when the engines honour
``name[]`` (vLLM's and SGLang's prometheus_client expositions do), and 140 ms and 76 ms
when each sends its whole 88 KB page to be filtered here; at one round a second.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from modelkeeper.domain.shards import EngineKind

from .table import Endpoint, RoutingTable

log = logging.getLogger(__name__)

#: Each engine's gauge of requests waiting for a slot, by the catalog's engine kind.
#: The sim speaks vLLM's dialect (agent/engines/sim_server.py); one told to speak SGLang's
#: (``engine_args.dialect``) is still asked for vLLM's gauge, since a route knows its
#: engine's kind only, and its queue is then unknown. llama.cpp has none worth
#: asking: ``llama-server`` has ``llamacpp:requests_deferred`` only when started with
#: ``--metrics``, which the agent does not pass, and the llama-cpp-python server it runs by
#: default has no ``/metrics`` at all.
QUEUE_GAUGES: dict[str, str] = {
    EngineKind.VLLM: "vllm:num_requests_waiting",
    EngineKind.SIM: "vllm:num_requests_waiting",
    # SGLang's exposition needs --enable-metrics, which its launch plan passes.
    EngineKind.SGLANG: "sglang:num_queue_reqs",
}

#: How long one scrape may take, connection included. An engine answers ``/metrics`` in
#: milliseconds; a vLLM API server busy with a burst may lag by hundreds. An answer later
#: than two default usage ticks describes a queue the next scrape describes better, and a
#: wedged engine then costs one open connection, never a pile of them.
SCRAPE_TIMEOUT_S = 2.0
#: The most of a ``/metrics`` page read. vLLM's whole exposition is about 100 KB per
#: model (its histograms); the ``name[]`` filter asks for one gauge, but an engine may
#: ignore it. Ten times that bounds the memory of one scrape (and of 50 at once) and the
#: time the gateway's event loop spends filtering it.
MAX_METRICS_BYTES = 1 << 20


class ScrapeFailed(Exception):
    """An engine's ``/metrics`` did not say how long its queue is."""


def _lines_of(gauge: str) -> re.Pattern[str]:
    # Its HELP and TYPE lines and its samples, nothing else: the pure-Python parser then
    # reads a handful of lines instead of a whole exposition per endpoint per tick.
    name = re.escape(gauge)
    return re.compile(rf"^(?:# (?:HELP|TYPE) {name} .*|{name}[{{ ].*)$", re.MULTILINE)


_GAUGE_LINES = {gauge: _lines_of(gauge) for gauge in set(QUEUE_GAUGES.values())}


def queue_length(text: str, gauge: str) -> int | None:
    """``gauge``'s value in a Prometheus text exposition, summed over its label sets (a
    vLLM with several data-parallel engines has one series per engine); None when the
    page has no sample of it. Raises :class:`ValueError` when its lines do not parse or
    its value is not a count."""
    pattern = _GAUGE_LINES.get(gauge) or _lines_of(gauge)
    lines = pattern.findall(text)
    if not lines:
        return None
    total = 0.0
    found = False
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name == gauge:
                total += sample.value
                found = True
    if not found:
        return None
    if not math.isfinite(total) or total < 0:
        raise ValueError(f"{gauge} is {total}, not a count")
    return round(total)


async def _read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, refused past ``limit`` bytes without reading further."""
    if response.content_length is not None and response.content_length > limit:
        raise ScrapeFailed(f"/metrics is {response.content_length} bytes, over {limit}")
    body = bytearray()
    async for chunk in response.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > limit:
            raise ScrapeFailed(f"/metrics is over {limit} bytes")
    return bytes(body)


class EngineQueues:
    """Scrapes the queue gauge of every routed replica whose engine has one, and leaves
    each answer on its endpoint's :attr:`~gateway.table.Endpoint.engine_waiting` for the
    next usage write."""

    def __init__(self, table: RoutingTable, *, timeout_s: float = SCRAPE_TIMEOUT_S,
                 max_bytes: int = MAX_METRICS_BYTES) -> None:
        self._table = table
        self._timeout_s = timeout_s
        self._max_bytes = max_bytes
        self._session: aiohttp.ClientSession | None = None
        #: The scrape in flight per endpoint: a slow engine is asked again only once it
        #: has answered or timed out.
        self._scraping: dict[Endpoint, asyncio.Task[None]] = {}
        #: Endpoints whose scrapes fail, and since when: logged once per outage.
        self._failing: dict[Endpoint, float] = {}

    def open(self) -> None:
        """Open the connection pool (inside the running event loop). Apart from the
        forwarder's: scrapes never take a connection a request could use."""
        self._session = aiohttp.ClientSession(
            # One scrape per endpoint at most, so the endpoints bound the connections; a
            # pool limit would only queue scrapes behind each other into their timeout.
            connector=aiohttp.TCPConnector(limit=0),
            cookie_jar=aiohttp.DummyCookieJar(),
            # No compression asked for: the page is small, and inflating it costs the
            # event loop more than the bytes cost the network.
            skip_auto_headers=("User-Agent", "Accept-Encoding"))

    async def close(self) -> None:
        """Stop the scrapes in flight and close the pool."""
        tasks = list(self._scraping.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def scrape(self) -> list[asyncio.Task[None]]:
        """Start one scrape of each routed endpoint whose engine has a queue gauge and
        that has none in flight; return those started (tests await them). The answers
        land on the endpoints; nothing here waits for them."""
        started: list[asyncio.Task[None]] = []
        routed: set[Endpoint] = set()
        for entry in self._table.models.values():
            gauge = QUEUE_GAUGES.get(entry.route.engine or "")
            if gauge is None:
                continue
            for endpoint in entry.endpoints:
                routed.add(endpoint)
                if endpoint in self._scraping:
                    continue
                task = asyncio.create_task(self._scrape(endpoint, gauge),
                                           name=f"engine-queue-{endpoint.replica_id}")
                self._scraping[endpoint] = task
                task.add_done_callback(self._done_with(endpoint))
                started.append(task)
        # An endpoint out of routing is not asked again: its outage is over for us.
        for endpoint in [e for e in self._failing if e not in routed]:
            del self._failing[endpoint]
        return started

    def _done_with(self, endpoint: Endpoint) -> Callable[[asyncio.Task[None]], None]:
        def done(_task: asyncio.Task[None]) -> None:
            self._scraping.pop(endpoint, None)
        return done

    async def _scrape(self, endpoint: Endpoint, gauge: str) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                value = await self._read(endpoint, gauge)
        except (aiohttp.ClientError, TimeoutError, ScrapeFailed, ValueError) as exc:
            # UnicodeDecodeError is a ValueError: a page that is not text is garbage too.
            endpoint.engine_waiting = None
            self._failed(endpoint, exc)
            return
        endpoint.engine_waiting = value
        began = self._failing.pop(endpoint, None)
        if began is not None:
            log.info("reading replica %s's queue again after %.0fs", endpoint.replica_id,
                     time.monotonic() - began)

    async def _read(self, endpoint: Endpoint, gauge: str) -> int:
        assert self._session is not None, "open() first"
        # name[] asks a prometheus_client exposition (vLLM's, SGLang's) for this gauge
        # alone; an engine that ignores it sends the whole page, filtered here.
        async with self._session.get(endpoint.url + "/metrics", params={"name[]": gauge},
                                     headers=endpoint.headers) as response:
            if response.status != 200:
                raise ScrapeFailed(f"/metrics answered {response.status}")
            body = await _read_capped(response, self._max_bytes)
        value = queue_length(body.decode(), gauge)
        if value is None:
            raise ScrapeFailed(f"its /metrics has no {gauge}")
        return value

    def _failed(self, endpoint: Endpoint, exc: BaseException) -> None:
        if endpoint in self._failing:
            return
        self._failing[endpoint] = time.monotonic()
        reason = str(exc) or type(exc).__name__
        log.warning("cannot read the queue of replica %s of %s at %s (%s); counting it "
                    "unknown until it answers", endpoint.replica_id, endpoint.model,
                    endpoint.url, reason)
