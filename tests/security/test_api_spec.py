"""What the API publishes about itself: an OpenAPI document in JSON Schema's own words,
with the bounds the API enforces, and a /docs page that loads nothing from another site
(operators paste their tokens there). No store or Temporal is needed: the app is not
started, only asked for its document and its pages.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from api.app import create_app
from api.operations import DrainRequest
from modelkeeper.domain.catalog import NO_NUL_PATTERN
from modelkeeper.domain.nodes import PortRange
from modelkeeper.domain.operations import MAX_DRAIN_GRACE_S
from modelkeeper.settings import Settings

#: pydantic's names for a number's bounds, which JSON Schema does not know.
NOT_JSON_SCHEMA = frozenset({"ge", "le", "gt", "lt"})
#: An absolute URL in a page: what makes a browser load from another site.
ABSOLUTE_URL = re.compile(r"""(?:https?:)?//[A-Za-z0-9.-]+""")


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(Settings(database_url="postgresql://unused/unused"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as client:
        yield client


def keys(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every (path, key) of a JSON document."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield path, key
            yield from keys(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from keys(value, f"{path}/{index}")


def numeric(schema: dict[str, Any]) -> dict[str, Any]:
    """The numeric branch of a property's schema (``X | None`` is an anyOf with null)."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") in ("integer", "number"):
            return dict(branch)
    raise AssertionError(f"no numeric branch in {schema}")


async def test_the_spec_names_bounds_in_json_schema_keywords(http: httpx.AsyncClient) -> None:
    spec = (await http.get("/openapi.json")).json()
    wrong = [f"{path}/{key}" for path, key in keys(spec) if key in NOT_JSON_SCHEMA]
    assert not wrong, wrong
    schemas = spec["components"]["schemas"]
    # Once written as ge/le, so invisible to any tool: now minimum/maximum.
    assert numeric(schemas["Inventory"]["properties"]["cpu_count"])["maximum"] == 4096
    assert numeric(schemas["Inventory"]["properties"]["memory_total_bytes"])["minimum"] == 0
    assert numeric(schemas["DeploymentPatch"]["properties"]["replicas"])["maximum"] == 64
    assert numeric(schemas["ModelSpec"]["properties"]["memory_bytes"])[
        "exclusiveMinimum"] == 0


async def test_the_drain_grace_and_port_ranges_are_bounded_in_the_spec_and_enforced(
        http: httpx.AsyncClient) -> None:
    spec = (await http.get("/openapi.json")).json()
    grace = numeric(spec["components"]["schemas"]["DrainRequest"]["properties"]["grace_s"])
    assert grace["maximum"] == MAX_DRAIN_GRACE_S == 86_400
    assert grace["exclusiveMinimum"] == 0
    with pytest.raises(ValidationError, match="grace_s"):
        DrainRequest.model_validate({"grace_s": MAX_DRAIN_GRACE_S + 1})
    ports = spec["components"]["schemas"]["PortRange"]
    assert "low <= high" in ports["description"]
    assert ports["properties"]["low"]["maximum"] == 65535
    with pytest.raises(ValidationError, match=r"engine_ports\.low = 9 is above"):
        PortRange(low=9, high=8)


async def test_docs_load_nothing_from_another_site(http: httpx.AsyncClient) -> None:
    page = await http.get("/docs")
    assert page.status_code == 200, page.text
    assert not ABSOLUTE_URL.findall(page.text), ABSOLUTE_URL.findall(page.text)
    named = re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", page.text)
    assets = [url for url in named if url.startswith("/docs/assets/")]
    assert len(assets) >= 3, named  # the script, the stylesheet, the icon
    for url in assets:
        resp = await http.get(url)
        assert resp.status_code == 200 and resp.content, url
    assert (await http.get("/docs/oauth2-redirect")).status_code == 200
    # ReDoc's page loads its script and fonts from other sites: not served.
    assert (await http.get("/redoc")).status_code == 404


async def test_every_free_string_in_the_spec_says_it_holds_no_nul(
        http: httpx.AsyncClient) -> None:
    spec = (await http.get("/openapi.json")).json()
    strings = [schema for schema in schemas(spec) if schema.get("type") == "string"]
    free = [s for s in strings if not {"enum", "const", "format"}.intersection(s)]
    assert len(free) > 20, free  # the walk found the document's strings
    assert all("pattern" in s for s in free), [s for s in free if "pattern" not in s]
    [deployment_id] = [p for p in spec["paths"]["/events"]["get"]["parameters"]
                       if p["name"] == "deployment_id"]
    assert numeric_or_string(deployment_id["schema"])["pattern"] == NO_NUL_PATTERN


def schemas(node: Any) -> Iterator[dict[str, Any]]:
    """Every object in a JSON document."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from schemas(value)
    elif isinstance(node, list):
        for value in node:
            yield from schemas(value)


def numeric_or_string(schema: dict[str, Any]) -> dict[str, Any]:
    """The non-null branch of ``X | None``."""
    [branch] = [b for b in schema.get("anyOf", [schema]) if b.get("type") != "null"]
    return dict(branch)


async def test_the_scaling_policy_and_the_sleep_routes_are_in_the_spec_with_their_bounds(
        http: httpx.AsyncClient) -> None:
    spec = (await http.get("/openapi.json")).json()
    schemas = spec["components"]["schemas"]
    policy = schemas["ScalingRequest"]["properties"]
    assert numeric(policy["max_replicas"])["maximum"] == 64
    assert numeric(policy["idle_timeout_s"])["exclusiveMinimum"] == 0
    assert numeric(policy["idle_timeout_s"])["maximum"] == 30 * 86_400
    assert numeric(policy["load_wait_s"])["maximum"] == 600
    assert set(schemas["ScalingRequest"]["required"]) == {"min_replicas", "max_replicas"}
    # POST /deployments and PATCH take it beside replicas; the views show the policy.
    for request in ("DeploymentRequest", "DeploymentPatch"):
        assert "scaling" in schemas[request]["properties"], request
    assert {"scaling", "loading_since", "loading_reason", "demand_note"} <= set(
        schemas["DeploymentView"]["properties"])
    for action in ("sleep", "wake"):
        route = spec["paths"][f"/deployments/{{deployment_id}}/{action}"]["post"]
        assert {"202", "404", "409"} <= set(route["responses"]), action
        assert route["requestBody"].get("required", False) is False  # the body is optional
