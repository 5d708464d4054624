"""The `modelkeeper` command: `up`, each component on its own (`worker`, `api`,
`gateway`, `agent`), the keys and tokens, and the operator commands (``operator_cli``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from modelkeeper.domain.operators import OperatorRole
from modelkeeper.infra.files import private_files
from modelkeeper.settings import Settings, config_table_markdown

from .bench import add_bench_flags, run_bench
from .follow import FollowUp, WaitFailed
from .operator_cli import (
    OPERATOR_COMMANDS,
    ApiError,
    UsageError,
    add_operator_commands,
    operator_token,
    parse_pairs,
    run_operator_command,
    run_tokens_command,
)
from .ports import PORT_FLAGS

__all__ = ["UsageError", "build_parser", "load_settings", "main", "run"]



def _add_common(parser: argparse.ArgumentParser, ports: Sequence[str]) -> None:
    parser.add_argument("--data-dir", type=Path, help="overrides MODELKEEPER_DATA_DIR")
    parser.add_argument("--bind-host", help="overrides MODELKEEPER_BIND_HOST")
    for field in ports:
        parser.add_argument(PORT_FLAGS[field], dest=field, type=int,
                            help=f"overrides MODELKEEPER_{field.upper()}")


def _description() -> str:
    """What `modelkeeper --help` says first: every kind of command, the operator commands
    named from their table so that a new one is listed without an edit here."""
    return ("Keeps LLM deployments served. `up` runs the whole local stack; each component "
            "also runs on its own: `worker`, `api`, `gateway`, and `agent` on each machine "
            "that runs engines (`leave` stops the engines a stopped agent left, when its "
            "node goes for good). `keys` and `tokens` manage the gateway's client API keys "
            "and the API's operator tokens. Through the API: "
            + ", ".join(f"`{name}`" for name in OPERATOR_COMMANDS) + "; through the "
            "gateway and the API: `bench`.")


class _Formatter(argparse.HelpFormatter):
    """argparse's, wrapping the description only at spaces: a command name such as
    `power-cap` is never split at its hyphen across two lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, exposed for tests and docs."""
    parser = argparse.ArgumentParser(prog="modelkeeper", description=_description(),
                                     formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run the whole local stack in the foreground")
    up.add_argument("--no-demo", action="store_true",
                    help="do not deploy the demo model (SmolLM2-135M) on a fresh install")
    up.add_argument("--gateway-auth", dest="gateway_auth", action="store_const", const=True,
                    help="the gateway asks for client API keys (`modelkeeper keys create "
                         "NAME`), as MODELKEEPER_GATEWAY_AUTH=true does; off by default "
                         "under up")
    _add_common(up, list(PORT_FLAGS))
    up.add_argument("--expose-temporal-plaintext", dest="expose_temporal_plaintext",
                    action="store_const", const=True,
                    help="with --bind-host beyond loopback, let Temporal listen there too, in "
                         "plaintext and open to anyone who reaches it, for agents on other "
                         "machines (trusted networks only; up warns). Default: loopback")

    worker = sub.add_parser("worker", help="run the control-plane Temporal worker")
    _add_common(worker, [])

    api = sub.add_parser("api", help="run the HTTP API")
    _add_common(api, ["api_port"])

    agent = sub.add_parser("agent", help="run a node agent (engines on this machine)")
    _add_common(agent, [])
    agent.add_argument("--api-url", help="overrides MODELKEEPER_API_URL")
    agent.add_argument("--join-token-file", type=Path, metavar="PATH",
                       help="a file holding the join token (or set MODELKEEPER_JOIN_TOKEN)")
    # Refused with a sentence rather than unknown to argparse: the flag existed, and a
    # token on a command line is readable by every user of the machine.
    agent.add_argument("--join-token", dest="join_token_on_command_line",
                       help=argparse.SUPPRESS)
    agent.add_argument("--engine-host", metavar="ADDRESS",
                       help="address engines listen on and endpoints carry (default: "
                            "127.0.0.1 with a local API, else this machine's address "
                            "towards the API)")
    agent.add_argument("--name", dest="node_name", help="node name (default: host name)")
    agent.add_argument("--label", dest="labels", action="append", default=[],
                       metavar="KEY=VALUE", help="a node label; repeatable")
    agent.add_argument("--memory", dest="node_memory", metavar="SIZE",
                       help="memory the node declares, e.g. 16GiB")
    agent.add_argument("--cpus", dest="node_cpus", type=int, help="CPUs the node declares")
    agent.add_argument("--engine-port-range", metavar="LOW-HIGH",
                       help="ports for engines, e.g. 20000-20999")
    agent.add_argument("--llama-server", dest="llama_server_path", type=Path,
                       help="native llama-server binary to use instead of xllamacpp")
    agent.add_argument("--stop-engines-on-exit", dest="agent_stop_engines_on_exit",
                       action="store_const", const=True,
                       help="stop every engine of this node when the agent exits (SIGINT, "
                            "SIGTERM), to take the node out for good after `drain`; by "
                            "default engines keep serving and the next agent adopts them")

    ui = sub.add_parser("temporal-ui", help="serve the Temporal web UI behind the API's Host "
                        "allowlist and an admin login (`up` runs it; docs/security.md)")
    _add_common(ui, ["temporal_ui_port"])
    ui.add_argument("--upstream", required=True, metavar="URL",
                    help="the dev server's own UI, on the hidden loopback address `up` chose")

    front = sub.add_parser("temporal-front", help="serve Temporal to agents on other "
                           "machines over TLS with a required client certificate from up's "
                           "own CA (`up --bind-host` runs it; docs/second-machine.md)")
    _add_common(front, ["temporal_mtls_port"])
    front.add_argument("--upstream", required=True, metavar="HOST:PORT",
                       help="the dev server's frontend, on loopback")

    leave = sub.add_parser(
        "leave", help="stop every engine a stopped agent left running on this machine: "
                      "after `drain NODE` and stopping the agent, before `nodes rm NODE` "
                      "(or run the agent with --stop-engines-on-exit instead)")
    _add_common(leave, [])

    gateway = sub.add_parser("gateway", help="run the OpenAI-compatible gateway")
    _add_common(gateway, ["gateway_port"])
    gateway.add_argument("--workers", dest="gateway_workers", type=int,
                         help="overrides MODELKEEPER_GATEWAY_WORKERS")
    gateway.add_argument("--no-auth", dest="gateway_auth", action="store_const", const=False,
                         help="serve without client API keys (local use only; warns)")

    keys = sub.add_parser("keys", help="create, list and revoke the gateway's client API keys")
    _add_common(keys, ["postgres_port"])
    keys_sub = keys.add_subparsers(dest="keys_action", required=True, metavar="ACTION")
    create = keys_sub.add_parser("create", help="create a key and print it (shown once)")
    create.add_argument("keys_argument", metavar="NAME", help="who or what the key is for")
    keys_sub.add_parser("ls", help="list keys (prefixes and names, never the keys)")
    revoke = keys_sub.add_parser("revoke", help="revoke a key")
    revoke.add_argument("keys_argument", metavar="ID_OR_PREFIX")

    tokens = sub.add_parser("tokens", help="create, list and revoke operator tokens for the "
                                           "API (straight in the database)")
    tokens_sub = tokens.add_subparsers(dest="tokens_action", required=True, metavar="ACTION")
    create_token = tokens_sub.add_parser("create", help="create a token and print it "
                                                        "(shown once)")
    create_token.add_argument("token_name", metavar="NAME",
                              help="who holds it: the actor the event history records")
    create_token.add_argument("--role", required=True, choices=[r.value for r in OperatorRole],
                              help="viewer: reads only; admin: every change too")
    create_token.add_argument("--scope", metavar="SCOPE",
                              help="bind it to a scope of the tenancy tree (org, org/team "
                                   "or org/team/project): it changes only the deployments "
                                   "owned there, and nothing else")
    list_tokens = tokens_sub.add_parser("ls", help="list tokens (prefixes, names and roles, "
                                                   "never tokens)")
    revoke_token = tokens_sub.add_parser("revoke", help="revoke a token (at once)")
    revoke_token.add_argument("token_id", metavar="ID_OR_PREFIX")
    # On each action, so the flags go where they are typed: `tokens ls --data-dir DIR`.
    for action in (create_token, list_tokens, revoke_token):
        _add_common(action, ["postgres_port"])

    add_operator_commands(sub, lambda p: _add_common(p, []))

    bench = sub.add_parser("bench", help="measure through the gateway how many concurrent "
                           "requests a replica of a deployed model serves within a latency "
                           "objective, and store it (docs/capacity.md)")
    bench.add_argument("--api-url", help="overrides MODELKEEPER_API_URL")
    bench.add_argument("--json", action="store_true", help="machine-readable output")
    _add_common(bench, ["gateway_port"])
    add_bench_flags(bench)

    sub.add_parser("config-doc", help="print the configuration table (markdown)")
    return parser


def load_settings(args: argparse.Namespace) -> Settings:
    """Settings from the environment, overridden by whichever flags were given."""
    if getattr(args, "join_token_on_command_line", None) is not None:
        raise UsageError("--join-token: a token on the command line is readable by every "
                         "user of this machine (ps); put it in a file readable only by "
                         "you and pass --join-token-file PATH, or set "
                         "MODELKEEPER_JOIN_TOKEN")
    overrides: dict[str, Any] = {
        key: value for key, value in vars(args).items()
        if key in Settings.model_fields and value is not None
    }
    labels = getattr(args, "labels", None)
    if labels:
        overrides["node_labels"] = parse_pairs(labels, flag="--label")
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise UsageError(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, naming the field, the value given and what is allowed."""
    from modelkeeper.settings import env_var_names

    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"])
        if not field:
            # A rule across fields (a model validator): its message names them itself, and
            # the input would be every value given.
            parts.append(err["msg"].removeprefix("Value error, "))
            continue
        if field in Settings.model_fields:
            flag = PORT_FLAGS.get(field, "--" + field.replace("_", "-"))
            field = f"{field} ({flag} or {env_var_names(field)[0]})"
        parts.append(f"{field} = {err.get('input')!r}: {err['msg']}")
    return "; ".join(parts)


