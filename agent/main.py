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

While the control plane is away the agent keeps retrying at its usual pace (so it is back
within seconds of the API), but says so in few lines: the first failure at once, then
after growing gaps, each line one sentence naming how many it stands for
(:class:`modelkeeper.infra.logs.LogBackoff`), and one line when the API answers again.

What one node does is :func:`run_node` over a :class:`Node`; :func:`run_agent` runs one,
and the benchmarks' fleet (``python -m bench.fleet --fleet N``, :mod:`bench.fleet.nodes`)
runs many in one process through the same code.

On SIGINT or SIGTERM it stops polling, says ``bye``, and leaves its engines running for the
next agent to adopt, saying so; with ``agent_stop_engines_on_exit``
(``--stop-engines-on-exit``) it stops them instead, which is how a node leaves for good
(docs/second-machine.md: drain, stop with the flag, ``nodes rm``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker

# MAX_HEARTBEAT_THROTTLE in activities.node is no longer used here: the watch's heartbeats
# are only a backstop now, so the SDK's default throttle applies (see the docstring).
from activities.node import NodeActivities, NodeLogActivities, ShardRunner
from modelkeeper import __version__
from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.liveness import BYE, PING
from modelkeeper.domain.nodes import (
    MAX_PORT,
    NODE_CREDENTIAL_HEADER,
    NODE_NAME_PATTERN,
    NODE_NAME_RULE,
    AgentHeartbeat,
    AgentRegistration,
    AgentWelcome,
    HeartbeatAnswer,
    Inventory,
    PortRange,
    is_loopback,
)
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.tunables import WatchdogTunables
from modelkeeper.domain.units import parse_bytes
from modelkeeper.infra import temporal
from modelkeeper.infra.files import make_private_dir
from modelkeeper.infra.logs import LogBackoff, one_line, repeat_note
from modelkeeper.infra.secrets import read_join_token
from modelkeeper.settings import Settings

from .identity import load_credential, load_or_create_node_id, save_credential
from .inventory import read_available_memory, read_engine_versions, read_inventory
from .shards import ShardManager
from .watchdog import Watchdog

log = logging.getLogger(__name__)

#: A node watches one activity per shard plus starts and stops; the SDK's default of 100
#: concurrent activities would cap a busy node (measured fact, shared/FACTS.md).
MAX_CONCURRENT_ACTIVITIES = 1000
#: Long polls a node keeps open on its task queue. The SDK's default, 5, is for queues with
#: traffic; a node's carries a few tasks per replica it ever runs, and one poll takes the
#: next task as soon as the last arrived. Each open poll is the server's to hold: 5,000 of
#: them at 1,000 nodes, renewed about once a minute each (bench/scale).
NODE_ACTIVITY_POLLS = 1

#: A broken liveness stream is reopened after this long, doubling up to the cap, each wait
#: jittered down by up to half. Short: until it is back the API counts the node silent (its
#: replicas are routed around and probed). The cap and the jitter spread 1,000 agents
#: reconnecting to an API that restarts.
LIVENESS_RETRY_FIRST_S = 0.1
LIVENESS_RETRY_MAX_S = 2.0
#: A registration the API did not answer (or a connection Temporal refused) is tried again
#: after this long, doubling up to the cap: an agent started beside its stack joins within
#: a fraction of a second of the API, and one whose API is away for long still joins
#: within 5 s of its return.
REGISTRATION_RETRY_FIRST_S = 0.2
REGISTRATION_RETRY_MAX_S = 5.0
#: After ``stop``, how long the agent waits for the API to answer its ``bye``: it answers
#: in milliseconds, and an agent must not hang on its way out when the API is away.
LIVENESS_BYE_TIMEOUT_S = 2.0


#: With --stop-engines-on-exit, each engine gets this long after SIGTERM before SIGKILL, all
#: at once: llama.cpp and the sim exit in well under a second, vLLM frees its GPU memory in
#: a few; an engine that does not is killed rather than waited on (as `up` does).
STOP_ON_EXIT_GRACE_S = 5.0

#: The calls whose failures the log thins out (LogBackoff kinds), one per loop.
REGISTRATION = "registration"
TEMPORAL_CONNECT = "connecting to Temporal"
HEARTBEAT = "heartbeat"
LIVENESS = "liveness stream"

#: Answers to a registration that retrying cannot change: the join token or the node's
#: credential is wrong or missing (a credential lost since it was issued: the answer says
#: an operator must remove the node), or the agent advertises an address that is not its
#: own (403), another node has its name (409), or its registration is malformed (422).
#: A 429 (too many registrations from this address) is retried, as is any other error.
REGISTRATION_REFUSALS = frozenset({401, 403, 409, 422})


class AgentConfigError(Exception):
    """A setting the agent cannot run with; reported as one line."""


class NodeIdentity:
    """What the agent presents: the join token to join, then the node's own credential
    (kept in its data dir, mode 0600, beside its id). Headers are built per request, since
    a registration may issue a new credential while the liveness stream retries."""

    def __init__(self, agent_dir: Path, join_token: str | None) -> None:
        self._dir = agent_dir
        self._join_token = join_token
        self.credential = load_credential(agent_dir)

    def registration_headers(self) -> dict[str, str]:
        """The join token (a first join, or a return after the node was removed) and the
        credential (a return): the API takes whichever this node may use."""
        headers = {}
        if self._join_token is not None:
            headers["Authorization"] = f"Bearer {self._join_token}"
        if self.credential is not None:
            headers[NODE_CREDENTIAL_HEADER] = self.credential
        return headers

    def node_headers(self) -> dict[str, str]:
        """For heartbeats and the liveness stream: the node's credential."""
        return {} if self.credential is None else {"Authorization": f"Bearer {self.credential}"}

    def welcomed(self, welcome: AgentWelcome, manager: ShardManager) -> None:
        """Keep what a registration handed over: a new credential, and the node key."""
        if welcome.node_credential is not None:
            save_credential(self._dir, welcome.node_credential)
            self.credential = welcome.node_credential
        manager.use_node_key(welcome.node_key)


def advertised_engine_host(settings: Settings) -> str:
    """The address engines listen on and endpoints carry: ``engine_host`` when set.

    Unset, and with the API on another machine, it is this machine's address towards the
    API, which is what the API sees the registration come from and accepts endpoints on
    (docs/security.md): so a second machine needs only the API's URL and the join token.
    """
    if "engine_host" in settings.model_fields_set:
        return settings.engine_host
    parts = urlsplit(settings.api_url)
    host = parts.hostname
    if host is None or is_loopback(host):
        return settings.engine_host
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_DGRAM)[0]
        # A datagram socket's connect sends nothing: it only picks the route, and so the
        # local address a connection to the API would come from.
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            local: str = probe.getsockname()[0]
    except OSError as exc:
        log.warning("cannot find this machine's address towards %s (%s); engines use "
                    "engine_host %s", host, exc, settings.engine_host)
        return settings.engine_host
    return local


