"""``python -m bench.fleet --fleet N [agent flags]``: one process that is N simulated nodes
(:mod:`bench.fleet.nodes`), for the scale benchmark and its tests.

Every flag but ``--fleet`` is ``modelkeeper agent``'s, parsed by the agent's own parser and
read into the agent's own settings, so a fleet node is configured as an agent is. A
mistake is one sentence naming the flag, the value and the limit, with exit code 2, as
from ``modelkeeper agent``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

import uvloop

from agent.main import AgentConfigError
from bench.common import exit_now
from cli.main import UsageError, build_parser, load_settings
from modelkeeper.infra.files import private_files
from modelkeeper.infra.logs import configure_logging
from modelkeeper.infra.temporal import TemporalConfigError, security_from_settings
from modelkeeper.settings import Settings

from .nodes import MAX_FLEET_SIZE, run_fleet

PROG = "bench.fleet"


def _fleet_size(text: str) -> int:
    """``--fleet``'s value as a number; its bounds are the fleet's to check and name
    (:func:`bench.fleet.nodes.fleet_size_problem`), with the port range and open files
    they depend on."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of nodes: a whole number from 1 to "
            f"{MAX_FLEET_SIZE}") from None


def build_fleet_parser() -> argparse.ArgumentParser:
    """``--fleet`` alone: the rest of the command line goes to the agent's parser."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="Be N simulated nodes in this one process (NAME-0001...), each with its "
                    "own id, task queue and --memory, running the agent's code and only the "
                    "sim engine, served in-process; SIGUSR1 kills the nodes listed in "
                    "DATA_DIR/agent/fleet/kill (bench/fleet/nodes.py).",
        epilog="Every other flag is `modelkeeper agent`'s (see modelkeeper agent --help); "
               "--memory is required.")
    parser.add_argument("--fleet", dest="fleet_size", type=_fleet_size, metavar="N",
                        required=True, help="how many nodes")
    return parser


def _check_temporal_security(settings: Settings) -> None:
    """A Temporal TLS or API key file that cannot be used, as one line, before any node
    starts (as ``modelkeeper agent`` checks it)."""
    try:
        security_from_settings(settings)
    except TemporalConfigError as exc:
        raise UsageError(str(exc)) from None


async def _until_signalled(settings: Settings, size: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run_fleet(settings, stop, size=size)


def parse(argv: Sequence[str] | None) -> tuple[int, argparse.Namespace]:
    """The fleet's size, and the rest of ``argv`` as the agent's parser reads it."""
    fleet_args, agent_argv = build_fleet_parser().parse_known_args(argv)
    size: int = fleet_args.fleet_size
    return size, build_parser().parse_args(["agent", *agent_argv])


def run(argv: Sequence[str] | None = None) -> int:
    """Run the fleet until SIGINT or SIGTERM; its exit code (2: a mistake, named)."""
    size, args = parse(argv)
    try:
        if args.llama_server_path is not None:
            # Only the flag: MODELKEEPER_LLAMA_SERVER_PATH may be set for the machine's
            # agents.
            raise UsageError(f"--fleet {size} --llama-server {args.llama_server_path}: a "
                             "fleet serves only the sim engine, inside its own process, "
                             "and starts no llama-server; leave out --llama-server")
        settings = load_settings(args)
        _check_temporal_security(settings)
        configure_logging(settings.log_level)
        # What the nodes write (credentials, shard records) is this user's alone, as an
        # agent's is (modelkeeper.infra.files).
        with private_files():
            # A thousand nodes' pings, heartbeats and workers share one event loop: uvloop's
            # is the cheaper one (one agent keeps asyncio's).
            uvloop.run(_until_signalled(settings, size))
    except (AgentConfigError, UsageError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return UsageError.exit_code
    return 0


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``python -m bench.fleet``."""
    exit_now(run(argv))
