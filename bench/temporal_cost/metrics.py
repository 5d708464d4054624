"""The Temporal dev server's own request counters, read from its Prometheus endpoint.

``temporal server start-dev`` serves ``/metrics`` on a random free port unless
``--metrics-port`` is given; the fleet's launcher does not give it, so the port is found
among the server process's listening sockets. Two counters matter:

* ``service_requests{service_name, namespace, operation}``: RPCs each service received.
  Those with ``service_name="frontend"`` are the RPCs clients made (SDK workers, the API,
  the CLI); ``history`` and ``matching`` count the frontend's internal calls.
* ``persistence_requests{service_name, namespace, operation}``: calls to the server's
  database (SQLite here, PostgreSQL or Cassandra in production).

The dev server also runs Temporal's own system worker in namespace ``temporal_system``;
its polls are not ours, so only namespace ``default`` (the fleet's) is attributed.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

#: The counters read at each end of the window.
COUNTERS = ("service_requests", "persistence_requests")
#: A listening socket that is not the metrics endpoint refuses or answers in
#: milliseconds; the endpoint renders ~5,000 series in well under a second.
SCRAPE_TIMEOUT_S = 5.0


class MetricsError(RuntimeError):
    """The server's metrics endpoint could not be found or read."""


@dataclass(frozen=True)
class Key:
    """One series of one counter."""

    counter: str
    service: str
    namespace: str
    operation: str

    def label(self) -> str:
        return (f'{self.counter}{{service_name="{self.service}",'
                f'namespace="{self.namespace}",operation="{self.operation}"}}')


Scrape = Counter[Key]


async def find_metrics_url(pid: int, host: str) -> str:
    """The ``/metrics`` URL of the dev server running as ``pid``: the one listening port
    of the process that answers it with Prometheus text."""
    ports = sorted({c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN})
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as http:
        for port in ports:
            url = f"http://{host}:{port}/metrics"
            with contextlib.suppress(httpx.HTTPError):
                resp = await http.get(url)
                if resp.status_code == 200 and "# TYPE service_requests" in resp.text:
                    return url
    raise MetricsError(f"no listening port of pid {pid} ({ports}) serves /metrics "
                       "with service_requests")


async def scrape(url: str) -> Scrape:
    """The current value of every series of :data:`COUNTERS`."""
    try:
        async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as http:
            resp = await http.get(url)
            resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise MetricsError(f"could not read {url}: {exc}") from exc
    found: Scrape = Counter()
    for family in text_string_to_metric_families(resp.text):
        if family.name not in COUNTERS:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # _created, where an exporter adds it
            labels = sample.labels
            found[Key(family.name, labels.get("service_name", ""),
                      labels.get("namespace", ""), labels.get("operation", ""))] = \
                int(sample.value)
    return found


def delta(start: Scrape, end: Scrape) -> Scrape:
    """What each series counted between two scrapes of the same server (series that first
    appear in ``end`` started from 0)."""
    return Counter({key: end[key] - start.get(key, 0) for key in end
                    if end[key] != start.get(key, 0)})