def declared_memory(settings: Settings) -> int | None:
    """The memory the node declares (``--memory``), in bytes; None when it declares none."""
    try:
        return parse_bytes(settings.node_memory) if settings.node_memory else None
    except ValueError as exc:
        raise AgentConfigError(f"--memory / MODELKEEPER_NODE_MEMORY: {exc}") from None


def engine_port_range(settings: Settings) -> PortRange:
    """``--engine-port-range`` as a :class:`PortRange`; an AgentConfigError naming it when
    its ends are not ports or run high to low."""
    low, high = settings.engine_ports
    if not 1 <= low <= high <= MAX_PORT:
        raise AgentConfigError(
            f"--engine-port-range / MODELKEEPER_ENGINE_PORT_RANGE {low}-{high}: ports run "
            f"from 1 to {MAX_PORT}, the low end first (e.g. 20000-20999)")
    return PortRange(low=low, high=high)


def node_name_problem(name: str) -> str | None:
    """Why the API would refuse ``name`` for a node (the sentence's end); None when it
    would not."""
    if re.fullmatch(NODE_NAME_PATTERN, name):
        return None
    return f"a node's name must be {NODE_NAME_RULE}"


def writable_agent_dir(settings: Settings, *under: str) -> Path:
    """The agent's folder in the data dir (or ``under`` it), made when missing and written
    once to see that it can be; an AgentConfigError naming the data dir when not, rather
    than a traceback from the first file the agent writes there. The agent's folder is
    made private (0700; modelkeeper.infra.files): it holds the node's credential."""
    path = settings.agent_dir.joinpath(*under)
    try:
        make_private_dir(settings.agent_dir)
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise AgentConfigError(
            f"--data-dir / MODELKEEPER_DATA_DIR {settings.data_dir}: the agent keeps its "
            f"files in {path} and cannot write there ({exc.strerror or exc}); give a data "
            "dir this user can write") from None
    return path


