"""The simulated engine: a cheap stand-in for a real one in scale and fault tests.

The plan runs :mod:`agent.engines.sim_server` with the agent's own Python. It needs no
model, GPU or extra package, and a few hundred fit on one machine, so tests can place,
crash and restart replicas at a scale real engines would not allow. ``engine_args``
choose how it behaves: how long it loads, how fast it generates, and whether it fails
while loading, crashes later or hangs.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

import httpx

from modelkeeper.domain.engine_args import ALLOWED_ENGINE_ARGS
from modelkeeper.domain.shards import EngineKind, ShardSpec, split_address

from .base import (
    EngineConfigError,
    LaunchPlan,
    ReadyCheck,
    bool_arg,
    int_arg,
    probe_ready,
    reject_unknown_args,
)
from .sim_server import API_KEY_ENV, DIALECTS

ENTRY_MODULE = "agent.engines.sim_server"

#: ``load_time_s``: seconds /health answers 503 before the model is ready.
#: ``tokens_per_second``: generation speed (0, the default, answers at once).
#: ``fail_at_start``: exit 1 once loading ends, never having been healthy.
#: ``crash_after_s``: exit with :data:`~agent.engines.sim_server.CRASH_EXIT_CODE` this
#: many seconds after starting.
#: ``hang``: accept connections but never answer, /health included.
#: ``weights_bytes``: what it keeps of its memory while asleep (vLLM's sleep dialect, see
#: :mod:`agent.engines.sim_server`); absent: all of it. ``wake_time_s``: how long a wake
#: takes. ``max_num_seqs``: requests run at once, the rest queue. ``dialect``: ``vllm`` or
#: ``sglang``, the engine whose HTTP dialect it speaks (absent: its own, vLLM's paths).
SIM_ALLOWED_ENGINE_ARGS: frozenset[str] = ALLOWED_ENGINE_ARGS[EngineKind.SIM]
#: The name the other engine modules use for their allow-list.
ALLOWED_ARGS = SIM_ALLOWED_ENGINE_ARGS


def seconds_arg(args: Mapping[str, Any], name: str) -> float | None:
    """A finite, non-negative number of seconds (or a rate), or None when absent."""
    if name not in args:
        return None
    value = args[name]
    # bool is an int subclass; ``load_time_s: true`` is a mistake, not 1 second.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EngineConfigError(f"engine_args.{name}", value, "must be a number")
    if not math.isfinite(value) or value < 0:
        raise EngineConfigError(f"engine_args.{name}", value, "must be a finite number >= 0")
    return float(value)


def dialect_of(args: Mapping[str, Any]) -> str | None:
    """The ``dialect`` engine argument (:data:`~agent.engines.sim_server.DIALECTS`), or None
    when absent: the sim's own."""
    if "dialect" not in args:
        return None
    value = args["dialect"]
    if value not in DIALECTS:
        raise EngineConfigError("engine_args.dialect", value,
                                f"must be one of {', '.join(DIALECTS)}")
    return str(value)


class SimAdapter:
    """Launches the simulated engine."""

    kind: EngineKind = EngineKind.SIM

    def __init__(self, python: str | None = None) -> None:
        """``python``: the interpreter to run the sim with; the agent's own by default."""
        self.python = python or sys.executable

    def launch_plan(self, spec: ShardSpec, *, host: str, port: int, api_key: str) -> LaunchPlan:
        """The command line and environment that start ``spec`` on host:port.

        The served model name is the model id, as for the real engines, so the gateway
        and the readiness probe address it the same way.
        """
        args = spec.engine_args
        reject_unknown_args(self.kind, args, SIM_ALLOWED_ENGINE_ARGS)
        memory = (
            int_arg(args, "memory_bytes", 0, minimum=0)
            if "memory_bytes" in args
            else spec.memory_bytes
        )
        argv = [
            self.python, "-m", ENTRY_MODULE,
            "--host", host,
            "--port", str(port),
            "--model", spec.model_id,
            "--memory-bytes", str(memory),
        ]  # fmt: skip
        for name, flag in (
            ("load_time_s", "--load-time"),
            ("tokens_per_second", "--tokens-per-second"),
            ("crash_after_s", "--crash-after"),
            ("wake_time_s", "--wake-time"),
        ):
            value = seconds_arg(args, name)
            if value is not None:
                argv += [flag, repr(value)]
        # Only when given: without them the command line is what it always was.
        if "weights_bytes" in args:
            argv += ["--weights-bytes", str(int_arg(args, "weights_bytes", 0, minimum=0))]
        if "max_num_seqs" in args:
            argv += ["--max-num-seqs", str(int_arg(args, "max_num_seqs", 1))]
        if spec.world_size > 1:
            # The multi-rank mode (agent.engines.sim_rendezvous): every rank starts at
            # once, the others join rank 0 at the address the control plane chose.
            if not spec.leader_address or split_address(spec.leader_address) is None:
                raise EngineConfigError("leader_address", spec.leader_address,
                                        f"must be host:port when world_size={spec.world_size}")
            argv += ["--rank", str(spec.rank), "--world-size", str(spec.world_size),
                     "--leader", spec.leader_address,
                     "--join-timeout", repr(spec.start_timeout_s)]
        dialect = dialect_of(args)
        if dialect is not None:
            argv += ["--dialect", dialect]
        for name, flag in (("fail_at_start", "--fail-at-start"), ("hang", "--hang")):
            if bool_arg(args, name):
                argv.append(flag)

        notes: list[str] = []
        if spec.gpu_indices:
            notes.append("gpu_indices ignored: the sim engine uses no GPU")
        return LaunchPlan(
            argv=argv,
            # Always set, even empty: an empty key turns authentication off, and must not
            # be replaced by a key the agent happens to have in its own environment.
            env={API_KEY_ENV: api_key},
            # Like vLLM and SGLang, only rank 0 of a multi-node replica serves HTTP; the
            # other ranks still run a sim so their processes can be watched and killed.
            serves_http=spec.rank == 0,
            notes=notes,
        )

    async def check_ready(
        self, client: httpx.AsyncClient, base_url: str, api_key: str, model_name: str
    ) -> ReadyCheck:
        """Ready once /health answers 200 and a one-token completion succeeds."""
        return await probe_ready(client, base_url, api_key, model_name)
