"""Entry point that serves one .gguf model with xllamacpp's embedded llama.cpp server.

Run as ``python -m agent.engines.llamacpp_main --model PATH --host H --port P --ctx N
--parallel N --threads N``, with the API key in the environment variable
:data:`API_KEY_ENV` (a command line is readable by every user on
the node, the environment of another user's process is not). xllamacpp serves from its
own threads for as long as its ``Server`` object lives, so this process only holds the
object and waits for SIGTERM or SIGINT. A bad model path or a busy port makes xllamacpp
end the process with code 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the extension loads only when the engine serves
    import xllamacpp

log = logging.getLogger("agent.engines.llamacpp_main")

#: The environment variable the API key is read from. Defined here, not in the adapter
#: module, so that starting the engine imports nothing but the standard library.
API_KEY_ENV = "MODELKEEPER_ENGINE_API_KEY"

#: Exit code for a usage error (argparse uses the same).
EXIT_USAGE = 2

_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (everything but the key, which comes from the environment)."""
    parser = argparse.ArgumentParser(
        prog="python -m agent.engines.llamacpp_main",
        description=f"Serve a .gguf model with llama.cpp; the API key is read from ${API_KEY_ENV}.",
    )
    parser.add_argument("--model", required=True, help="path of the .gguf file")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", required=True, type=int)
    parser.add_argument("--ctx", type=_positive, default=4096, help="context shared by all slots")
    parser.add_argument("--parallel", type=_positive, default=1, help="concurrent request slots")
    parser.add_argument("--threads", type=_positive, default=1)
    parser.add_argument("--alias", default=None, help="model name reported by /v1/models")
    return parser.parse_args(argv)


def server_params(args: argparse.Namespace, api_key: str) -> xllamacpp.CommonParams:
    """xllamacpp's parameters for ``args``. ``--threads`` (the replica's reserved cores,
    agent.engines.base.threads_for) sets both the generation and the batch (prompt) thread
    counts: a prompt processed on more threads than the replica reserved would take
    another replica's cores."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = [args.host]
    params.port = args.port
    params.n_ctx = args.ctx
    params.n_parallel = args.parallel
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.api_keys = [api_key]
    if args.alias:
        params.model_alias = {args.alias}
    return params


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT; returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    api_key = os.environ.get(API_KEY_ENV, "")
    if not api_key:
        # Serving without a key would expose the model to every local user and anyone
        # who can reach the port; refuse rather than start open.
        log.error("%s is not set; refusing to serve without an API key", API_KEY_ENV)
        return EXIT_USAGE

    # Imported here so that --help and the key check work without loading the extension.
    import xllamacpp

    params = server_params(args, api_key)

    # Block the stop signals before the server starts its threads, which inherit the
    # mask: the signal then stays pending until sigwait() below takes it, instead of
    # landing on an arbitrary server thread or interrupting a call mid-way.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    log.info(
        "serving %s on %s:%d (ctx %d, %d slots, %d threads)",
        args.model, args.host, args.port, args.ctx, args.parallel, args.threads,
    )  # fmt: skip
    server = xllamacpp.Server(params)
    received = signal.sigwait(_STOP_SIGNALS)
    log.info("received %s; stopping", signal.Signals(received).name)
    # Dropping the last reference stops the HTTP server and frees the model.
    del server
    return 0


if __name__ == "__main__":
    sys.exit(main())