def _inventory_reader(settings: Settings) -> Callable[[], Inventory]:
    memory = declared_memory(settings)
    return lambda: read_inventory(declared_memory=memory, declared_cpus=settings.node_cpus)


async def _register_once(http: httpx.AsyncClient, reg: AgentRegistration,
                         identity: NodeIdentity, manager: ShardManager) -> AgentWelcome:
    """One registration; what it hands over is kept (see :meth:`NodeIdentity.welcomed`).
    Raises AgentConfigError for a refusal, httpx.HTTPError for anything to retry."""
    resp = await http.post("/nodes/register", json=reg.model_dump(mode="json"),
                           headers=identity.registration_headers())
    if resp.status_code == 422 and reg.engines is not None:
        # An API older than the engines report refuses the field: register without it
        # (placement then takes the node as able to run any engine, as it did).
        log.info("the API does not take engine versions (422); registering without them")
        resp = await http.post("/nodes/register",
                               json=reg.model_dump(mode="json", exclude={"engines"}),
                               headers=identity.registration_headers())
    if resp.status_code in REGISTRATION_REFUSALS:
        raise AgentConfigError(f"the API refused to register node {reg.node_id} "
                               f"({resp.status_code}): {_detail(resp)}")
    resp.raise_for_status()
    welcome = AgentWelcome.model_validate(resp.json())
    identity.welcomed(welcome, manager)
    return welcome


def _detail(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("detail", resp.text))
    except ValueError:
        return resp.text


def _failed(notes: LogBackoff, kind: str, exc: BaseException, *, retry: str) -> None:
    """One line for a failed call to the control plane, when ``notes`` says one is due."""
    count = notes.failed(kind, now=time.monotonic())
    if count is not None:
        log.warning("%s failed (%s); %s%s; next note within %.0fs if it goes on", kind,
                    one_line(exc), retry, repeat_note(count), notes.next_gap_s(kind))


def _succeeded(notes: LogBackoff, kind: str) -> None:
    """One line when a call that was failing works again."""
    failing_for = notes.recovered(kind, now=time.monotonic())
    if failing_for is not None:
        log.info("%s works again (it failed for %.0fs)", kind, failing_for)


async def _register(http: httpx.AsyncClient, reg: Callable[[], AgentRegistration],
                    identity: NodeIdentity, manager: ShardManager,
                    stop: asyncio.Event, *, notes: LogBackoff) -> AgentWelcome | None:
    """Register, retrying while the API is unreachable; None if stopped first."""
    delay = REGISTRATION_RETRY_FIRST_S
    while not stop.is_set():
        try:
            welcome = await _register_once(http, reg(), identity, manager)
        except httpx.HTTPError as exc:
            _failed(notes, REGISTRATION, exc, retry=f"retrying in {delay:.1f}s, backing off "
                    f"to every {REGISTRATION_RETRY_MAX_S:.0f}s")
        else:
            _succeeded(notes, REGISTRATION)
            return welcome
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        delay = min(delay * 2, REGISTRATION_RETRY_MAX_S)
    return None


async def _connect_temporal(welcome: AgentWelcome, settings: Settings, stop: asyncio.Event,
                            *, notes: LogBackoff) -> Client | None:
    """A client for the Temporal the API named, retrying while it refuses (it may be
    restarting, or still starting beside the API); None if stopped first.

    The address comes from the API; the TLS material and key never do: each machine keeps
    its own (docs/security.md).
    """
    security = temporal.security_from_settings(settings)
    delay = REGISTRATION_RETRY_FIRST_S
    while not stop.is_set():
        try:
            client = await temporal.connect(welcome.temporal_address,
                                            welcome.temporal_namespace, security=security)
        # What the SDK raises for a server that refuses or is unreachable.
        except (RPCError, RuntimeError, OSError) as exc:
            _failed(notes, TEMPORAL_CONNECT, exc,
                    retry=f"retrying {welcome.temporal_address} in {delay:.1f}s, backing "
                          f"off to every {REGISTRATION_RETRY_MAX_S:.0f}s")
        else:
            _succeeded(notes, TEMPORAL_CONNECT)
            return client
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        delay = min(delay * 2, REGISTRATION_RETRY_MAX_S)
    return None


#: Called after each heartbeat the API answered: when it was sent (seconds since the
#: epoch) and how long the answer took (seconds). The benchmarks' fleet records them.
HeartbeatObserver = Callable[[float, float], None]


