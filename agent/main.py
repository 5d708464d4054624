"""`modelkeeper agent`: registers the node, heartbeats, keeps its liveness stream open, and
runs the node's Temporal worker.

The agent is the only part of modelkeeper that touches engine processes. It keeps engines
running across its own restarts: stopping the agent leaves them up, and the next agent
adopts them (see :mod:`agent.shards`).

How the control plane notices a dead node (docs/keeper.md, "Liveness"): the agent keeps
one streaming request open to the API and writes a ping line on it every
``liveness_interval_s``, and ``bye`` before a planned stop. A kill -9 closes that socket at
once; a frozen agent stops writing. The watch activities therefore need not heartbeat to
Temporal often: the worker uses the SDK's default throttle (0.8 x the heartbeat timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import time
from collections.abc import AsyncIterator, Callable

import httpx
from temporalio.worker import Worker

# MAX_HEARTBEAT_THROTTLE in activities.node is no longer used here: the watch's heartbeats
# are only a backstop now, so the SDK's default throttle applies (see the docstring).
from activities.node import NodeActivities
from modelkeeper import __version__
from modelkeeper.domain.liveness import BYE, PING
from modelkeeper.domain.nodes import AgentHeartbeat, AgentRegistration, AgentWelcome, Inventory
from modelkeeper.domain.units import parse_bytes
from modelkeeper.infra import temporal
from modelkeeper.infra.secrets import read_engine_key_secret
from modelkeeper.settings import Settings

from .identity import load_or_create_node_id
from .inventory import read_available_memory, read_inventory
from .shards import ShardManager

log = logging.getLogger(__name__)

#: A node watches one activity per shard plus starts and stops; the SDK's default of 100
#: concurrent activities would cap a busy node (measured fact, shared/FACTS.md).
MAX_CONCURRENT_ACTIVITIES = 1000

#: A broken liveness stream is reopened after this long, doubling up to the cap, each wait
#: jittered down by up to half. Short: until it is back the API counts the node silent (its
#: replicas are routed around and probed). The cap and the jitter spread 1,000 agents
#: reconnecting to an API that restarts.
LIVENESS_RETRY_FIRST_S = 0.1
LIVENESS_RETRY_MAX_S = 2.0
#: After ``stop``, how long the agent waits for the API to answer its ``bye``: it answers
#: in milliseconds, and an agent must not hang on its way out when the API is away.
LIVENESS_BYE_TIMEOUT_S = 2.0


class AgentConfigError(Exception):
    """A setting the agent cannot run with; reported as one line."""


def _declared_memory(settings: Settings) -> int | None:
    try:
        return parse_bytes(settings.node_memory) if settings.node_memory else None
    except ValueError as exc:
        raise AgentConfigError(f"--memory / MODELKEEPER_NODE_MEMORY: {exc}") from None


def _inventory_reader(settings: Settings) -> Callable[[], Inventory]:
    memory = _declared_memory(settings)
    return lambda: read_inventory(declared_memory=memory, declared_cpus=settings.node_cpus)


async def _register(http: httpx.AsyncClient, reg: Callable[[], AgentRegistration],
                    stop: asyncio.Event) -> AgentWelcome | None:
    """Register, retrying while the API is unreachable; None if stopped first."""
    delay = 0.2
    while not stop.is_set():
        try:
            resp = await http.post("/nodes/register", json=reg().model_dump(mode="json"))
            if resp.status_code == 401:
                raise AgentConfigError(f"the API refused the join token: {resp.text}")
            resp.raise_for_status()
            return AgentWelcome.model_validate(resp.json())
        except httpx.HTTPError as exc:
            log.warning("registration failed (%s); retrying in %.1fs", exc, delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        delay = min(delay * 2, 5.0)
    return None


async def run_agent(settings: Settings, stop: asyncio.Event) -> None:
    """Run the agent until ``stop`` is set."""
    secret = read_engine_key_secret(settings)
    if not secret:
        raise AgentConfigError(
            "set MODELKEEPER_ENGINE_KEY_SECRET (or run with the data dir of `modelkeeper up`, "
            f"which keeps it in {settings.engine_key_secret_file}): each engine's API key is "
            "derived from it, and the gateway must hold the same one")
    inventory = _inventory_reader(settings)
    declared_memory = _declared_memory(settings)
    node_id = load_or_create_node_id(settings.agent_dir)
    name = settings.node_name or socket.gethostname()
    manager = ShardManager(node_id=node_id, agent_dir=settings.agent_dir,
                           engine_host=settings.engine_host,
                           port_range=settings.engine_ports,
                           key_secret=secret.encode(),
                           llama_server_path=settings.llama_server_path,
                           max_concurrent_startups=settings.max_concurrent_startups,
                           available_memory=lambda: read_available_memory(
                               declared_memory=declared_memory))
    adopted, killed = manager.recover()
    log.info("node %s (%s): adopted %d shard(s), killed %d unidentified engine(s)",
             node_id, name, len(adopted), len(killed))

    def registration() -> AgentRegistration:
        return AgentRegistration(node_id=node_id, name=name, labels=settings.node_labels,
                                 inventory=inventory(), shards=manager.reports(),
                                 agent_version=__version__)

    headers = {"Authorization": f"Bearer {settings.join_token}"} if settings.join_token else {}
    try:
        async with httpx.AsyncClient(base_url=settings.api_url, headers=headers,
                                     timeout=httpx.Timeout(5.0)) as http:
            welcome = await _register(http, registration, stop)
            if welcome is None:
                return
            liveness = asyncio.create_task(
                _liveness_loop(http, node_id, settings.liveness_interval_s, stop))
            try:
                client = await temporal.connect(welcome.temporal_address,
                                                welcome.temporal_namespace)
                # The SDK's default heartbeat throttle: a watch heartbeats to Temporal once
                # per 0.8 x watch_heartbeat_timeout_s (48 s at 60 s), since the liveness
                # stream, not the watch, is what notices a dead node.
                worker = Worker(client, task_queue=welcome.task_queue,
                                activities=NodeActivities(manager).all(),
                                max_concurrent_activities=MAX_CONCURRENT_ACTIVITIES)
                async with worker:
                    log.info("node %s registered; polling %s", node_id, welcome.task_queue)
                    await _heartbeat_loop(http, node_id, welcome, inventory, manager,
                                          registration, settings, stop)
            finally:
                await _end_liveness(liveness, stop)
    finally:
        if settings.agent_stop_engines_on_exit:
            for report in manager.reports():
                await manager.stop(report.replica_id, grace_s=5.0)
        await manager.close()


async def _heartbeat_loop(http: httpx.AsyncClient, node_id: str, welcome: AgentWelcome,
                          inventory: Callable[[], Inventory], manager: ShardManager,
                          registration: Callable[[], AgentRegistration],
                          settings: Settings, stop: asyncio.Event) -> None:
    interval = settings.heartbeat_interval_s
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
        if stop.is_set():
            return
        beat = AgentHeartbeat(inventory=inventory(), shards=manager.reports())
        try:
            resp = await http.post(f"/nodes/{node_id}/heartbeat",
                                   json=beat.model_dump(mode="json"))
            if resp.status_code == 404:
                # The control plane forgot us (a fresh database): register again.
                await http.post("/nodes/register",
                                json=registration().model_dump(mode="json"))
            elif resp.status_code >= 400:
                log.warning("heartbeat refused: %s %s", resp.status_code, resp.text)
        except httpx.HTTPError as exc:
            # The API being down must not touch engines: they keep serving.
            log.warning("heartbeat failed: %s", exc)
        await manager.reap_orphans(settings.orphan_grace_s)


async def _liveness_loop(http: httpx.AsyncClient, node_id: str, interval_s: float,
                         stop: asyncio.Event) -> None:
    """Keep one liveness stream open to the API until ``stop``, which ends it with ``bye``.

    Reopened whenever it ends otherwise (the API restarted, the network broke, the API
    answered early), after a short jittered backoff.
    """
    delay = LIVENESS_RETRY_FIRST_S
    while not stop.is_set():
        opened_at = time.monotonic()
        try:
            resp = await http.post(f"/nodes/{node_id}/liveness",
                                   content=_pings(interval_s, stop))
            outcome = f"answered {resp.status_code} {resp.text.strip()}"
            if resp.status_code == 401:
                log.error("the API refused the liveness stream: %s", resp.text)
        except httpx.HTTPError as exc:
            outcome = f"failed ({exc!r})"
        if stop.is_set():
            return
        if time.monotonic() - opened_at > LIVENESS_RETRY_MAX_S:
            delay = LIVENESS_RETRY_FIRST_S  # it served a while: a fresh break, not a streak
        wait_s = delay * random.uniform(0.5, 1.0)
        log.warning("liveness stream %s; reopening in %.2fs", outcome, wait_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait_s)
        delay = min(delay * 2, LIVENESS_RETRY_MAX_S)


async def _pings(interval_s: float, stop: asyncio.Event) -> AsyncIterator[bytes]:
    """The body of a liveness stream: a ping at once and every ``interval_s``; ``bye`` when
    ``stop`` is set, and then the end of the body."""
    while not stop.is_set():
        yield PING + b"\n"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
    yield BYE + b"\n"


async def _end_liveness(liveness: asyncio.Task[None], stop: asyncio.Event) -> None:
    """On a graceful stop (``stop`` set) let the stream say ``bye``; otherwise (the agent is
    failing) cut it, so that the API counts the node silent, as it is."""
    if stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(liveness), LIVENESS_BYE_TIMEOUT_S)
    liveness.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await liveness
