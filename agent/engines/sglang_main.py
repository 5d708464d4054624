"""Entry script that runs SGLang's server with its API key taken from the environment.

SGLang reads its API key only from ``--api-key``, and a command line is readable by every
user of the node (``ps``, ``/proc/PID/cmdline``); another user's environment is not. So
the plan runs this script, by path, with SGLang's own command line minus the key, and the
key in :data:`API_KEY_ENV`. It does what ``python -m sglang.launch_server`` does (SGLang
0.5.23's sglang/launch_server.py: load its plugins, ``prepare_server_args``,
``run_server``, then kill what is left of its process tree), with the key set on the
parsed arguments before ``run_server`` resolves and seals them. The variable is removed
from this process's environment first, so that the processes SGLang spawns do not inherit
it (they get the key with the arguments, as SGLang passes them).

Run by path rather than as a module, and importing only the standard library at the top:
the interpreter SGLang is installed for need not have modelkeeper installed.

SGLang logs its whole argument object at start, the key included. That output reaches the
engine's log only through the agent's log filter (:mod:`agent.log_filter`), which scrubs
the key from it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping, Sequence

log = logging.getLogger("agent.engines.sglang_main")

#: The environment variable the API key is read from (llama.cpp's entry point reads the
#: same one).
API_KEY_ENV = "MODELKEEPER_ENGINE_API_KEY"
#: The flag this script exists to keep off the command line.
KEY_FLAG = "--api-key"
#: Exit code for a usage error (argparse uses the same).
EXIT_USAGE = 2


def take_key(environ: MutableMapping[str, str]) -> str | None:
    """The key, removed from ``environ``; None when it is missing or empty."""
    return environ.pop(API_KEY_ENV, "") or None


def key_on_command_line(argv: Sequence[str]) -> bool:
    """Whether ``argv`` passes a key itself (refused: it would be readable by anyone)."""
    return any(arg == KEY_FLAG or arg.startswith(KEY_FLAG + "=") for arg in argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Launch SGLang and serve until it stops; the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    if key_on_command_line(args):
        log.error("%s is refused on the command line, where every user of the node can "
                  "read it; put the key in $%s", KEY_FLAG, API_KEY_ENV)
        return EXIT_USAGE
    key = take_key(os.environ)
    if key is None:
        # Without a key SGLang would serve anyone who reaches its port.
        log.error("$%s is not set: refusing to serve without an API key", API_KEY_ENV)
        return EXIT_USAGE
    # Imported only now: SGLang is large, and present only where GPU engines run.
    # bench/engine_contract_parse.py checks that each of these names exists.
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(args)
    server_args.api_key = key
    try:
        # Not http_server.launch_server: run_server resolves the arguments first
        # (resolve_once) and picks the server the resolved arguments ask for.
        run_server(server_args)
    finally:
        # As sglang.launch_server does: its scheduler and detokenizer go with it.
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