def _configure_logging(settings: Settings) -> None:
    """Every component logs the same way: our format, no colour codes from Temporal's core
    (they end up raw in up's log files), an unreachable peer in one line, repeats thinned
    out. The worker, API and gateway outlive a restart of their peers under `up` as the
    agent outlives its control plane."""
    from modelkeeper.infra.logs import configure_logging

    configure_logging(settings.log_level)


def _start_tracing(settings: Settings, component: str) -> None:
    """Spans of this component to the OTLP collector, when ``otlp_endpoint`` names one."""
    from modelkeeper.infra import tracing

    tracing.setup(settings, service=f"modelkeeper-{component}")


async def _until_signalled(run: Callable[[asyncio.Event], Any]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run(stop)


def _cmd_up(settings: Settings, demo: bool = True) -> int:
    from .stack import StackError, run_up

    _configure_logging(settings)
    try:
        return run_up(settings, out=print, demo=demo)
    except StackError as exc:
        raise UsageError(str(exc)) from None


def _check_temporal_security(settings: Settings) -> None:
    """A Temporal TLS or API key file that cannot be used, as one line (exit code 2)
    before anything starts, rather than a traceback from inside a server's start-up."""
    from modelkeeper.infra.temporal import TemporalConfigError, security_from_settings

    try:
        security_from_settings(settings)
    except TemporalConfigError as exc:
        raise UsageError(str(exc)) from None


def _cmd_worker(settings: Settings) -> int:
    from worker.main import run_worker

    _check_temporal_security(settings)
    _configure_logging(settings)
    _start_tracing(settings, "worker")
    asyncio.run(_until_signalled(lambda stop: run_worker(settings, stop)))
    return 0


def _cmd_api(settings: Settings) -> int:
    import uvicorn

    from api.app import create_app
    from api.server import uvicorn_config

    _check_temporal_security(settings)
    _configure_logging(settings)
    _start_tracing(settings, "api")
    server = uvicorn.Server(uvicorn_config(create_app(settings), settings))
    asyncio.run(server.serve())
    return 0 if server.started else 1


def _cmd_agent(settings: Settings) -> int:
    from agent.main import AgentConfigError, run_agent

    _check_temporal_security(settings)
    _configure_logging(settings)
    _start_tracing(settings, "agent")
    try:
        # What the agent writes (its credential, shard records, weights, engine logs) and
        # what its engines write are this user's alone (modelkeeper.infra.files).
        with private_files():
            asyncio.run(_until_signalled(lambda stop: run_agent(settings, stop)))
    except AgentConfigError as exc:
        raise UsageError(str(exc)) from None
    return 0


def _cmd_leave(settings: Settings) -> int:
    """Stop the engines of the node whose agent keeps its folder in the data dir, found by
    the marker in their environment (as `up` stops its own on Ctrl-C)."""
    from .stack import ENGINE_STOP_GRACE_S, local_engine_groups, stop_engines

    node_file = settings.agent_dir / "node_id"
    if not node_file.exists():
        raise UsageError(f"no agent has run with data dir {settings.data_dir} (no "
                         f"{node_file}); pass the agent's --data-dir")
    node_id = node_file.read_text().strip()
    stopped = stop_engines(settings.agent_dir, grace=ENGINE_STOP_GRACE_S)
    left = sorted(local_engine_groups(settings.agent_dir))
    print(f"node {node_id}: stopped {stopped} engine(s); "
          + (f"still running: process groups {left}" if left else "none left running"))
    return 1 if left else 0


def _cmd_temporal_ui(settings: Settings, upstream: str) -> int:
    import uvicorn

    from api.temporal_ui import create_app

    _configure_logging(settings)
    config = uvicorn.Config(create_app(settings, upstream), host=settings.bind_host,
                            port=settings.temporal_ui_port,
                            log_level=settings.log_level.lower(), access_log=False)
    server = uvicorn.Server(config)
    asyncio.run(server.serve())
    return 0 if server.started else 1


def _cmd_temporal_front(settings: Settings, upstream: str) -> int:
    import ssl

    from modelkeeper.infra.pki import MtlsFiles
    from modelkeeper.infra.tls_front import TlsFront, server_context

    _configure_logging(settings)
    host, sep, port = upstream.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--upstream is {upstream!r}; it must be HOST:PORT, the Temporal "
                         "dev server's frontend")
    files = MtlsFiles(settings.temporal_mtls_dir)
    try:
        context = server_context(ca_file=files.ca, cert_file=files.server_cert,
                                 key_file=files.server_key)
    except (OSError, ssl.SSLError) as err:
        raise UsageError(f"cannot load the mTLS front's CA and certificate from "
                         f"{files.folder} ({err}); `up --bind-host` makes them") from None
    front = TlsFront(context, upstream_host=host.strip("[]"), upstream_port=int(port))

    async def serve() -> None:
        try:
            await front.start(settings.bind_host, settings.temporal_mtls_port)
        except OSError as err:
            raise UsageError(f"cannot listen on {settings.bind_host}:"
                             f"{settings.temporal_mtls_port} ({err.strerror}); choose "
                             "another port with --temporal-mtls-port") from None
        logging.getLogger(__name__).info(
            "Temporal mTLS front on %s:%d, passing verified clients on to %s",
            settings.bind_host, settings.temporal_mtls_port, upstream)
        await front.serve_forever()

    asyncio.run(serve())
    return 0


