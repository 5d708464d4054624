"""vLLM's OpenAI-compatible server, for nodes with NVIDIA GPUs.

Every shard starts with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``: the first
puts vLLM's memory under its sleep-capable allocator (CUDA only), the second serves the
sleep endpoints, which vLLM keeps among its dev endpoints (docs/features/sleep_mode.md;
vllm/entrypoints/serve/sleep/api_router.py attaches them only in dev mode). The agent
sleeps a shard with ``POST /sleep?level=1`` (KV cache discarded, weights offloaded to CPU
memory) and wakes it with ``POST /wake_up`` (:data:`SLEEP_DIALECT`). Dev mode serves other
endpoints too (cache resets, profiling, collective RPC), and vLLM's ``--api-key`` guards
only ``/v1`` paths in some versions: the engine port must be reachable from the control
plane's network only, as it already should be. Tested here against the command line
only (no GPU on the test machines).

The plan runs vLLM's CLI, ``python -m vllm.entrypoints.cli.main serve`` (what the
``vllm serve`` script runs), not the older ``python -m vllm.entrypoints.openai.api_server``:
in vLLM 0.33 that module is deprecated and always starts an API server, whatever
``--headless`` says (vllm/entrypoints/launchers/api_server/entry.py); only ``serve``
turns ``--headless`` into a rank that runs its workers and no HTTP
(vllm/entrypoints/cli/serve.py, ``run_headless``).

Multi-node replicas use vLLM's multiprocessing executor, which needs no Ray cluster
(``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``: vLLM 0.33's
vllm/engine/arg_utils.py). Every rank runs the same command; ranks other than 0 add
``--headless`` and serve no HTTP. Every command line this adapter can build parses with
vLLM 0.33.0's own parser (``python -m bench.engine_contract``,
bench/results/engine_contract.md).
"""

from __future__ import annotations

import sys

import httpx

from modelkeeper.domain.engine_args import ALLOWED_ENGINE_ARGS
from modelkeeper.domain.shards import EngineKind, ShardSpec

from .base import LaunchPlan, ReadyCheck, SleepDialect, probe_ready, reject_unknown_args
from .gpu import (
    ArgKind,
    cuda_env,
    leader_host_port,
    memory_fraction,
    optional_flags,
    parallelism,
)

#: vLLM reads ``--api-key``'s value from this variable, which keeps the key out of argv.
API_KEY_ENV = "VLLM_API_KEY"

#: Optional arguments and their flags. Nothing that loads code (trust_remote_code) or
#: changes where the engine listens is allowed: those belong to the operator, not a model.
_FLAGS: dict[str, tuple[str, ArgKind]] = {
    "max_model_len": ("--max-model-len", "int"),
    "max_num_seqs": ("--max-num-seqs", "int"),
    "dtype": ("--dtype", "token"),
    "quantization": ("--quantization", "token"),
    "enforce_eager": ("--enforce-eager", "bool"),
}

ALLOWED_ARGS: frozenset[str] = ALLOWED_ENGINE_ARGS[EngineKind.VLLM]

#: vLLM's CLI module and the subcommand that serves (see the module docstring).
ENTRY_MODULE = "vllm.entrypoints.cli.main"
SERVE_COMMAND = "serve"

#: The variable that makes vLLM serve its sleep endpoints, and its value.
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
#: vLLM's sleep dialect; level 1 keeps the weights (level 2 would reload them on wake).
SLEEP_DIALECT = SleepDialect(sleep_path="/sleep?level=1", wake_path="/wake_up",
                             state_path="/is_sleeping")


class VllmAdapter:
    """Launches one vLLM shard."""

    kind: EngineKind = EngineKind.VLLM

    def __init__(self, python: str | None = None) -> None:
        """``python``: the interpreter vLLM is installed for; the agent's own by default."""
        self.python = python or sys.executable

    def launch_plan(self, spec: ShardSpec, *, host: str, port: int, api_key: str) -> LaunchPlan:
        """The command line and environment that start ``spec`` on host:port."""
        reject_unknown_args(self.kind, spec.engine_args, ALLOWED_ARGS)
        layout = parallelism(spec)
        argv = [
            self.python, "-m", ENTRY_MODULE, SERVE_COMMAND,
            "--model", spec.source,
            "--served-model-name", spec.model_id,
            "--host", host,
            "--port", str(port),
            "--tensor-parallel-size", str(layout.tensor),
            "--pipeline-parallel-size", str(layout.pipeline),
            "--gpu-memory-utilization", memory_fraction(spec),
            "--enable-sleep-mode",
            *optional_flags(spec.engine_args, _FLAGS),
        ]  # fmt: skip
        if spec.world_size > 1:
            leader_host, leader_port = leader_host_port(spec)
            argv += [
                "--distributed-executor-backend", "mp",
                "--nnodes", str(spec.world_size),
                "--node-rank", str(spec.rank),
                "--master-addr", leader_host,
                "--master-port", str(leader_port),
            ]  # fmt: skip
            if spec.rank > 0:
                argv.append("--headless")
        return LaunchPlan(
            argv=argv,
            env={**cuda_env(spec), DEV_MODE_ENV: "1", API_KEY_ENV: api_key},
            serves_http=spec.rank == 0,
        )

    async def check_ready(
        self, client: httpx.AsyncClient, base_url: str, api_key: str, model_name: str
    ) -> ReadyCheck:
        """Ready once /health answers 200 and a one-token completion succeeds."""
        return await probe_ready(client, base_url, api_key, model_name)
