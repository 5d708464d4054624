"""The model catalog and deployments as the API and store exchange them. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import PurePosixPath
from typing import Annotated, Any, Self
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, StringConstraints, model_validator

from .base import Frozen, Tolerant
from .bounds import MAX_REPLICAS, STRICT, JsonInt
from .capacity import CapacityClass, OwnerPath
from .demand import ScalingPolicy, ScalingRequest
from .ids import DeploymentId, ModelId, NodeId, ReplicaId
from .no_room import IF_NO_ROOM_HELP, MAX_PLAN_NUMBER, PLAN_HELP, IfNoRoom
from .shards import EngineKind
from .sources import SECRET_NAME_PATTERN, SHA256_PATTERN
from .start_progress import QUEUED, ReplicaProgress
from .status import DeploymentStatus, ReplicaState
from .topology import MAX_WATTS, Spread
from .units import format_duration, format_gib
from .versions import normalise_requirement

#: Model ids appear in URLs, workflow ids and OpenAI requests: keep them plain.
MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"

# Bounds on what clients send. Each is far above real use and far below what the store's
# columns hold (bigint, integer), so that a huge or infinite number is a 422 that names
# the field, never a 500 from the database.
#: Memory of one replica or one node: 1 PiB, beyond any machine (the largest have tens of
#: TiB) and far below bigint's 8 EiB.
MAX_MEMORY_BYTES = 1 << 50
#: CPU cores of one replica or node: the largest machines have under 2,000 threads.
MAX_CPU_CORES = 4096
#: GPUs of one replica: 64 nodes of 16.
MAX_GPUS = 1024
#: Labels on a deployment or a node. Kubernetes' limits for a label's name (63, plus a
#: 253-character prefix) and value (63) are the model; placement compares them all on
#: every decision, so their number is kept small too.
MAX_LABELS = 64
MAX_LABEL_KEY_CHARS = 317
MAX_LABEL_VALUE_CHARS = 253
#: Node ids a deployment may be pinned to: more than any cluster modelkeeper runs.
MAX_NODE_IDS = 1024
#: A node id, as the agents' registration bounds it.
MAX_NODE_ID_CHARS = 128
#: The most tokens a model's ``max_tokens`` settings may name: about a million, the
#: longest context windows of today's models, so no real limit is refused, and far
#: below the store's integer columns.
MAX_TOKENS_BOUND = 1 << 20

#: Any text but NUL, which PostgreSQL cannot hold in text or jsonb: a label with one was
#: a 500 from the store instead of a 422 naming it.
NO_NUL_PATTERN = r"^[^\x00]*$"
#: A label map, bounded in count and in the length of each key and value.
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=MAX_LABEL_KEY_CHARS,
                                            pattern=NO_NUL_PATTERN)]
LabelValue = Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE_CHARS,
                                              pattern=NO_NUL_PATTERN)]
Labels = Annotated[dict[LabelKey, LabelValue], Field(max_length=MAX_LABELS)]
#: A node id as a client names one.
NodeIdField = Annotated[NodeId, StringConstraints(min_length=1, max_length=MAX_NODE_ID_CHARS)]

#: The packaged SmolLM2 GGUF, by name, so catalogs need no machine-specific path.
PACKAGED_SMOLLM2 = "smollm2"

#: Hardware profiles one model may declare. Real catalogs have two or three (a GPU engine,
#: a CPU fallback); placement tries each in turn on every node, and a can't-place reason
#: names every one, so the count is kept small.
MAX_PROFILES = 8
#: A profile's name: it is recorded on each replica and shown in ``ls``, so plain words.
PROFILE_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"
#: Priorities a profile may give: a few levels are all anyone orders by; the bound keeps
#: the number within the store's integer and readable.
MAX_PROFILE_PRIORITY = 1000


#: A requirement on an engine's version, PEP 440 (:mod:`~.versions`): ">=0.6.0",
#: "==0.6.3", ">=0.6,<0.8"; a bare version means exactly it. Stored as normalised.
EngineVersionRequirement = Annotated[str, AfterValidator(normalise_requirement)]
ENGINE_VERSION_DESCRIPTION = ("versions of the engine that will do, PEP 440 (>=0.6.0, "
                              "==0.6.3; a bare version means exactly it): a node whose "
                              "agent reports another is passed over, and says why; unset: "
                              "any")


class HardwareProfile(Frozen):
    """One way to run a catalog model: an engine with its memory, GPUs, cores and engine
    arguments (modelkeeper.domain.profiles tries a model's profiles in priority order).

    A profile stands alone: its GPUs, cores and engine arguments are its own, never the
    model's (a llama.cpp profile must not inherit a vLLM entry's arguments or its GPU).
    Only its memory falls back to the model's, which is always known."""

    name: str = Field(pattern=PROFILE_NAME_PATTERN)
    engine: EngineKind
    memory_bytes: JsonInt | None = Field(
        default=None, gt=0, le=MAX_MEMORY_BYTES,
        description="working set per replica under this profile; unset: the model's")
    gpus: JsonInt | None = Field(default=None, ge=0, le=MAX_GPUS,
                                 description="GPUs per shard; unset: none")
    cpu_cores: float | None = Field(default=None, gt=0, le=MAX_CPU_CORES,
                                    allow_inf_nan=False, strict=STRICT,
                                    description="cores per shard; unset: no requirement")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="this profile's engine arguments, in place of "
                                          "the model's (the same allow-list applies)")
    priority: JsonInt = Field(
        default=0, ge=-MAX_PROFILE_PRIORITY, le=MAX_PROFILE_PRIORITY,
        description="higher is tried first; equal priorities keep the declared order")
    engine_version: EngineVersionRequirement | None = Field(
        default=None, description=ENGINE_VERSION_DESCRIPTION + " (this profile's own, "
                                                               "never the model's)")


class Generation(Tolerant):
    """What a replica runs: a catalog model, with engine arguments laid over the catalog
    entry's. The deployment's served name (what clients send as ``model``) does not change
    with it: a switch changes the model behind the name."""

    #: Counts changes of the deployment (a restart, a switch, a reconfigure each take the
    #: next), so "every replica is on the new generation" can be checked.
    number: int = 0
    model_id: ModelId
    #: Laid over the catalog entry's engine_args (the same allow-list applies).
    engine_args: dict[str, Any] = Field(default_factory=dict)


class ModelSpec(Frozen):
    """A model as an operator declares it (POST /models)."""

    model_id: ModelId = Field(pattern=MODEL_ID_PATTERN)
    engine: EngineKind
    source: str = Field(min_length=1, max_length=1000,
                        description="a .gguf path, 'smollm2' for the packaged SmolLM2, "
                                    "a Hugging Face repo id, or an https URL; judged by "
                                    "the source policy (docs/security.md)")
    memory_bytes: JsonInt | None = Field(
        default=None, gt=0, le=MAX_MEMORY_BYTES,
        description="declared working set per replica; estimated from the file size when "
                    "absent (llama.cpp with a local file only)")
    weights_bytes: JsonInt | None = Field(
        default=None, gt=0, le=MAX_MEMORY_BYTES,
        description="what a sleeping replica keeps of memory_bytes (its weights; the KV "
                    "cache is freed), at most memory_bytes, which must then be declared; "
                    "unset: all of it, so a sleep frees nothing in the accounting")
    cpu_cores: float | None = Field(default=None, gt=0, le=MAX_CPU_CORES,
                                    allow_inf_nan=False, strict=STRICT)
    gpus: JsonInt | None = Field(default=None, ge=0, le=MAX_GPUS)
    engine_args: dict[str, Any] = Field(default_factory=dict)
    min_nodes: JsonInt = Field(default=1, ge=1, le=64)
    watts: JsonInt | None = Field(
        default=None, ge=0, le=MAX_WATTS,
        description="watts one shard draws, as declared; power caps per PDU and for the "
                    "facility count it (docs/capacity.md); unset: not counted")
    sha256: str | None = Field(
        default=None, pattern=SHA256_PATTERN,
        description="SHA-256 of the weights file (a URL's or a path's), lowercase hex: the "
                    "agent checks it before the engine reads the file")
    secret: str | None = Field(
        default=None, pattern=SECRET_NAME_PATTERN,
        description="for a URL that needs a token: NAME sends the agent's "
                    "MODELKEEPER_SOURCE_TOKEN_NAME as a bearer token (never a token here)")
    default_max_tokens: JsonInt | None = Field(
        default=None, ge=1, le=MAX_TOKENS_BOUND,
        description="max_tokens the gateway sends with a request that names none (an "
                    "engine would otherwise generate until its context is full); unset: "
                    "max_tokens_limit, or else the engine's own default")
    max_tokens_limit: JsonInt | None = Field(
        default=None, ge=1, le=MAX_TOKENS_BOUND,
        description="most tokens one request may ask for: a larger max_tokens (or "
                    "max_completion_tokens) is lowered to it by the gateway; unset: no "
                    "limit of the model's own")
    engine_version: EngineVersionRequirement | None = Field(
        default=None, description=ENGINE_VERSION_DESCRIPTION)
    profiles: list[HardwareProfile] = Field(
        default_factory=list, max_length=MAX_PROFILES,
        description="ways to run it, tried in priority order where a replica is placed "
                    "(docs/capacity.md, Hardware profiles); none: the model's own engine, "
                    "memory, cores, GPUs and engine_args, as one implicit profile")

    @model_validator(mode="after")
    def _weights_within_memory(self) -> Self:
        if self.weights_bytes is None:
            return self
        if self.memory_bytes is None:
            raise ValueError("weights_bytes needs memory_bytes declared: what a sleeping "
                             "replica keeps is a part of what it claims")
        if self.weights_bytes > self.memory_bytes:
            raise ValueError(f"weights_bytes = {self.weights_bytes} is above memory_bytes = "
                             f"{self.memory_bytes}: a sleeping replica keeps at most what "
                             "it claims")
        return self

    @model_validator(mode="after")
    def _profiles_consistent(self) -> Self:
        seen: set[str] = set()
        for i, profile in enumerate(self.profiles):
            if profile.name in seen:
                raise ValueError(f"profiles[{i}].name = {profile.name!r} is given twice: a "
                                 "replica records the profile it runs by name")
            seen.add(profile.name)
            memory = profile.memory_bytes
            if self.weights_bytes is not None and memory is not None \
                    and self.weights_bytes > memory:
                raise ValueError(f"weights_bytes = {self.weights_bytes} is above "
                                 f"profiles[{i}].memory_bytes = {memory}: a sleeping replica "
                                 "keeps at most what it claims")
        return self

    @model_validator(mode="after")
    def _default_within_limit(self) -> Self:
        if (self.default_max_tokens is not None and self.max_tokens_limit is not None
                and self.default_max_tokens > self.max_tokens_limit):
            raise ValueError(f"default_max_tokens = {self.default_max_tokens} is above "
                             f"max_tokens_limit = {self.max_tokens_limit}: the default "
                             "must be within the limit")
        return self


class CatalogModel(ModelSpec):
    """A model in the catalog: memory is always known, and says if it was estimated."""

    memory_bytes: int = Field(gt=0, le=MAX_MEMORY_BYTES)
    memory_estimated: bool = False
    created_at: datetime | None = None
    #: When its memory, engine arguments or source last changed (PATCH /models/{id});
    #: None: never since it was added. Replicas placed before run the old spec (outdated).
    spec_changed_at: datetime | None = None


class ModelPatch(Frozen):
    """PATCH /models/{id}: the parts of a model's spec that may change while it is
    deployed. Each field given replaces the model's (``engine_args`` as a whole); the
    result is judged as ``POST /models`` judges a new entry. Replicas running keep the old
    spec, and show as outdated until a restart replaces them."""

    memory_bytes: JsonInt | None = Field(
        default=None, gt=0, le=MAX_MEMORY_BYTES,
        description="declared working set per replica; unset: kept (re-estimated from the "
                    "file when it was estimated and the source changes)")
    engine_args: dict[str, Any] | None = Field(
        default=None, description="the engine arguments, replacing the model's whole map "
                                  "(the engine's allow-list applies)")
    source: str | None = Field(default=None, min_length=1, max_length=1000,
                               description="where the weights come from, as POST /models")
    sha256: str | None = Field(
        default=None, pattern=SHA256_PATTERN,
        description="SHA-256 of the new source's file; a model with one must give it (or "
                    "null, to check nothing) with a new source")

    @model_validator(mode="after")
    def _something(self) -> Self:
        if not self.model_fields_set:
            raise ValueError("give at least one of memory_bytes, engine_args, source, "
                             "sha256: an empty change changes nothing")
        return self


class PatchRefused(ValueError):
    """A patch that cannot apply to the model: ``field`` names the part, ``value`` what
    was given, the message the rule."""

    def __init__(self, field: str, value: Any, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


def patched_spec(model: CatalogModel, patch: ModelPatch) -> dict[str, Any]:
    """The fields of ``model`` with ``patch`` laid over them, as ``POST /models`` takes
    them (to be judged as a new entry is). A memory estimated from the old source is
    dropped with a new source, so that it is estimated again (or its absence refused).
    :class:`PatchRefused` when the old sha256 would check the new source's file."""
    given = patch.model_dump(include=patch.model_fields_set)
    fields = model.model_dump(exclude={"memory_estimated", "created_at", "spec_changed_at"})
    source_changes = "source" in given and given["source"] != model.source
    if source_changes and model.sha256 is not None and "sha256" not in given:
        raise PatchRefused("sha256", model.sha256,
                           f"the model's sha256 checks the file of its source "
                           f"{model.source!r}; give the new file's sha256 (or null, to check "
                           "nothing) with the new source")
    if "memory_bytes" not in given and model.memory_estimated and source_changes:
        fields["memory_bytes"] = None
    if "engine_args" in given and given["engine_args"] is None:
        given["engine_args"] = {}
    return {**fields, **given}


def spec_changes(old: CatalogModel, new: CatalogModel) -> list[str]:
    """What changed between two entries of one model, one phrase per part: for the audit
    log and the CLI ("memory 1.0 GiB -> 2.0 GiB")."""
    changes = []
    if old.memory_bytes != new.memory_bytes:
        changes.append(f"memory {format_gib(old.memory_bytes)} -> "
                       f"{format_gib(new.memory_bytes)}"
                       + (" (estimated)" if new.memory_estimated else ""))
    if old.engine_args != new.engine_args:
        changes.append(f"engine_args {old.engine_args} -> {new.engine_args}")
    if old.source != new.source:
        changes.append(f"source {old.source} -> {new.source}")
    if old.sha256 != new.sha256:
        changes.append(f"sha256 {old.sha256 or 'none'} -> {new.sha256 or 'none'}")
    return changes


#: The engines that read one .gguf file, and so cannot take a Hugging Face repo id (a
#: folder of files): llama.cpp.
GGUF_ENGINES = frozenset({EngineKind.LLAMACPP})
#: The packaged SmolLM2 by name, which llama.cpp reads as its .gguf file.
_PACKAGED_GGUF = frozenset({PACKAGED_SMOLLM2})


def engine_source_problem(engine: EngineKind, source: str) -> str | None:
    """Why ``engine`` cannot read ``source``, judged by its form alone, so that a model
    that could never start is refused when it is added, not after its starts have failed:
    llama.cpp reads one .gguf file, so it needs a path or URL ending in ``.gguf``, or
    ``smollm2``; a Hugging Face repo id names a folder. None when the form will do (the
    file itself is checked where it is read)."""
    if engine not in GGUF_ENGINES or source in _PACKAGED_GGUF:
        return None
    path = urlsplit(source).path if "://" in source else source
    if PurePosixPath(path).suffix == ".gguf":
        return None
    what = ("a Hugging Face repo id or another name" if "://" not in source
            and not source.startswith(("/", "~")) else "not a .gguf file")
    return (f"engine {engine.value!r} reads one .gguf file, and {source!r} is {what}: give "
            f"an absolute path or an https URL of a .gguf file (for a Hugging Face repo, "
            f"the URL of the file: https://huggingface.co/ORG/NAME/resolve/main/FILE.gguf), "
            f"or {PACKAGED_SMOLLM2!r}")


#: The replicas of a deployment created with neither ``replicas`` nor ``scaling``.
DEFAULT_REPLICAS = 1


class DeploymentRequest(Frozen):
    """POST /deployments: ``replicas`` (min = max = N) or ``scaling`` (a policy whose
    replicas start at its minimum), not both; neither is ``DEFAULT_REPLICAS``."""

    model_id: ModelId = Field(pattern=MODEL_ID_PATTERN)
    replicas: JsonInt | None = Field(
        default=None, ge=0, le=MAX_REPLICAS,
        description=f"a fixed count, min = max = N; {DEFAULT_REPLICAS} when scaling is "
                    "absent too")
    scaling: ScalingRequest | None = Field(
        default=None, description="how the replica count follows demand (docs/demand.md); "
                                  "the deployment starts at its min_replicas")
    min_nodes: JsonInt = Field(default=1, ge=1, le=64)
    node_ids: list[NodeIdField] | None = Field(default=None, max_length=MAX_NODE_IDS)
    labels: Labels = Field(default_factory=dict)
    capacity_class: CapacityClass | None = Field(
        default=None, description="what may be stopped to place it: a lower class for a "
                                  "higher (docs/capacity.md); unset follows the scaling "
                                  "policy (on demand: opportunistic, else standard)")
    owner: OwnerPath | None = Field(
        default=None, description="who owns it in the tenancy tree: org, org/team or "
                                  "org/team/project; quotas count it there")
    spread: Spread | None = Field(
        default=None, description="spread its replicas' shards over a topology key (zone, "
                                  "rack or pdu) with a max skew (docs/capacity.md)")
    #: What happens when it does not fit now (fit plans); not stored with it.
    if_no_room: IfNoRoom = Field(default=IfNoRoom.QUEUE, description=IF_NO_ROOM_HELP)
    plan: JsonInt | None = Field(default=None, ge=1, le=MAX_PLAN_NUMBER,
                                 description=PLAN_HELP)

    @model_validator(mode="after")
    def _one_count(self) -> Self:
        if self.replicas is not None and self.scaling is not None:
            raise ValueError(f"give one of replicas (a fixed count) or scaling (a policy), "
                             f"not both: replicas = {self.replicas} and scaling = "
                             f"{self.scaling.min_replicas}-{self.scaling.max_replicas} "
                             "were given")
        return self

    @property
    def policy(self) -> ScalingPolicy | None:
        """The scaling policy asked for; None: fixed at :attr:`initial_replicas`."""
        return None if self.scaling is None else self.scaling.policy()

    @property
    def first_status(self) -> DeploymentStatus:
        """Its status before the keeper writes one: what the keeper would say of it (idle
        on demand, stopped with none wanted), else placing."""
        if self.initial_replicas > 0:
            return DeploymentStatus.PLACING
        policy = self.policy
        return (DeploymentStatus.IDLE if policy is not None and policy.on_demand
                else DeploymentStatus.STOPPED)

    @property
    def initial_replicas(self) -> int:
        """The replicas wanted at first: the policy's minimum, or the fixed count."""
        if self.scaling is not None:
            return self.scaling.min_replicas
        return DEFAULT_REPLICAS if self.replicas is None else self.replicas


class ScaleRequest(Frozen):
    """PATCH /deployments/{id}."""

    replicas: JsonInt = Field(ge=0, le=MAX_REPLICAS)


class ReplicaView(Frozen):
    """One replica as the API shows it."""

    replica_id: ReplicaId
    deployment_id: DeploymentId
    model_id: ModelId
    nodes: list[NodeId]
    state: ReplicaState
    endpoint: str | None
    started_at: datetime | None
    ready_at: datetime | None
    #: The deployment's generation it was placed on (0: before generations existed).
    generation: int = 0
    #: The catalog model it runs; None: the deployment's ``model_id``.
    runs_model_id: ModelId | None = None
    #: Placed on an older generation than its deployment's: due to be replaced.
    outdated: bool = False
    #: The catalog model's hardware profile it runs; None: the model declares none.
    profile: str | None = None
    #: A multi-node replica starting: how many of its shards (``nodes``) are ready; None
    #: once it is ready, or for one shard.
    shards_ready: int | None = None
    #: Its engine's last relaunch in place, and why ("engine exited (signalled: killed
    #: by SIGKILL); relaunched in place on n1, try 1 of 3 in 600 s"); None: never.
    relaunch_note: str | None = None
    #: Starting: what its start is doing on its node, as its agent last reported (within
    #: the last few seconds): the download's bytes, share and rate, its place in the
    #: node's start-up queue and whom it waits for (modelkeeper.domain.start_progress).
    #: None when not starting, or nothing reported yet.
    progress: ReplicaProgress | None = None
    #: ``state`` as people read it: ``queued`` for a starting replica waiting its turn
    #: at its node's start-up gate, ``state`` otherwise. Filled in from those two.
    shown_state: str = ""

    @model_validator(mode="before")
    @classmethod
    def _shown_state(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("shown_state"):
            progress = data.get("progress")
            phase = (progress.phase if isinstance(progress, ReplicaProgress)
                     else progress.get("phase") if isinstance(progress, dict) else None)
            state = str(data.get("state", ""))
            data = {**data, "shown_state": QUEUED if state == ReplicaState.STARTING
                    and phase == QUEUED else state}
        return data


class DeploymentView(Frozen):
    """One deployment as the API shows it."""

    deployment_id: DeploymentId
    model_id: ModelId
    status: DeploymentStatus
    placement_error: str | None
    desired_replicas: int
    ready_replicas: int
    consecutive_failures: int
    last_failure: str | None
    min_nodes: int
    #: The generation ``last_failure`` happened on; None: none, or unknown (recorded
    #: before 0030). Older than ``generation``: over (status.failure_is_current).
    last_failure_generation: int | None = None
    node_ids: list[NodeId] | None
    labels: dict[str, str]
    replicas: list[ReplicaView]
    workflow_id: str
    created_at: datetime
    updated_at: datetime
    #: What the deployment runs now (see :class:`Generation`).
    generation: int = 0
    #: The catalog model behind the served name; None: ``model_id`` itself.
    runs_model_id: ModelId | None = None
    #: Why the last replica placed shares a node with another (no other had room), and
    #: the hardware profiles it passed over, each with why.
    placement_note: str | None = None
    #: The scaling policy in force (a schedule window's bounds applied); None: fixed at
    #: ``desired_replicas``, never started on demand.
    scaling: ScalingPolicy | None = None
    #: Loading on demand (status loading): since when, and who asked ("3 request(s)
    #: waiting"); None otherwise.
    loading_since: datetime | None = None
    loading_reason: str | None = None
    #: The last demand step and why, with its time (an eviction's reason included).
    demand_note: str | None = None
    #: The class declared; None: it follows the scaling policy (see ``runs_as``).
    capacity_class: CapacityClass | None = None
    #: The class it runs as (modelkeeper.domain.capacity.effective_class).
    runs_as: CapacityClass = CapacityClass.STANDARD
    owner: str | None = None
    #: ``status`` as people read it: ``queued`` while it is starting and every replica
    #: not yet ready waits at its node's start-up gate (``ReplicaView.shown_state``);
    #: ``status`` otherwise. Filled in from those.
    shown_status: str = ""

    @model_validator(mode="before")
    @classmethod
    def _shown_status(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("shown_status"):
            status = str(data.get("status", ""))
            waiting = [r.shown_state if isinstance(r, ReplicaView) else
                       ReplicaView.model_validate(r).shown_state
                       for r in data.get("replicas", [])
                       if (r.state if isinstance(r, ReplicaView) else r.get("state"))
                       != ReplicaState.READY]
            queued = status == DeploymentStatus.STARTING and bool(waiting) and all(
                w == QUEUED for w in waiting)
            data = {**data, "shown_status": QUEUED if queued else status}
        return data


def current_placement_note(note: str | None, replicas: Sequence[ReplicaView]) -> str | None:
    """The keeper's placement note (``"<replica> shares node n1 with another replica
    ...; <replica> ..."``) without the parts of replicas that no longer share a node with
    another live one of the deployment: once the replica it shared with is gone (the old
    one a restart replaced), "shares node vm with another replica" of a 1/1 deployment
    is not true any more. A part that names no replica of ``replicas`` is kept as it is."""
    if not note:
        return note
    ids = {r.replica_id for r in replicas}
    groups: list[tuple[str | None, list[str]]] = []
    for part in note.split("; "):
        first = part.split(" ", 1)[0]
        if first in ids or not groups:
            groups.append((first if first in ids else None, [part]))
        else:
            groups[-1][1].append(part)  # a "; " inside one replica's note
    live = [r for r in replicas if r.state is not ReplicaState.STOPPING]
    sharing = {r.replica_id for r in live
               if any(set(r.nodes) & set(o.nodes) for o in live if o is not r)}
    kept = ["; ".join(parts) for replica_id, parts in groups
            if replica_id is None or replica_id in sharing]
    return "; ".join(kept) or None


def scaling_summary(policy: ScalingPolicy | None) -> str:
    """A policy in a few words, as ``ls`` and the web UI's run summary show it:
    ``0-2 sleep 2m idle 10m``; ``-`` when fixed."""
    if policy is None:
        return "-"
    words = [f"{policy.min_replicas}-{policy.max_replicas}"]
    for label, seconds in (("sleep", policy.sleep_after_s), ("idle", policy.idle_timeout_s),
                           ("wait", policy.load_wait_s)):
        if seconds is not None:
            words.append(f"{label} {format_duration(seconds)}")
    if policy.warm_standby:
        words.append(f"standby {policy.warm_standby}")
    return " ".join(words)


class DeploymentStatusUpdate(Tolerant):
    """What the keeper writes to the store when its status changes."""

    deployment_id: DeploymentId
    status: DeploymentStatus
    placement_error: str | None
    consecutive_failures: int
    last_failure: str | None
    desired_replicas: int
    #: The deployment's generation, the model behind its served name (None: ``model_id``
    #: itself) and the last placement's sharing note, written as they stand.
    generation: int = 0
    runs_model_id: ModelId | None = None
    placement_note: str | None = None
    #: Demand (modelkeeper.domain.demand): the scaling policy in force (a schedule
    #: window's bounds applied) as JSON, None when fixed at ``desired_replicas``; loading
    #: on demand since when and why; the last demand step and why.
    scaling: dict[str, Any] | None = None
    loading_since: datetime | None = None
    loading_reason: str | None = None
    demand_note: str | None = None


class ReplicaStateUpdate(Tolerant):
    """What the keeper writes when a replica changes state."""

    replica_id: ReplicaId
    state: ReplicaState
    endpoint: str | None = None
    #: A multi-node replica starting: how many of its shards are ready (None: not said).
    shards_ready: int | None = Field(default=None, ge=0)
    #: The keeper's word on its last relaunch in place (Replica.relaunch_note); None: never.
    relaunch_note: str | None = None


#: llama.cpp maps the whole file and adds its KV cache and compute buffers. Measured here
#: with SmolLM2 (98 MB file): 194 MiB RSS at 4 slots of 1024 tokens. 1.2 x file + 96 MiB
#: gives 214 MiB for it: a little above the measurement, as an estimate should be.
ESTIMATE_FACTOR = 1.2
ESTIMATE_OVERHEAD_BYTES = 96 << 20


def estimate_memory_bytes(file_size: int) -> int:
    """Working set of a GGUF model of ``file_size`` bytes under llama.cpp (an estimate)."""
    return int(file_size * ESTIMATE_FACTOR) + ESTIMATE_OVERHEAD_BYTES
