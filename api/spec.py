"""The OpenAPI document as JSON Schema has it.

pydantic writes the bounds of a number whose type has a validator of its own (``JsonInt``,
which refuses ``"2"`` and ``true``) inside a union with null as ``ge``, ``le``, ``gt``
and ``lt``: its parameter names, which no JSON Schema tool knows, so a client generator or
a fuzzer sees no bound at all. :func:`install` renames them, in every numeric schema of the
document, to ``minimum``, ``maximum``, ``exclusiveMinimum`` and ``exclusiveMaximum``
(OpenAPI 3.1 takes the exclusive ones as numbers).

And every string the API reads is refused with a 422 if it holds a NUL
(``limits.refuse_unstorable``: the store cannot hold one), so every string schema that
has no pattern of its own says so with :data:`NO_NUL_PATTERN`; a schema-valid request is
then one the API accepts. (A lone surrogate is refused too; JSON Schema's regular
expressions cannot name one portably, and no UTF-8 query or path can carry one.)
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from modelkeeper.domain.catalog import NO_NUL_PATTERN

#: pydantic's names of a number's bounds, and JSON Schema's.
JSON_SCHEMA_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum",
                      "lt": "exclusiveMaximum"}
_NUMERIC = frozenset({"integer", "number"})
#: A string schema with any of these says what it takes already.
_FIXED_STRING = frozenset({"pattern", "enum", "const", "format"})


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` (and so /openapi.json and /docs) give the renamed document."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = json_schema_bounds(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def json_schema_bounds(node: Any) -> Any:
    """``node`` with pydantic's bound names renamed in each schema of type integer or
    number (a property merely named ``ge`` is left alone: it sits in ``properties``, which
    has no type), and :data:`NO_NUL_PATTERN` on each free string schema."""
    if isinstance(node, dict):
        kind = node.get("type")  # a dict where a property is named "type"
        numeric = isinstance(kind, str) and kind in _NUMERIC
        renamed = {(JSON_SCHEMA_BOUNDS.get(key, key) if numeric else key):
                   json_schema_bounds(value) for key, value in node.items()}
        if kind == "string" and not _FIXED_STRING.intersection(node):
            renamed["pattern"] = NO_NUL_PATTERN
        return renamed
    if isinstance(node, list):
        return [json_schema_bounds(item) for item in node]
    return node
