"""llama.cpp: the xllamacpp wheel through our own entry point, or a native llama-server.

xllamacpp embeds llama.cpp's HTTP server in a Python extension and has no command line,
so by default the plan runs :mod:`agent.engines.llamacpp_main` with the agent's Python.
A node whose config names a native ``llama-server`` binary gets that binary's argv
instead. Either way the API key travels in the environment, never in argv: any user on
the node can read every process's command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from modelkeeper.domain.engine_args import ALLOWED_ENGINE_ARGS
from modelkeeper.domain.shards import EngineKind, ShardSpec

# Re-exported: the API resolves model files too, so they live in infra.
from modelkeeper.infra.model_files import SMOLLM2_FILE as SMOLLM2_FILE
from modelkeeper.infra.model_files import SMOLLM2_SOURCE as SMOLLM2_SOURCE
from modelkeeper.infra.model_files import resolve_model_path as resolve_model_path

from .base import (
    EngineConfigError,
    LaunchPlan,
    ReadyCheck,
    check_executable,
    int_arg,
    probe_ready,
    reject_unknown_args,
    require_single_node,
    threads_for,
)

# Re-exported: the agent and tests look for the key variable next to the adapter.
from .llamacpp_main import API_KEY_ENV as API_KEY_ENV

#: The environment variable a native llama-server reads its API key from.
NATIVE_API_KEY_ENV = "LLAMA_API_KEY"

#: ``ctx_size`` is the context shared by all parallel slots (llama-server's ``-c``).
ALLOWED_ARGS: frozenset[str] = ALLOWED_ENGINE_ARGS[EngineKind.LLAMACPP]
DEFAULT_CTX_SIZE = 4096
#: Four slots serve four requests at once; the measured total throughput at
#: concurrency 4 is higher than at 1, so fewer slots would waste the engine.
DEFAULT_PARALLEL = 4

ENTRY_MODULE = "agent.engines.llamacpp_main"


class LlamaCppAdapter:
    """Launches llama.cpp on CPU, one process per replica."""

    kind: EngineKind = EngineKind.LLAMACPP

    def __init__(self, llama_server_path: Path | None = None, python: str | None = None) -> None:
        """``llama_server_path``: a native binary to run instead of xllamacpp.

        ``python``: the interpreter for our entry point; the agent's own by default,
        since that is the environment xllamacpp is installed in.
        """
        self.llama_server_path = llama_server_path
        self.python = python or sys.executable

    def launch_plan(self, spec: ShardSpec, *, host: str, port: int, api_key: str) -> LaunchPlan:
        """The command line and environment that start ``spec`` on host:port."""
        require_single_node(spec)
        reject_unknown_args(self.kind, spec.engine_args, ALLOWED_ARGS)
        ctx = int_arg(spec.engine_args, "ctx_size", DEFAULT_CTX_SIZE)
        parallel = int_arg(spec.engine_args, "parallel", DEFAULT_PARALLEL)
        if ctx < parallel:
            raise EngineConfigError(
                "engine_args.ctx_size", ctx, f"smaller than parallel={parallel}: no room per slot"
            )
        model = resolve_model_path(spec.source)
        threads = threads_for(spec)
        notes: list[str] = []
        if spec.gpu_indices:
            notes.append("gpu_indices ignored: this llama.cpp build runs on CPU only")

        if self.llama_server_path is not None:
            check_executable("llama_server_path", self.llama_server_path)
            argv = [
                str(self.llama_server_path),
                "-m", str(model),
                "--host", host,
                "--port", str(port),
                "-c", str(ctx),
                "-np", str(parallel),
                "-t", str(threads),
                "-a", spec.model_id,
            ]  # fmt: skip
            env = {NATIVE_API_KEY_ENV: api_key}
        else:
            argv = [
                self.python, "-m", ENTRY_MODULE,
                "--model", str(model),
                "--host", host,
                "--port", str(port),
                "--ctx", str(ctx),
                "--parallel", str(parallel),
                "--threads", str(threads),
                "--alias", spec.model_id,
            ]  # fmt: skip
            env = {API_KEY_ENV: api_key}
        return LaunchPlan(argv=argv, env=env, notes=notes)

    async def check_ready(
        self, client: httpx.AsyncClient, base_url: str, api_key: str, model_name: str
    ) -> ReadyCheck:
        """Ready once /health answers 200 and a one-token completion succeeds."""
        return await probe_ready(client, base_url, api_key, model_name)
