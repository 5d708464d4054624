"""The base of every domain value. Pure: no temporalio, httpx or asyncpg here."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    """Base for value objects: immutable, and strict about unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")