@dataclass
class Node:
    """One node this process speaks for: what it registers as, and its engines. An agent
    holds one; the benchmarks' fleet (:mod:`bench.fleet.nodes`) holds many in one process."""

    node_id: NodeId
    name: str
    labels: dict[str, str]
    identity: NodeIdentity
    manager: ShardManager
    inventory: Callable[[], Inventory]
    engine_host: str
    engine_ports: PortRange
    #: Each node thins out its own failure lines: one node's outage is not another's.
    notes: LogBackoff = field(default_factory=LogBackoff)
    #: Measures the node's real memory at each heartbeat (agent.watchdog). None: the
    #: heartbeat carries no memory report (the benchmarks' fleet, whose nodes share one
    #: process and one machine's memory).
    watchdog: Watchdog | None = None
    #: The engines this node can run and their versions (agent.inventory), read once:
    #: installing an engine means restarting the agent. None: not reported.
    engines: dict[EngineKind, str] | None = None

    def registration(self) -> AgentRegistration:
        return AgentRegistration(node_id=self.node_id, name=self.name, labels=self.labels,
                                 inventory=self.inventory(), shards=self.manager.reports(),
                                 agent_version=__version__, engine_host=self.engine_host,
                                 engine_ports=self.engine_ports, engines=self.engines)


@dataclass
class NodeRun:
    """What a running node holds, filled in as :func:`run_node` gets there: where the
    benchmarks' fleet reaches to make a node die as a killed agent would (its stream cut at
    once, its worker polling no more)."""

    liveness: asyncio.Task[None] | None = None
    worker: Worker | None = None


