"""Every error the gateway answers has one shape, OpenAI's: ``{"error": {"message",
"type", "param", "code"}}`` with a string code, for its own errors and an engine's alike;
and the catalog's bounds on tokens per request, applied with a real sim engine.

The sim answers a bad request as llama.cpp and vLLM do, with the HTTP status as a
numeric code: the gateway must not pass that on as it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

import gateway.admission
from modelkeeper.domain.engine_keys import replica_engine_key
from modelkeeper.infra.processes import free_port
from modelkeeper.store.routing import RoutingStore
from tests.support.gateway_support import (
    HOST,
    NODE,
    SECRET,
    add_deployment,
    add_replica,
    ready_replicas,
    running_gateway,
    sims,
    until,
)

pytestmark = pytest.mark.timeout(90)

MODEL = "sim-errors"
HI = [{"role": "user", "content": "hi"}]



def error_of(resp: httpx.Response) -> dict[str, Any]:
    """The error object, checked to be in the one shape."""
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    error = resp.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert isinstance(error["code"], str), f"a numeric code got through: {error}"
    assert error["param"] is None or isinstance(error["param"], str)
    return dict(error)


async def test_an_engines_400_comes_through_with_a_string_code_and_a_param(
        tmp_path: Path, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    bad = {"model": MODEL, "messages": HI, "stream": "yes"}
    async with sims(tmp_path, MODEL, "r-e") as (sim,), httpx.AsyncClient(timeout=20) as http:
        # Straight from the engine: the status as a number.
        key = replica_engine_key(SECRET, node_id=NODE, replica_id="r-e")
        direct = await http.post(sim.url + "/v1/chat/completions", json=bad,
                                 headers={"Authorization": f"Bearer {key}"})
        assert direct.status_code == 400 and direct.json()["error"]["code"] == 400

        await add_replica(db, deployment, sim.replica_id, sim.url)
        async with running_gateway(database_url) as server:
            await until(lambda: ready_replicas(server, MODEL) == ["r-e"], what="routed")
            resp = await http.post(server.url + "/v1/chat/completions", json=bad)
            assert resp.status_code == 400
            assert resp.headers["x-modelkeeper-replica"] == "r-e"
            assert error_of(resp) == {"message": "stream must be a boolean",
                                      "type": "invalid_request_error", "param": None,
                                      "code": "invalid_request"}
            # A 4xx is the client's mistake, not the engine's failure: it stays routed.
            ok = await http.post(server.url + "/v1/chat/completions",
                                 json={"model": MODEL, "messages": HI, "max_tokens": 1})
            assert ok.status_code == 200, ok.text


async def test_each_of_the_gateways_own_errors_has_the_shape(
        database_url: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    await add_deployment(db, "idle", status="stopped", replicas=0)
    dead = await add_deployment(db, "dead")
    await add_replica(db, dead, "r-dead", f"http://{HOST}:{free_port()}")
    # Small enough for a test's body to cross it in several chunks.
    monkeypatch.setattr(gateway.admission, "MAX_BODY_BYTES", 1024)
    chat = "/v1/chat/completions"
    # The type httpx's json= sends, for the bodies sent as bytes (the gateway wants it).
    async with running_gateway(database_url, gateway_wait_for_replica_s=0.3) as server, \
            httpx.AsyncClient(timeout=20,
                              headers={"content-type": "application/json"}) as http:
        await until(lambda: ready_replicas(server, "dead") == ["r-dead"], what="routed")
        cases: list[tuple[httpx.Response, int, str, str | None]] = [
            (await http.get(server.url + chat), 405, "method_not_allowed", None),
            (await http.post(server.url + "/v1/nope", json={}), 404, "not_found", None),
            (await http.post(server.url + chat, content=b"{nope"), 400, "invalid_json",
             None),
            (await http.post(server.url + chat, content=b"[" * 100_000), 400,
             "json_too_deep", None),
            (await http.post(server.url + chat, content=b'{"model": "idle", "pad": "'
                             + b"x" * (1 << 20) + b'"}'), 413, "body_too_large", None),
            (await http.post(server.url + chat, json={"messages": HI}), 400,
             "model_required", "model"),
            (await http.post(server.url + chat, json={"model": "idle", "messages": []}), 400,
             "invalid_messages", "messages"),
            (await http.post(server.url + "/v1/completions",
                             json={"model": "idle", "prompt": ""}), 400, "invalid_prompt",
             "prompt"),
            (await http.post(server.url + chat, json={"model": "idel", "messages": HI}), 404,
             "model_not_found", "model"),
            (await http.post(server.url + chat, json={"model": "idle", "messages": HI}), 503,
             "model_stopped", None),
        ]
        for resp, status, code, param in cases:
            error = error_of(resp)
            assert (resp.status_code, error["code"], error["param"]) == (status, code, param), \
                error
        # Nothing listens at the replica's address: the gateway's 502 or 503, same shape.
        unanswered = await http.post(server.url + chat, json={"model": "dead", "messages": HI})
        assert unanswered.status_code in (502, 503)
        error_of(unanswered)


async def test_keys_and_rates_are_refused_in_the_shape(database_url: str) -> None:
    routes = await RoutingStore.connect(database_url, migrate=False)
    try:
        _, key = await routes.create_api_key("shape")
        async with running_gateway(database_url, gateway_auth=True, gateway_key_rate_per_s=0.1,
                                   gateway_key_burst=1) as server, \
                httpx.AsyncClient(timeout=20) as http:
            await until(lambda: bool(server.gateway.admission._key_hashes), what="key cached")
            missing = await http.get(server.url + "/v1/models")
            assert (missing.status_code, error_of(missing)["code"]) == (401, "invalid_api_key")
            headers = {"Authorization": f"Bearer {key}"}
            assert (await http.get(server.url + "/v1/models", headers=headers)).status_code \
                == 200
            limited = await http.get(server.url + "/v1/models", headers=headers)
            assert (limited.status_code, error_of(limited)["code"]) == (
                429, "rate_limit_exceeded")
    finally:
        await routes.close()


async def test_the_catalogs_max_tokens_apply_to_the_model_the_deployment_runs(
        tmp_path: Path, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    await db.execute("UPDATE models SET default_max_tokens = 3, max_tokens_limit = 5 "
                     "WHERE model_id = $1", MODEL)
    async with sims(tmp_path, MODEL, "r-t") as (sim,), httpx.AsyncClient(timeout=20) as http:
        await add_replica(db, deployment, sim.replica_id, sim.url)

        async def generated(server_url: str, **asked: int) -> int:
            resp = await http.post(server_url + "/v1/chat/completions",
                                   json={"model": MODEL, "messages": HI, **asked})
            assert resp.status_code == 200, resp.text
            return int(resp.json()["usage"]["completion_tokens"])

        async with running_gateway(database_url) as server:
            await until(lambda: ready_replicas(server, MODEL) == ["r-t"], what="routed")
            # Left out: the model's default (the sim's own would be 16).
            assert await generated(server.url) == 3
            # More than the limit: lowered to it; within it: as asked.
            assert await generated(server.url, max_tokens=1000) == 5
            assert await generated(server.url, max_completion_tokens=1000) == 5
            assert await generated(server.url, max_tokens=4) == 4

        # After a switch the engines run another catalog model: its bounds apply.
        await db.execute("INSERT INTO models (model_id, engine, source, memory_bytes, "
                         "max_tokens_limit) VALUES ('sim-next', 'sim', 'sim', 1, 2)")
        await db.execute("UPDATE deployments SET runs_model_id = 'sim-next' "
                         "WHERE deployment_id = $1", deployment)
        async with running_gateway(database_url, gateway_max_tokens=100) as server:
            await until(lambda: ready_replicas(server, MODEL) == ["r-t"], what="routed")
            assert await generated(server.url) == 2
            assert await generated(server.url, max_tokens=50) == 2
            # The gateway's bound per key still refuses what is over it.
            over = await http.post(server.url + "/v1/chat/completions",
                                   json={"model": MODEL, "messages": HI, "max_tokens": 101})
            assert (over.status_code, error_of(over)["param"]) == (400, "max_tokens")
