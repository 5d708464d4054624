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

    @property
    def postgres_dir(self) -> Path:
        """PostgreSQL's PGDATA under the data dir."""
        return self.data_dir / "postgres"

    @property
    def temporal_db_file(self) -> Path:
        """Temporal dev server's SQLite file; keeping it makes workflows survive a restart."""
        return self.data_dir / "temporal" / "temporal.db"

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
