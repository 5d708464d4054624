"""What a node agent needs to run one shard of one replica. Pure data, shared by the
control plane (which builds it) and the agent (which runs it)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from enum import StrEnum
from typing import Any

from pydantic import Field

from .addresses import format_address as format_address
from .addresses import split_address as split_address
from .base import Frozen, Tolerant
from .ids import ModelId, NodeId, ReplicaId


class EngineKind(StrEnum):
    """The inference engines modelkeeper can start."""

    LLAMACPP = "llamacpp"
    VLLM = "vllm"
    SGLANG = "sglang"
    SIM = "sim"


def can_sleep(engine: EngineKind) -> bool:
    """Whether ``engine`` can sleep: free its KV cache and keep its weights loaded, to wake
    in a fraction of a load. vLLM (``--enable-sleep-mode``), SGLang (its memory saver)
    and the sim (which speaks vLLM's dialect) can; llama.cpp has no sleep, so the keeper
    stops it instead. The agent's adapters carry the dialect of each engine that can
    (a unit test keeps the two in step)."""
    return engine is not EngineKind.LLAMACPP


def share_of(total_bytes: int, part_bytes: int, whole_bytes: int) -> int:
    """``part_bytes``' share of ``total_bytes``, in proportion to ``whole_bytes``, rounded
    down: what one shard of ``whole_bytes`` keeps of a replica's ``total_bytes`` (its
    claim's share of the weights a sleeping replica keeps). Never more than ``part_bytes``
    when ``total_bytes <= whole_bytes``; 0 for an empty whole."""
    if whole_bytes <= 0:
        return 0
    return total_bytes * part_bytes // whole_bytes


class ShardSpec(Tolerant):
    """One shard (one rank) of a replica, as the agent on ``node_id`` must start it.

    Tolerant of unknown keys: the deployment workflow carries it in its state (so
    continue-as-new, and a worker rolled back past a new field, must decode it). A field
    that changes how an engine runs must therefore default to the old behaviour: an agent
    one version behind ignores it.
    """

    replica_id: ReplicaId
    model_id: ModelId
    node_id: NodeId
    engine: EngineKind
    #: A .gguf path, "smollm2" for the packaged SmolLM2, a Hugging Face repo id, or for
    #: the sim engine any label.
    source: str
    #: The catalog's sha256 of the weights file: the agent checks it before the engine
    #: sees the file (None: not checked).
    sha256: str | None = None
    #: The name of the secret the agent presents to the source's host
    #: (MODELKEEPER_SOURCE_TOKEN_<secret> in the agent's environment); None: no token.
    secret: str | None = None
    rank: int = Field(default=0, ge=0)
    world_size: int = Field(default=1, ge=1)
    #: Address of rank 0, for multi-node engines (host:port); None for one node.
    leader_address: str | None = None
    #: Memory this shard may use, from its allocation.
    memory_bytes: int = Field(ge=0)
    #: Total memory of the GPUs this shard holds, to derive vLLM's utilisation fraction.
    gpu_memory_bytes: int | None = Field(default=None, ge=0)
    gpu_indices: list[int] = Field(default_factory=list)
    cpu_cores: float | None = Field(default=None, gt=0)
    #: Allow-listed engine arguments (the catalog validates them).
    engine_args: dict[str, Any] = Field(default_factory=dict)
    #: Seconds the start may take, load included, before the shard counts as failed.
    start_timeout_s: float = Field(default=600.0, gt=0)


class ShardState(StrEnum):
    """Where a shard is in its life on its node."""

    STARTING = "starting"
    READY = "ready"
    EXITED = "exited"


class ExitKind(StrEnum):
    """Why an engine stopped. OOM is claimed only with evidence (see classify_exit)."""

    CLEAN = "clean"  # exit code 0
    ERROR = "error"  # non-zero exit code
    SIGNALLED = "signalled"  # killed by a signal, no OOM evidence
    OOM_KILLED = "oom_killed"  # SIGKILL with the cgroup's or the kernel's OOM record
    START_TIMEOUT = "start_timeout"  # never became ready in time; we stopped it
    STOPPED = "stopped"  # stopped on request
    VANISHED = "vanished"  # an adopted process is gone; not our child, so no exit code
    UNKNOWN_SHARD = "unknown_shard"  # the agent has no such shard (never started, or lost)
    #: A rank above 0 could not reach rank 0's rendezvous address (agent.links); the agent
    #: stopped it, and the replica is replaced whole.
    LINK_LOST = "link_lost"


class StartShardInput(Tolerant):
    """Input of the `start_shard` activity."""

    spec: ShardSpec


class ShardEndpoint(Tolerant):
    """A shard that is up: where rank 0 serves, and which process it is. Sent by agents,
    which may run a newer version than the worker: unknown keys are ignored."""

    replica_id: ReplicaId
    node_id: NodeId
    rank: int
    url: str | None  # http://host:port for a rank that serves HTTP, else None
    port: int
    pid: int
    adopted: bool = False


class WatchShardInput(Tolerant):
    """Input of the `watch_shard` activity."""

    replica_id: ReplicaId


class ShardExit(Tolerant):
    """How a shard ended: exit code or signal, a classification, and its last log lines.
    Sent by agents, which may run a newer version than the worker: unknown keys are
    ignored."""

    replica_id: ReplicaId
    kind: ExitKind
    exit_code: int | None = None
    signal: int | None = None
    detail: str = ""
    log_tail: list[str] = Field(default_factory=list)


class StopShardInput(Tolerant):
    """Input of the `stop_shard` activity."""

    replica_id: ReplicaId
    grace_s: float = Field(default=10.0, ge=0)


class SleepShardInput(Tolerant):
    """Input of the `sleep_shard` activity: free the engine's KV cache, keep its weights."""

    replica_id: ReplicaId


class WakeShardInput(Tolerant):
    """Input of the `wake_shard` activity: take the KV cache back, after the node's
    start-up gate (waking re-allocates memory, as a load does)."""

    replica_id: ReplicaId


class ShardReport(Tolerant):
    """What an agent says it runs: sent on registration and by `list_shards`. Agents may
    run a newer version than the worker or the API: unknown keys are ignored."""

    replica_id: ReplicaId
    model_id: ModelId
    rank: int
    state: ShardState
    port: int
    pid: int
    url: str | None
    adopted: bool
    #: Set while the start waits at the node's start-up gate: 1 is next in line. Such a
    #: shard is ``starting`` with no process yet, so its port and pid are 0; or, for a
    #: ``sleeping`` shard, while its wake waits there. None (and absent, from an older
    #: agent) otherwise.
    queued_position: int | None = Field(default=None, ge=1)
    #: Put to sleep (its KV cache freed, its weights kept); False from an older agent.
    sleeping: bool = False


class FetchProgress(Frozen):
    """Heartbeat details while weights download. total is None when the size is unknown:
    we report bytes, never an invented percentage."""

    phase: str
    bytes_done: int = 0
    bytes_total: int | None = None
    #: Bytes per second over the last few seconds (start_progress.RATE_WINDOW_S); None
    #: before two chunks have arrived.
    rate_bytes_per_s: float | None = None


def classify_exit(returncode: int | None, *, oom_kills_before: int | None,
                  oom_kills_after: int | None, kernel_oom_pids: frozenset[int],
                  pid: int) -> tuple[ExitKind, str]:
    """Classify an engine's end from its return code and OOM evidence.

    ``returncode`` follows subprocess: negative is a signal. A SIGKILL is called an OOM kill
    only when the cgroup's ``oom_kill`` count rose while the engine ran, or the kernel's OOM
    killer named this pid; anything else is reported as the plain signal it was.
    """
    import signal as _signal

    if returncode is None:
        return ExitKind.VANISHED, "process is gone; it was adopted, so its exit code is unknown"
    if returncode == 0:
        return ExitKind.CLEAN, "exited with code 0"
    if returncode > 0:
        return ExitKind.ERROR, f"exited with code {returncode}"
    signum = -returncode
    try:
        name = _signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if signum == _signal.SIGKILL:
        if pid in kernel_oom_pids:
            return ExitKind.OOM_KILLED, f"{name}: the kernel's OOM killer killed pid {pid}"
        if (oom_kills_before is not None and oom_kills_after is not None
                and oom_kills_after > oom_kills_before):
            return ExitKind.OOM_KILLED, (
                f"{name}: the cgroup's oom_kill count rose from {oom_kills_before} "
                f"to {oom_kills_after}")
    return ExitKind.SIGNALLED, f"killed by {name}"


def choose_port(low: int, high: int, taken: set[int], is_free: Callable[[int], bool], *,
                prefer: int | None = None, kept: Collection[int] = ()) -> int:
    """The port for an engine: ``prefer`` (the port its replica had, for a relaunch in
    place: its endpoint stays what it was) when it is in [low, high], free and held by no
    shard of ours; else the first port in [low, high] that no shard of ours holds and
    nothing else listens on, passing over the ports ``kept`` for other replicas' relaunches
    unless nothing else is free.

    ``is_free`` is asked last: a stray process (an engine from a crashed agent, anything
    else) can hold a port our own records think is free.
    """
    if prefer is not None and low <= prefer <= high and prefer not in taken \
            and is_free(prefer):
        return prefer
    for passing_over in ((set(kept), set()) if kept else (set(),)):
        for port in range(low, high + 1):
            if port in taken or port in passing_over:
                continue
            if is_free(port):
                return port
    raise NoFreePortError(f"no free engine port in {low}-{high} ({len(taken)} held by shards)")


def rendezvous_port(low: int, high: int, taken: set[int]) -> int | None:
    """The port rank 0 of a multi-node replica rendezvouses on, on its node: the highest in
    the node's engine range [low, high] that no other replica's rendezvous holds there; None
    when every one does.

    The control plane claims it with the replica's memory, under the node's lock, so two
    replicas never get one port. From the top of the range because the agent hands engine
    HTTP ports from the bottom (:func:`choose_port`), and excludes every rendezvous port of
    the shards it runs: the two meet only in a nearly full range, and then rank 0's agent
    refuses the start with the port's name rather than launch an engine that cannot bind.
    """
    for port in range(high, low - 1, -1):
        if port not in taken:
            return port
    return None


class NoFreePortError(RuntimeError):
    """Every port in the engine range is taken."""


class ShardStartError(Exception):
    """The engine could not be started; ``exit`` says how it ended.

    Raised by the agent's shard manager and turned into an activity failure by the node
    activities, which sit below the agent and so cannot import its classes."""

    def __init__(self, exit: ShardExit) -> None:
        super().__init__(f"{exit.kind}: {exit.detail}")
        self.exit = exit


class ShardNotHereError(Exception):
    """The agent runs no such shard (never started here, ended, or lost): a sleep or wake
    of it cannot succeed on this node, whoever retries."""


class SleepWakeError(Exception):
    """A sleep or wake the engine refused or did not answer. ``retryable``: False where
    trying again cannot help (the engine cannot sleep, refused the call outright, or the
    wake found no room or was stopped while it waited)."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable
