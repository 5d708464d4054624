"""The one settings class. Every knob modelkeeper reads from the environment lives here.

Environment variables carry the prefix ``MODELKEEPER_``, except Temporal's address and
namespace, which use the ``temporal`` CLI's own names (``TEMPORAL_ADDRESS``,
``TEMPORAL_NAMESPACE``) so one exported shell environment serves both tools.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

Port = int


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "modelkeeper"


class Settings(BaseSettings):
    """Process settings, read from the environment (and flags, which override them)."""

    model_config = SettingsConfigDict(env_prefix="MODELKEEPER_", extra="ignore", frozen=True)

    data_dir: Path = Field(
        default_factory=_default_data_dir,
        description="Where `up` keeps PostgreSQL's data, Temporal's SQLite file and logs.",
    )
    bind_host: str = Field(
        default="127.0.0.1",
        description="Address the API, gateway and local servers listen on.",
    )
    api_port: Port = Field(default=8400, ge=1, le=65535, description="Port of the HTTP API.")
    gateway_port: Port = Field(
        default=8401, ge=1, le=65535, description="Port of the OpenAI-compatible gateway."
    )
    postgres_port: Port = Field(
        default=8432, ge=1, le=65535, description="Port of the embedded PostgreSQL (`up` only)."
    )
    temporal_port: Port = Field(
        default=7233, ge=1, le=65535,
        description="gRPC port of the Temporal dev server (`up` only).",
    )
    temporal_ui_port: Port = Field(
        default=8233, ge=1, le=65535, description="Port of the Temporal web UI (`up` only)."
    )
    database_url: str | None = Field(
        default=None,
        description="PostgreSQL DSN. Unset under `up`, which points it at its embedded server.",
    )
    temporal_address: str = Field(
        default="127.0.0.1:7233",
        validation_alias=AliasChoices("TEMPORAL_ADDRESS", "MODELKEEPER_TEMPORAL_ADDRESS"),
        description="Temporal frontend host:port (the temporal CLI's variable).",
    )
    temporal_namespace: str = Field(
        default="default",
        validation_alias=AliasChoices("TEMPORAL_NAMESPACE", "MODELKEEPER_TEMPORAL_NAMESPACE"),
        description="Temporal namespace (the temporal CLI's variable).",
    )
    log_level: str = Field(default="INFO", description="Python logging level.")

    agent_temporal_address: str | None = Field(
        default=None,
        description="Temporal address the API hands to registering agents; defaults to "
        "the API's own TEMPORAL_ADDRESS.",
    )
    node_unreachable_after_s: float = Field(
        default=6.0, gt=0,
        description="A node with no heartbeat for this long is unreachable (3 missed "
        "heartbeats at the default 2 s).",
    )
    node_lost_after_s: float = Field(
        default=60.0, gt=0,
        description="A node with no heartbeat for this long is lost.",
    )
    node_silent_after_s: float = Field(
        default=1.5, gt=0,
        description="A node whose liveness stream carries no ping this long is silent: "
        "its deployments are told at once and placement skips it (3 missed pings at the "
        "default 0.5 s). A stream that breaks without a goodbye is silent at once.",
    )

    # -- keeper (deployment workflows) -----------------------------------------------------
    watch_heartbeat_timeout_s: float = Field(
        default=60.0, gt=0,
        description="A replica whose watch misses heartbeats this long is unreachable "
        "(routed around). Only a backstop for when the API is down: node liveness notices "
        "a dead node within node_silent_after_s. At 60 s the SDK sends one heartbeat per "
        "48 s, about 75 Temporal RPCs per shard-hour.",
    )
    replica_lost_after_s: float = Field(
        default=15.0, gt=0,
        description="An unreachable replica whose agent has not vouched for it this long "
        "is lost and placed again. Outlasts an agent restart and a short network blip.",
    )
    start_backoff_initial_s: float = Field(
        default=10.0, gt=0, description="Wait after the first failed start (doubles).")
    start_backoff_max_s: float = Field(
        default=60.0, gt=0, description="Longest wait between failed starts.")
    park_after_failures: int = Field(
        default=5, ge=1, description="Failed starts in a row before a deployment is parked.")
    cant_place_retry_s: float = Field(
        default=30.0, gt=0,
        description="First blind retry of an unplaceable deployment (a node change retries "
        "it at once); each retry that still finds no room doubles the wait, up to 30 min.")
    settling_window_s: float = Field(
        default=15.0, ge=0,
        description="A fresh worker waits this long (or half of it with a steady node "
        "count) before placing, so agents can reconnect and report what they run.",
    )
    sweep_interval_s: float = Field(
        default=60.0, gt=0,
        description="How often the control worker sweeps away deployments whose workflow "
        "is gone (terminated, or never started): rows, replicas and claims. At 60 s a "
        "terminated deployment's memory returns to placement within about 2 minutes, for "
        "one Temporal describe per deployment per minute.",
    )

    # -- agent -------------------------------------------------------------------------------
    api_url: str = Field(
        default="http://127.0.0.1:8400",
        description="Where an agent registers and heartbeats (the API's base URL).",
    )
    join_token: str | None = Field(
        default=None,
        description="Shared token agents present to register. Unset: registration is open "
        "(local use only; the API warns).",
    )
    engine_key_secret: str | None = Field(
        default=None,
        description="Secret from which each replica's engine API key is derived "
        "(HMAC of the replica id). Only agents and the gateway hold it. `up` generates one.",
    )
    node_name: str | None = Field(
        default=None, description="The agent's node name; defaults to the host name.")
    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description='Agent-reported node labels, as JSON (e.g. {"zone": "a"}) or flags '
        "`--label k=v`.",
    )
    node_memory: str | None = Field(
        default=None,
        description="Memory the node declares (e.g. 16GiB); less than it has is allowed.",
    )
    node_cpus: int | None = Field(default=None, ge=1, description="CPUs the node declares.")
    heartbeat_interval_s: float = Field(
        default=2.0, gt=0, le=60, description="Seconds between an agent's heartbeats.")
    liveness_interval_s: float = Field(
        default=0.5, gt=0, le=60,
        description="Seconds between the pings on an agent's liveness stream. Keep 3 of "
        "them within the API's node_silent_after_s, so one late ping is not silence.",
    )
    engine_host: str = Field(
        default="127.0.0.1",
        description="Address engines bind to and that endpoints advertise.",
    )
    engine_port_range: str = Field(
        default="20000-20999", pattern=r"^\d{1,5}-\d{1,5}$",
        description="Ports an agent hands to engines, as LOW-HIGH.",
    )
    llama_server_path: Path | None = Field(
        default=None,
        description="A native llama-server binary to use instead of the xllamacpp wheel.",
    )
    agent_stop_engines_on_exit: bool = Field(
        default=False,
        description="Stop this agent's engines when it exits. Off in production (a "
        "restarted agent adopts them). `up` leaves it off too, so a restarted local agent "
        "adopts its engines, and stops the engines itself on Ctrl-C.",
    )
    orphan_grace_s: float = Field(
        default=120.0, gt=0,
        description="An agent stops a shard nobody has watched for this long (split-brain "
        "guard: the control plane declared it lost and placed it elsewhere).",
    )
    max_concurrent_startups: int = Field(
        default=1, ge=1,
        description="Engines an agent lets load at once; later starts wait their turn "
        "(first come, first served), shown as queued, and their fit is checked again "
        "when it comes. An engine sizes itself from the memory it finds while loading "
        "(vLLM asserts free memory did not change), so two loads on one node can break "
        "each other. Stops are never delayed.",
    )

    # -- gateway -----------------------------------------------------------------------------
    gateway_auth: bool = Field(
        default=True,
        description="Require a client API key (`modelkeeper keys create`) on /v1. Off: "
        "anyone who reaches the port is served, and the gateway warns loudly at start.",
    )
    gateway_workers: int = Field(
        default=1, ge=1, le=256,
        description="Gateway processes sharing the port (SO_REUSEPORT); one per core lets "
        "a machine's cores all serve.",
    )
    gateway_wait_for_replica_s: float = Field(
        default=10.0, ge=0,
        description="How long after it arrives a request for a known model may wait for a "
        "replica: one that is ready, or one to retry on after a replica failed it before "
        "answering (an engine crash). Then it is answered 503 (never sent) or 502 (failed).",
    )
    gateway_retry_after_s: int = Field(
        default=5, ge=1,
        description="Retry-After (seconds) of a 503 for a model that is still placing or "
        "starting.",
    )
    gateway_retries: int = Field(
        default=2, ge=0,
        description="Times a request is sent again after a replica refuses or drops the "
        "connection before answering, counting a send to a replacement after waiting.",
    )
    gateway_connect_timeout_s: float = Field(
        default=3.0, gt=0, description="Longest wait to connect to an engine.")
    gateway_read_timeout_s: float = Field(
        default=300.0, gt=0,
        description="Longest silence from an engine (before its answer, or between two "
        "streamed chunks) before the request fails.",
    )
    gateway_breaker_failures: int = Field(
        default=5, ge=1,
        description="Failures in a row (refused, reset, 5xx, cut streams) that open a "
        "replica's circuit breaker, taking it out of routing.",
    )
    gateway_breaker_open_s: float = Field(
        default=5.0, gt=0,
        description="How long an open breaker keeps a replica out before one trial request "
        "(doubling, up to 60 s, while trials fail).",
    )
    usage_flush_interval_s: float = Field(
        default=1.0, gt=0,
        description="How often each gateway worker writes per-replica usage (in-flight, "
        "waiting, last used) to the store, in one batch.",
    )

    @property
    def postgres_dir(self) -> Path:
        """PostgreSQL's PGDATA under the data dir."""
        return self.data_dir / "postgres"

    @property
    def temporal_db_file(self) -> Path:
        """Temporal dev server's SQLite file; keeping it makes workflows survive a restart."""
        return self.data_dir / "temporal" / "temporal.db"

    @property
    def engine_key_secret_file(self) -> Path:
        """Where `up` keeps the engine key secret it generated (mode 0600)."""
        return self.data_dir / "engine_key_secret"

    @property
    def agent_dir(self) -> Path:
        """An agent's identity, shard records and engine logs."""
        return self.data_dir / "agent"

    @property
    def engine_ports(self) -> tuple[int, int]:
        """``engine_port_range`` as (low, high)."""
        low, high = (int(part) for part in self.engine_port_range.split("-"))
        return low, high

    @property
    def log_dir(self) -> Path:
        """Where `up` writes each child's log."""
        return self.data_dir / "logs"


def env_var_names(name: str) -> list[str]:
    """The environment variable names that set the field ``name``, first one preferred."""
    field = Settings.model_fields[name]
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return [str(choice) for choice in alias.choices]
    return [f"MODELKEEPER_{name.upper()}"]


def config_table_markdown() -> str:
    """The README's configuration table, generated from ``Settings`` so the two cannot drift."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        if field.default_factory is not None:
            default = "`~/.local/share/modelkeeper`" if name == "data_dir" else "(computed)"
        elif field.default is None:
            default = "(unset)"
        else:
            default = f"`{field.default}`"
        names = " or ".join(f"`{env}`" for env in env_var_names(name))
        rows.append(f"| {names} | {default} | {field.description or ''} |")
    return "\n".join(rows) + "\n"