class TemporalClients:
    """A Temporal client per address and namespace the API names, connected once: an
    agent has one, and the nodes of a fleet share one instead of a thousand connections."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._clients: dict[tuple[str, str], Client] = {}
        self._lock = asyncio.Lock()

    async def get(self, welcome: AgentWelcome, stop: asyncio.Event, *,
                  notes: LogBackoff) -> Client | None:
        """The client for ``welcome``'s Temporal, connecting (and retrying) on first use;
        None if stopped first."""
        key = (welcome.temporal_address, welcome.temporal_namespace)
        async with self._lock:
            if key not in self._clients:
                client = await _connect_temporal(welcome, self._settings, stop, notes=notes)
                if client is None:
                    return None
                self._clients[key] = client
            return self._clients[key]


async def run_agent(settings: Settings, stop: asyncio.Event) -> None:
    """Run the agent until ``stop`` is set.

    It needs the API's URL and, to join from another machine, the join token; no cluster
    secret: the API hands it its node's key at registration.
    """
    try:
        join_token = read_join_token(settings)
    except ValueError as exc:
        raise AgentConfigError(str(exc)) from None
    memory = declared_memory(settings)
    ports = engine_port_range(settings)
    name = settings.node_name or socket.gethostname()
    if (problem := node_name_problem(name)) is not None:
        raise AgentConfigError(f"--name {name!r}: {problem}")
    node_id = load_or_create_node_id(writable_agent_dir(settings))
    engine_host = advertised_engine_host(settings)
    manager = ShardManager(node_id=node_id, agent_dir=settings.agent_dir,
                           engine_host=engine_host,
                           port_range=(ports.low, ports.high),
                           llama_server_path=settings.llama_server_path,
                           max_concurrent_startups=settings.max_concurrent_startups,
                           available_memory=lambda: read_available_memory(
                               declared_memory=memory))
    node = Node(node_id=node_id, name=name, labels=settings.node_labels,
                identity=NodeIdentity(settings.agent_dir, join_token), manager=manager,
                inventory=_inventory_reader(settings), engine_host=engine_host,
                engine_ports=ports,
                engines=read_engine_versions(settings.llama_server_path),
                watchdog=Watchdog(WatchdogTunables.model_validate(settings.model_dump(
                    include=set(WatchdogTunables.model_fields))), declared_memory=memory))
    adopted, killed = manager.recover()
    log.info("node %s (%s): adopted %d shard(s), killed %d unidentified engine(s)",
             node_id, node.name, len(adopted), len(killed))
    try:
        async with httpx.AsyncClient(base_url=settings.api_url,
                                     timeout=httpx.Timeout(5.0)) as http:
            await run_node(node, settings, stop, http=http,
                           temporal=TemporalClients(settings))
    finally:
        await _leave_engines(manager, stop_them=settings.agent_stop_engines_on_exit)
        await manager.close()


async def run_node(node: Node, settings: Settings, stop: asyncio.Event, *,
                   http: httpx.AsyncClient, temporal: TemporalClients,
                   streams: httpx.AsyncClient | None = None,
                   activities: ShardRunner | None = None, run: NodeRun | None = None,
                   on_heartbeat: HeartbeatObserver | None = None) -> None:
    """Speak for ``node`` until ``stop`` is set: register it, keep its liveness stream
    open, poll its task queue, heartbeat. Its engines are left as they are.

    ``http`` carries registrations and heartbeats, ``streams`` (``http`` unless given) the
    liveness stream; ``activities`` (the node's manager unless given) is what its
    activities drive; ``run`` is filled in as the node gets going (see :class:`NodeRun`).
    """
    run = run or NodeRun()
    welcome = await _register(http, node.registration, node.identity, node.manager, stop,
                              notes=node.notes)
    if welcome is None:
        return
    run.liveness = asyncio.create_task(
        _liveness_loop(streams or http, node.node_id, node.identity,
                       settings.liveness_interval_s, stop, notes=node.notes))
    try:
        client = await temporal.get(welcome, stop, notes=node.notes)
        if client is None:
            return
        # The SDK's default heartbeat throttle: a watch heartbeats to Temporal once per
        # 0.8 x watch_heartbeat_timeout_s (48 s at 60 s), since the liveness stream, not
        # the watch, is what notices a dead node.
        run.worker = Worker(client, task_queue=welcome.task_queue,
                            activities=[*NodeActivities(activities or node.manager).all(),
                                        *NodeLogActivities(node.manager).all()],
                            max_concurrent_activities=MAX_CONCURRENT_ACTIVITIES,
                            activity_task_poller_behavior=PollerBehaviorSimpleMaximum(
                                NODE_ACTIVITY_POLLS))
        async with run.worker:
            log.info("node %s registered; polling %s on Temporal at %s", node.node_id,
                     welcome.task_queue, welcome.temporal_address)
            await _heartbeat_loop(http, node, settings, stop, on_heartbeat=on_heartbeat)
    finally:
        await _end_liveness(run.liveness, stop)


async def _leave_engines(manager: ShardManager, *, stop_them: bool) -> None:
    """On the way out: stop every engine (the node leaves for good), or say that they keep
    running, and how to stop them, since an operator who stops an agent may expect them
    gone."""
    running = manager.reports()
    if not running:
        return
    if not stop_them:
        log.info("leaving %d engine(s) running for the next agent on this node to adopt; "
                 "to take the node out for good: modelkeeper drain NODE, then run the agent "
                 "again with --stop-engines-on-exit and stop it (docs/second-machine.md)",
                 len(running))
        return
    log.info("stopping %d engine(s) (--stop-engines-on-exit)", len(running))
    exits = await manager.stop_all(STOP_ON_EXIT_GRACE_S)
    left = manager.reports()
    log.info("stopped %d engine(s); %s", len(exits),
             "none left running" if not left
             else f"still running: {', '.join(r.replica_id for r in left)}")


async def _heartbeat_loop(http: httpx.AsyncClient, node: Node, settings: Settings,
                          stop: asyncio.Event, *,
                          on_heartbeat: HeartbeatObserver | None = None) -> None:
    interval = settings.heartbeat_interval_s
    manager, notes = node.manager, node.notes
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
        if stop.is_set():
            return
        beat = _heartbeat(node)
        sent_at = time.monotonic()
        sent_wall = time.time()
        try:
            resp = await http.post(f"/nodes/{node.node_id}/heartbeat",
                                   json=_heartbeat_json(beat),
                                   headers=node.identity.node_headers())
            if resp.status_code == 422 and (beat.memory is not None or beat.oom_kills
                                            or beat.starts):
                # An API older than the watchdog refuses a heartbeat with fields it does
                # not know (AgentHeartbeat is strict): send it again without them, so an
                # agent upgraded before its API keeps its node alive. Each heartbeat tries
                # with them first, so the watchdog speaks again once the API is upgraded.
                beat = AgentHeartbeat(inventory=beat.inventory, shards=beat.shards)
                resp = await http.post(f"/nodes/{node.node_id}/heartbeat",
                                       json=_heartbeat_json(beat),
                                       headers=node.identity.node_headers())
            if on_heartbeat is not None:
                on_heartbeat(sent_wall, time.monotonic() - sent_at)
            if resp.status_code in (200, 204) and node.watchdog is not None:
                # Recorded: the kills it carried need not be sent again.
                node.watchdog.kills_reported(len(beat.oom_kills))
            if resp.status_code == 200:
                # An API one version behind answers 204 with no body: nothing to compare.
                answer = HeartbeatAnswer.model_validate(resp.json())
                await manager.stop_unclaimed(set(answer.claimed_replica_ids),
                                             ran_before=sent_at)
            elif resp.status_code == 404:
                # The control plane forgot us (a fresh database, or an operator removed
                # the node): join again, with the join token.
                await _register_once(http, node.registration(), node.identity, manager)
            elif resp.status_code >= 400:
                log.warning("heartbeat refused: %s %s", resp.status_code, _detail(resp))
            _succeeded(notes, HEARTBEAT)
        except httpx.HTTPError as exc:
            # The API being down must not touch engines: they keep serving.
            _failed(notes, HEARTBEAT, exc, retry=f"retrying every {interval:g}s")
        except ValueError as exc:
            # An answer this agent cannot read (JSON, or a shape it does not know): stop
            # nothing on its strength; the orphan reaper remains the backstop.
            log.warning("heartbeat answer unreadable, ignored: %s", exc)
        except AgentConfigError as exc:
            # Engines keep serving; an operator must act (the log says how).
            log.error("%s", exc)
        await manager.reap_orphans(settings.orphan_grace_s)


def _heartbeat_json(beat: AgentHeartbeat) -> dict[str, object]:
    """The heartbeat's body, without the watchdog's fields when they say nothing: an API
    older than the watchdog refuses any key it does not know."""
    body = beat.model_dump(mode="json")
    if beat.memory is None:
        del body["memory"]
    if not beat.oom_kills:
        del body["oom_kills"]
    if not beat.starts:
        del body["starts"]
    return body


def _heartbeat(node: Node) -> AgentHeartbeat:
    """This heartbeat's body: the inventory, the shards, and the watchdog's report with
    the memory kills not yet answered."""
    shards = node.manager.reports()
    starts = node.manager.start_progress()
    watchdog = node.watchdog
    if watchdog is None:
        return AgentHeartbeat(inventory=node.inventory(), shards=shards, starts=starts)
    kills = node.manager.memory_kills
    # Taken before the check, which forgets the peaks of engines that are gone.
    watchdog.take_kills([(spec.replica_id, spec.model_id, ended.detail)
                         for spec, ended in kills])
    kills.clear()
    report = watchdog.check(shards)
    return AgentHeartbeat(inventory=node.inventory(), shards=shards, memory=report,
                          oom_kills=list(watchdog.pending_kills), starts=starts)


async def _liveness_loop(http: httpx.AsyncClient, node_id: str, identity: NodeIdentity,
                         interval_s: float, stop: asyncio.Event, *,
                         notes: LogBackoff) -> None:
    """Keep one liveness stream open to the API until ``stop``, which ends it with ``bye``.

    Reopened whenever it ends otherwise (the API restarted, the network broke, the API
    answered early), after a short jittered backoff.
    """
    delay = LIVENESS_RETRY_FIRST_S
    while not stop.is_set():
        opened_at = time.monotonic()
        failure: BaseException
        try:
            resp = await http.post(
                f"/nodes/{node_id}/liveness", headers=identity.node_headers(),
                content=_pings(interval_s, stop,
                               on_open=lambda: _succeeded(notes, LIVENESS)))
            failure = _StreamEnded(f"answered {resp.status_code} {resp.text.strip()}")
            if resp.status_code in (401, 403):
                log.error("the API refused the liveness stream: %s", resp.text)
        except httpx.HTTPError as exc:
            failure = exc
        if stop.is_set():
            return
        if time.monotonic() - opened_at > LIVENESS_RETRY_MAX_S:
            delay = LIVENESS_RETRY_FIRST_S  # it served a while: a fresh break, not a streak
        wait_s = delay * random.uniform(0.5, 1.0)
        _failed(notes, LIVENESS, failure,
                retry=f"reopening it within {LIVENESS_RETRY_MAX_S:.0f}s each time")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait_s)
        delay = min(delay * 2, LIVENESS_RETRY_MAX_S)


class _StreamEnded(Exception):
    """The API ended the liveness stream with an answer (it restarted, or refused it)."""


async def _pings(interval_s: float, stop: asyncio.Event, *,
                 on_open: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """The body of a liveness stream: a ping at once and every ``interval_s``; ``bye`` when
    ``stop`` is set, and then the end of the body. ``on_open`` is called once the first
    ping has gone out (the client asks for the next chunk only then): the stream is open."""
    opened = False
    while not stop.is_set():
        yield PING + b"\n"
        if not opened and on_open is not None:
            on_open()
        opened = True
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
