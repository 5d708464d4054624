"""The one settings class. Every knob modelkeeper reads from the environment lives here.

Environment variables carry the prefix ``MODELKEEPER_``, except Temporal's address and
namespace, which use the ``temporal`` CLI's own names (``TEMPORAL_ADDRESS``,
``TEMPORAL_NAMESPACE``) so one exported shell environment serves both tools.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .domain.sources import DEFAULT_MAX_DOWNLOAD_BYTES, HUGGING_FACE_HOSTS
from .domain.tunables import (
    AgentTunables,
    ControlTunables,
    GatewayTunables,
    KeeperTunables,
    LivenessTunables,
    NotifyTunables,
    Tunables,
    WatchdogTunables,
)

Port = int
#: The URL schemes the agent can download from (modelkeeper.domain.sources.KNOWN_SCHEMES).
SourceScheme = Literal["https", "http"]
_HTTPS: SourceScheme = "https"


#: The data dir under root: the usual place for a system service's state. Its parents
#: (/, /var, /var/lib) are world-traversable on every distribution, so PostgreSQL's own
#: user reaches its data without a permission change on any of them; under /root (mode
#: 0700) it could not, and opening /root for it exposed root's files to every user.
ROOT_DATA_DIR = Path("/var/lib/modelkeeper")


#: The API's port, and the address `up`'s servers listen on, unless set.
DEFAULT_API_PORT = 8400
DEFAULT_BIND_HOST = "127.0.0.1"
#: How this machine reaches a server bound to every interface.
_LOOPBACK_OF_WILDCARD = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


def local_api_url(bind_host: str, port: int) -> str:
    """The URL of an API on this machine that listens on ``bind_host``:``port``: loopback
    for a wildcard bind, the address itself otherwise (IPv6 in brackets)."""
    host = bind_host.strip("[]")
    host = _LOOPBACK_OF_WILDCARD.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def default_data_dir() -> Path:
    """The data dir unless set: per user, or /var/lib/modelkeeper under root."""
    if os.geteuid() == 0:
        return ROOT_DATA_DIR
    return Path.home() / ".local" / "share" / "modelkeeper"


class Settings(BaseSettings, KeeperTunables, ControlTunables, LivenessTunables, AgentTunables,
               GatewayTunables, WatchdogTunables, NotifyTunables):
    """Process settings, read from the environment (and flags, which override them).

    The timings and limits are the tunables' fields (modelkeeper.domain.tunables),
    inherited: their defaults and reasons live there once.
    """

    model_config = SettingsConfigDict(env_prefix="MODELKEEPER_", extra="ignore", frozen=True)

    data_dir: Path = Field(
        default_factory=default_data_dir,
        description="Where `up` keeps PostgreSQL's data, Temporal's SQLite file and logs. "
        "Under root, /var/lib/modelkeeper: PostgreSQL then runs as its own system user, "
        "which must reach its data, and `up` changes no folder above the data dir (an "
        "older version's data under /root/.local/share/modelkeeper is used when named "
        "here).",
    )
    bind_host: str = Field(
        default=DEFAULT_BIND_HOST,
        description="Address the API, gateway and local servers listen on.",
    )
    api_port: Port = Field(default=DEFAULT_API_PORT, ge=1, le=65535,
                           description="Port of the HTTP API.")
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
        default=8233, ge=1, le=65535,
        description="Port of the Temporal web UI (`up` only), always on loopback: an operator "
        "logs in with an admin token, and other Host headers are refused.",
    )
    temporal_http_port: Port = Field(
        default=7243, ge=1, le=65535,
        description="Port of the Temporal dev server's HTTP API (`up` only), on loopback; it "
        "answers only loopback Host headers.",
    )
    temporal_metrics_port: Port = Field(
        default=7244, ge=1, le=65535,
        description="Port of the Temporal dev server's Prometheus metrics (`up` only), on "
        "loopback.",
    )
    expose_temporal_plaintext: bool = Field(
        default=False,
        description="`up` with a bind_host beyond loopback: let the Temporal dev server listen "
        "there too, in plaintext and without authentication, so agents on other machines can "
        "poll it. Anyone who reaches it can start, signal or terminate any workflow: a "
        "trusted network only (`up` warns). Off: Temporal stays on loopback, and agents on "
        "other machines reach it through the mTLS front (temporal_mtls_port).",
    )
    temporal_mtls_port: Port = Field(
        default=7235, ge=1, le=65535,
        description="Port of `up`'s Temporal mTLS front, on bind_host when it is beyond "
        "loopback (and expose_temporal_plaintext is off): TLS 1.2+ that requires a client "
        "certificate from `up`'s own CA (<data_dir>/temporal-mtls), passed on to the "
        "loopback dev server. Agents on other machines poll Temporal there.",
    )
    database_url: str | None = Field(
        default=None,
        description="PostgreSQL DSN. Unset under `up`, which points it at its embedded server "
        "(as the schema's owner, modelkeeper, whose password is in "
        "<data_dir>/secrets/modelkeeper.pgpass).",
    )
    gateway_database_url: str | None = Field(
        default=None,
        description="PostgreSQL DSN the gateway connects with: a role without DDL rights "
        "(`up` uses modelkeeper_gateway, with its own password), so the process facing "
        "clients cannot change the schema. Set, the gateway never applies migrations; "
        "unset, it uses database_url and migrates like every component.",
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
    # Temporal TLS, mTLS and API key. Each machine keeps its own: an agent takes Temporal's
    # address from the API at registration but never its certificates or key, so the API
    # holds nothing that would let it (or whoever answers in its place) hand them out.
    # Secrets are files, read at start: a value in the environment shows in `ps e`,
    # /proc/PID/environ and `docker inspect`.
    temporal_tls: bool = Field(
        default=False,
        description="Connect to Temporal over TLS, checking the server against the "
        "system's CA roots (or temporal_tls_ca_file). Any temporal_tls_* setting or an "
        "API key turns it on too: none is ever sent in the clear.",
    )
    temporal_tls_ca_file: Path | None = Field(
        default=None,
        description="PEM file of the CA certificates that signed the Temporal server's "
        "certificate. Unset: the system's roots.",
    )
    temporal_tls_cert_file: Path | None = Field(
        default=None,
        description="PEM file of this process's client certificate, for mTLS (with "
        "temporal_tls_key_file). A server that maps certificates to permissions (see "
        "docs/security.md) gives each agent its own, limited to its node's task queue.",
    )
    temporal_tls_key_file: Path | None = Field(
        default=None,
        description="PEM file of the private key of temporal_tls_cert_file (mode 0600).",
    )
    temporal_tls_server_name: str | None = Field(
        default=None,
        description="Name to check the Temporal server's certificate against, when the "
        "address's host is not on it (an IP address, a load balancer).",
    )
    temporal_api_key_file: Path | None = Field(
        default=None,
        description="File holding a Temporal API key (Temporal Cloud), sent as a bearer "
        "token over TLS. A file, never the key itself, so it stays out of the environment "
        "and every log.",
    )
    log_level: str = Field(default="INFO", description="Python logging level.")
    otlp_endpoint: str | None = Field(
        default=None,
        description="OpenTelemetry traces: the base URL of an OTLP/HTTP collector (for "
        "example http://127.0.0.1:4318); the API, worker, gateway and agent post their spans "
        "to <url>/v1/traces. Unset or empty: no tracing, at no cost (docs/operations.md, "
        "Traces).",
    )

    agent_temporal_address: str | None = Field(
        default=None,
        description="Temporal address the API hands to registering agents. Unset: the "
        "API's own TEMPORAL_ADDRESS, unless that is a wildcard, or loopback while the agent "
        "is remote: then Temporal's port on the host the agent used to reach the API "
        "(docs/second-machine.md).",
    )
    agent_temporal_port: Port | None = Field(
        default=None, ge=1, le=65535,
        description="Temporal port the API hands agents on other machines, with the host "
        "they reached the API by, when agent_temporal_address is unset and TEMPORAL_ADDRESS "
        "is loopback or a wildcard. `up` sets it to temporal_mtls_port when its mTLS front "
        "runs. Unset: TEMPORAL_ADDRESS's port.",
    )

    # -- control API: operators ----------------------------------------------------------
    api_auth: bool = Field(
        default=True,
        description="Require an operator token (`modelkeeper tokens create`) on the "
        "operators' routes: viewer reads, admin also changes. Off: anyone who reaches the "
        "API's port may deploy, delete and cordon; for tests only.",
    )
    api_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Host names the API answers besides localhost, 127.0.0.1, ::1 and "
        "bind_host (unless 0.0.0.0), comma-separated: the names clients and agents use to "
        "reach it. Any other Host header gets a 400, which stops DNS rebinding (a web page "
        "whose own name points at the API). '*' answers every host (behind a proxy that "
        "checks it).",
    )
    api_trusted_proxies: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Addresses (or networks, e.g. 10.0.0.0/8) of the proxies in front of "
        "the API whose X-Forwarded-For and X-Forwarded-Proto it believes, comma-separated. "
        "Empty (the default): none; the peer is the TCP connection's, which is what "
        "registration checks (only loopback may register without a join token).",
    )
    token: str | None = Field(
        default=None,
        description="Operator token the CLI sends to the API (Authorization: Bearer). "
        "Unset: the CLI reads token_file.",
    )
    token_file: Path | None = Field(
        default=None,
        description="File holding the CLI's operator token. Unset: "
        "<data_dir>/operator-token, where `up` writes an admin token, when it exists.",
    )

    # -- notifications (docs/operations.md, "Notifications") ----------------------------------
    notify_webhook_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="URLs that receive each notification as signed JSON (HMAC-SHA256 with "
        "notify_secret_file's secret), comma-separated. Named webhook-1, webhook-2... in "
        "this order.",
    )
    notify_slack_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Slack (or Mattermost) incoming-webhook URLs that receive each "
        "notification as {\"text\": ...}, comma-separated; named slack-1, slack-2... Such a "
        "URL is itself a secret: set it in the service's environment file, not on a "
        "command line.",
    )
    notify_secret_file: Path | None = Field(
        default=None,
        description="File holding the shared secret that signs webhook notifications "
        "(required with notify_webhook_urls). A file, so the secret stays out of the "
        "environment and every log.",
    )

    @field_validator("api_trusted_proxies", mode="before")
    @classmethod
    def _split_proxies(cls, value: object) -> object:
        """Comma-separated in the environment; each an address or a network."""
        proxies = ([p.strip() for p in value.split(",") if p.strip()]
                   if isinstance(value, str) else value)
        if not isinstance(proxies, list):
            return proxies  # pydantic names the type it wanted
        for proxy in proxies:
            if not isinstance(proxy, str):
                continue
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ValueError(f"{proxy!r} is not an address or network: give the "
                                 "proxies' addresses, comma-separated (e.g. "
                                 "10.0.0.5,192.168.1.0/24); '*' is not accepted") from None
        return proxies

    @field_validator("otlp_endpoint")
    @classmethod
    def _check_otlp_endpoint(cls, value: str | None) -> str | None:
        """Unset (or empty), or an http(s) URL with a host: the collector's base, without
        /v1/traces."""
        value = (value or "").strip()
        if not value:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http:// or https:// URL: give the OTLP/HTTP "
                             "collector's base URL (e.g. http://127.0.0.1:4318), or leave it "
                             "empty for no tracing")
        if parts.path.rstrip("/").endswith("/v1/traces"):
            raise ValueError(f"{value!r} ends with /v1/traces: give the collector's base URL "
                             "(e.g. http://127.0.0.1:4318); /v1/traces is added")
        return value.rstrip("/")

    @field_validator("notify_webhook_urls", "notify_slack_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        """Comma-separated in the environment; each an http(s) URL."""
        urls = ([u.strip() for u in value.split(",") if u.strip()] if isinstance(value, str)
                else value)
        if not isinstance(urls, list):
            return urls  # pydantic names the type it wanted
        for url in urls:
            if isinstance(url, str) and not url.startswith(("https://", "http://")):
                # The value itself may hold a token (a Slack hook): name only its start.
                raise ValueError(f"{url[:12]!r}... is not an http(s) URL: give whole URLs, "
                                 "comma-separated (e.g. https://hooks.example.com/mk)")
        return urls

    @field_validator("api_allowed_hosts", "gateway_allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: object) -> object:
        """Comma-separated in the environment; each a host name without port or scheme."""
        hosts = ([h.strip() for h in value.split(",") if h.strip()] if isinstance(value, str)
                 else value)
        if not isinstance(hosts, list):
            return hosts  # pydantic names the type it wanted
        for host in hosts:
            if not isinstance(host, str):
                continue
            if not host or "/" in host or host.count(":") == 1 or any(c.isspace() for c in host):
                raise ValueError(f"{host!r} is not a host name: give names or addresses "
                                 "only, comma-separated, without scheme or port "
                                 "(e.g. api.example.com,10.0.0.5)")
        return [h.lower() if isinstance(h, str) else h for h in hosts]


    # -- agent -------------------------------------------------------------------------------
    api_url: str = Field(
        default=f"http://127.0.0.1:{DEFAULT_API_PORT}",
        description="The API's base URL: where the CLI sends its commands, and where an "
        "agent registers and heartbeats. Unset: this machine's API, on api_port "
        "(MODELKEEPER_API_PORT) and bind_host (loopback for a wildcard), so a CLI beside "
        "a stack on another port reaches that stack.",
    )

    @model_validator(mode="before")
    @classmethod
    def _api_url_from_port(cls, data: Any) -> Any:
        """``api_url`` unset: this machine's API, on the port and host it is set to listen
        on (the one home of that default). A port that is not a number is left for its
        field to refuse."""
        if not isinstance(data, dict) or data.get("api_url") is not None:
            return data
        try:
            port = int(data.get("api_port", DEFAULT_API_PORT))
        except (TypeError, ValueError):
            return data
        return {**data, "api_url": local_api_url(str(data.get("bind_host", DEFAULT_BIND_HOST)),
                                                 port)}
    join_token: str | None = Field(
        default=None,
        description="Shared token an agent presents once, to join: it gets its own node "
        "credential in exchange. Unset: the API accepts registrations from loopback only, "
        "and warns at start.",
    )
    join_token_file: Path | None = Field(
        default=None,
        description="A file holding the join token (`--join-token-file`): keeps it off "
        "the command line. MODELKEEPER_JOIN_TOKEN wins when both are set.",
    )
    engine_key_secret: str | None = Field(
        default=None,
        description="Cluster secret from which each node's key, and from that each "
        "replica's engine API key, is derived (HMAC). Only the API and the gateway hold "
        "it; agents get their node's key at registration. `up` generates one.",
    )
    engine_key_secret_previous: str | None = Field(
        default=None,
        description="The cluster secret being rotated out: while set, the gateway falls "
        "back to keys derived from it for engines started before the rotation. Unset it "
        "once every replica has been restarted (docs/security.md).",
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

    # -- model sources (the API checks a catalog entry, the agent checks it again) ------------
    source_schemes: Annotated[list[SourceScheme], NoDecode] = Field(
        default_factory=lambda: [_HTTPS],
        description="URL schemes a model's source may use, comma-separated. http is off by "
        "default: weights fetched in the clear can be swapped on the way (unless the "
        "catalog entry has a sha256).",
    )
    source_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(HUGGING_FACE_HOSTS),
        description="Hosts a source URL, and every redirect its download follows, may "
        "name, comma-separated: exact names, *.suffix for a domain's hosts, or * for any "
        "host name (never a loopback, private or link-local address unless listed). Empty: "
        "no downloads. Default: Hugging Face's hub and its download CDNs.",
    )
    source_local_roots: Annotated[list[Path], NoDecode] | None = Field(
        default=None,
        description="Folders, comma-separated, under which a source path must lie (checked "
        "again after resolving links). Unset: <data_dir>/models and the packaged models' "
        "folder (never the whole data dir, which holds the secrets and PostgreSQL's "
        "files). The API reads a file's size to estimate memory only under these.",
    )
    source_max_download_bytes: int = Field(
        default=DEFAULT_MAX_DOWNLOAD_BYTES, gt=0,
        description="Largest weights file an agent downloads; a longer one is stopped and "
        "removed. The default (512 GiB) holds one GGUF of a 405B model at 8 bits.",
    )

    @field_validator("source_schemes", "source_hosts", "source_local_roots", mode="before")
    @classmethod
    def _split_sources(cls, value: object) -> object:
        """Comma-separated in the environment, as api_allowed_hosts."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    # -- gateway -----------------------------------------------------------------------------
    gateway_auth: bool = Field(
        default=True,
        description="Require a client API key (`modelkeeper keys create`) on /v1. Off: "
        "anyone who reaches the port is served, and the gateway warns loudly at start. "
        "`up` turns it off unless set (or `up --gateway-auth`).",
    )
    gateway_workers: int = Field(
        default=1, ge=1, le=256,
        description="Gateway processes sharing the port (SO_REUSEPORT); one per core lets "
        "a machine's cores all serve.",
    )
    gateway_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Host names the gateway answers besides localhost, 127.0.0.1, ::1 and "
        "bind_host (with 0.0.0.0 or ::, also this machine's name and addresses), "
        "comma-separated: the names clients use to reach it. Any other Host header gets a "
        "400, which stops DNS rebinding (a web page whose own name points at the gateway). "
        "'*' answers every host (behind a proxy that checks it).",
    )
    gateway_metrics_token_file: Path | None = Field(
        default=None,
        description="A file holding the token a scraper sends to the gateway's /metrics "
        "(Authorization: Bearer). While gateway_auth is on, /metrics needs it (and is "
        "refused when this is unset); with auth off, only when it is set.",
    )

    def tunables(self) -> Tunables:
        """What a new deployment runs with: the keeper group from here, the rest fixed."""
        return Tunables(**{name: getattr(self, name) for name in KeeperTunables.model_fields})

    @property
    def gateway_store_url(self) -> str | None:
        """The DSN the gateway connects with: its own role's, or else database_url."""
        return self.gateway_database_url or self.database_url

    @property
    def gateway_migrates(self) -> bool:
        """Whether the gateway applies pending migrations at start: only on database_url's
        role. A role of its own has no DDL rights to apply them with, by design."""
        return self.gateway_database_url is None

    @property
    def postgres_dir(self) -> Path:
        """PostgreSQL's PGDATA under the data dir."""
        return self.data_dir / "postgres"

    @property
    def temporal_db_file(self) -> Path:
        """Temporal dev server's SQLite file; keeping it makes workflows survive a restart."""
        return self.data_dir / "temporal" / "temporal.db"

    @property
    def temporal_mtls_dir(self) -> Path:
        """Where `up` keeps the CA and certificates of its Temporal mTLS front (0700)."""
        return self.data_dir / "temporal-mtls"

    @property
    def engine_key_secret_file(self) -> Path:
        """Where `up` keeps the engine key secret it generated (mode 0600)."""
        return self.data_dir / "engine_key_secret"

    @property
    def operator_token_file(self) -> Path:
        """Where `up` keeps the local user's admin token (mode 0600); the CLI's default."""
        return self.data_dir / "operator-token"

    @property
    def models_dir(self) -> Path:
        """Where local model files go: a default source root (source_local_roots)."""
        return self.data_dir / "models"

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
            default = ("`~/.local/share/modelkeeper` (root: `/var/lib/modelkeeper`)"
                       if name == "data_dir" else "(computed)")
        elif field.default is None:
            default = "(unset)"
        else:
            default = f"`{field.default}`"
        names = " or ".join(f"`{env}`" for env in env_var_names(name))
        rows.append(f"| {names} | {default} | {field.description or ''} |")
    return "\n".join(rows) + "\n"