def _cmd_gateway(settings: Settings) -> int:
    from gateway.server import GatewayConfigError, run_gateway

    _configure_logging(settings)
    try:
        return run_gateway(settings)
    except GatewayConfigError as exc:
        raise UsageError(str(exc)) from None


def _database_url(settings: Settings) -> str:
    """The DSN `keys` and `tokens` use (``gateway.keys_cli.database_url``); a UsageError
    naming the password file when this user may not open a local `up`'s database."""
    from gateway.keys_cli import LocalDatabaseError, database_url

    try:
        return database_url(settings)
    except LocalDatabaseError as exc:
        raise UsageError(str(exc)) from None


def _cmd_keys(settings: Settings, args: argparse.Namespace) -> int:
    from gateway.keys_cli import run_keys_command

    settings = settings.model_copy(update={"database_url": _database_url(settings)})
    return run_keys_command(settings, args.keys_action, getattr(args, "keys_argument", None),
                            out=print)


def _cmd_tokens(settings: Settings, args: argparse.Namespace) -> int:
    return run_tokens_command(_database_url(settings), args, out=print)


def _local_gateway_url(settings: Settings) -> str:
    """This machine's gateway: the bind host (loopback for a wildcard) and gateway port."""
    from modelkeeper.infra.network import is_wildcard

    host = "127.0.0.1" if is_wildcard(settings.bind_host) else settings.bind_host
    return f"http://{host}:{settings.gateway_port}"


