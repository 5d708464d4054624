"""The base of every domain value. Pure: no temporalio, httpx or asyncpg here."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    """Base for value objects: immutable, and strict about unknown keys.

    For what an operator or a client sends (API input): a misspelt key is an error that
    names it, never a setting silently dropped.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")


class Tolerant(BaseModel):
    """Base for values that cross a process boundary between versions: immutable, and
    unknown keys are ignored.

    For what an agent sends the workflow (an agent one version ahead of the worker adds a
    field), and for the workflow's carried state (continue-as-new, and a worker rolled
    back past a new field). A strict model there would fail the workflow task on decode,
    and a workflow task that fails is retried for ever: the deployment wedges. Adding a
    field still needs a default, so that the older shape decodes too.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")
