"""SGLang's server, for nodes with NVIDIA GPUs.

SGLang takes its API key only as ``--api-key`` on the command line, where every user on
the node can read it. So the plan runs our entry script (:mod:`agent.engines.sglang_main`)
with SGLang's interpreter: it takes the key from the environment and sets it on SGLang's
parsed arguments. Multi-node replicas use SGLang's own launcher (``--nnodes``,
``--node-rank``, ``--dist-init-addr``); ranks other than 0 join rank 0 and serve no HTTP.

Every shard starts with ``--enable-memory-saver`` (SGLang's torch_memory_saver must be
installed beside it), which lets the agent sleep it: ``POST /release_memory_occupation``
and wake it: ``POST /resume_memory_occupation``, both with ``{"tags": ["kv_cache"]}`` so
that the weights stay loaded as vLLM's level-1 sleep keeps them (:data:`SLEEP_DIALECT`;
SGLang's http_server routes, as read in 2026). SGLang has no "is it sleeping" endpoint:
the agent goes by its own record of the shard. Tested here against the command line only
(no GPU on the test machines).
"""

from __future__ import annotations

import sys
from pathlib import Path

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

# Re-exported: where the entry script reads the key (it imports nothing from ours).
from .sglang_main import API_KEY_ENV as API_KEY_ENV

#: Optional arguments and their flags; as for vLLM, nothing that loads code or moves
#: the listener.
_FLAGS: dict[str, tuple[str, ArgKind]] = {
    "context_length": ("--context-length", "int"),
    "max_running_requests": ("--max-running-requests", "int"),
    "dtype": ("--dtype", "token"),
    "quantization": ("--quantization", "token"),
    "disable_cuda_graph": ("--disable-cuda-graph", "bool"),
}

ALLOWED_ARGS: frozenset[str] = ALLOWED_ENGINE_ARGS[EngineKind.SGLANG]

#: The script the plan runs, by path (SGLang's interpreter need not have modelkeeper).
ENTRY_SCRIPT = Path(__file__).with_name("sglang_main.py")

#: SGLang's sleep: release and resume the KV cache's memory only, keeping the weights.
KV_CACHE_TAGS = {"tags": ["kv_cache"]}
SLEEP_DIALECT = SleepDialect(sleep_path="/release_memory_occupation",
                             wake_path="/resume_memory_occupation", body=KV_CACHE_TAGS)


class SglangAdapter:
    """Launches one SGLang shard."""

    kind: EngineKind = EngineKind.SGLANG

    def __init__(self, python: str | None = None) -> None:
        """``python``: the interpreter SGLang is installed for; the agent's own by default."""
        self.python = python or sys.executable

    def launch_plan(self, spec: ShardSpec, *, host: str, port: int, api_key: str) -> LaunchPlan:
        """The command line and environment that start ``spec`` on host:port."""
        reject_unknown_args(self.kind, spec.engine_args, ALLOWED_ARGS)
        layout = parallelism(spec)
        argv = [
            self.python, str(ENTRY_SCRIPT),
            "--model-path", spec.source,
            "--served-model-name", spec.model_id,
            "--host", host,
            "--port", str(port),
            "--tp-size", str(layout.tensor),
            "--pp-size", str(layout.pipeline),
            # SGLang's counterpart of vLLM's --gpu-memory-utilization.
            "--mem-fraction-static", memory_fraction(spec),
            "--enable-memory-saver",
            # Its /metrics (off by default): the gateway reads its queue gauge there,
            # sglang:num_queue_reqs (gateway/engine_queue.py).
            "--enable-metrics",
            *optional_flags(spec.engine_args, _FLAGS),
        ]  # fmt: skip
        if spec.world_size > 1:
            leader_host, leader_port = leader_host_port(spec)
            # Brackets keep an IPv6 address apart from the port.
            host_part = f"[{leader_host}]" if ":" in leader_host else leader_host
            argv += [
                "--nnodes", str(spec.world_size),
                "--node-rank", str(spec.rank),
                "--dist-init-addr", f"{host_part}:{leader_port}",
            ]  # fmt: skip
        return LaunchPlan(
            argv=argv,
            env={**cuda_env(spec), API_KEY_ENV: api_key},
            serves_http=spec.rank == 0,
        )

    async def check_ready(
        self, client: httpx.AsyncClient, base_url: str, api_key: str, model_name: str
    ) -> ReadyCheck:
        """Ready once /health answers 200 and a one-token completion succeeds."""
        return await probe_ready(client, base_url, api_key, model_name)