def run(argv: Sequence[str] | None = None) -> int:
    """Run one `modelkeeper` command; its exit code (see ``operator_cli`` for 1 and 2)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "config-doc":
            print(config_table_markdown(), end="")
            return 0
        if args.command == "bench":
            client = load_settings(args)
            return run_bench(args, api_url=client.api_url,
                             gateway_url=args.gateway_url or _local_gateway_url(client),
                             out=print, token=operator_token(client))
        if args.command in OPERATOR_COMMANDS:
            client = load_settings(args)
            return run_operator_command(args, client.api_url, out=print,
                                        token=operator_token(client), afterwards=FollowUp())
        settings = load_settings(args)
        commands: dict[str, Callable[[Settings], int]] = {
            "up": lambda s: _cmd_up(s, demo=not args.no_demo),
            "worker": _cmd_worker, "api": _cmd_api,
            "agent": _cmd_agent,
            "gateway": _cmd_gateway, "leave": _cmd_leave,
            "temporal-ui": lambda s: _cmd_temporal_ui(s, args.upstream),
            "temporal-front": lambda s: _cmd_temporal_front(s, args.upstream),
            "keys": lambda s: _cmd_keys(s, args),
            "tokens": lambda s: _cmd_tokens(s, args),
        }
        return commands[args.command](settings)
    except (UsageError, ApiError, WaitFailed) as exc:
        print(f"modelkeeper {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of the `modelkeeper` console script."""
    code = run(argv)
    from modelkeeper.infra import tracing

    # os._exit below skips the atexit hook that would export the last spans.
    tracing.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit without interpreter finalization: temporalio's runtime can abort at teardown
    # (sdk-python#300, exit 134 in 4 of 19 standalone runs measured here).
    os._exit(code)
