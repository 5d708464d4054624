"""How the API reads the numbers a client sends, and the bound on replicas: shared by the
catalog (deployments) and demand (scaling policies), which the catalog builds on. Pure.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator

#: A generous cap on one deployment's replicas; a typo of 1000 should not try to run.
MAX_REPLICAS = 64

#: Flags and numbers a client sends are taken as JSON types only: "2" is not 2, nor 1
#: true. A lax parse would accept what the OpenAPI schema says is invalid, and a client
#: that sends a string where a number goes has a bug it should hear about.
STRICT = True


def _json_integer(value: object) -> object:
    """An integer as JSON Schema has it: a number without a fraction (2.0 is 2), never a
    string or true/false (which a lax parse would take as 2, 1 or 0)."""
    if isinstance(value, str | bool):
        raise ValueError(f"must be an integer, not {type(value).__name__} {value!r}")
    return value


#: An integer field of a client's request (see :func:`_json_integer`).
JsonInt = Annotated[int, BeforeValidator(_json_integer)]
