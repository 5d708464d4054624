"""What benchmark clients sent that the gateway refused or changed without a word (issue
27): the routes an engine serves beyond completions, ``max_tokens: -1``, the length the
gateway sets, and an engine's context-overflow error with its token counts. Against a
recording engine that answers as llama.cpp does (shapes checked on llama.cpp itself)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import httpx
import pytest
from aiohttp import web

from modelkeeper.infra.processes import free_port
from tests.support.gateway_support import (
    HOST,
    add_deployment,
    add_replica,
    ready_replicas,
    running_gateway,
    until,
)

pytestmark = pytest.mark.timeout(60)

MODEL = "sim-routes"
#: llama.cpp's answer to a prompt over its context (seen from its server, 601 tokens
#: against --ctx 256).
OVERFLOW = {"error": {"code": 400, "message": "request (601 tokens) exceeds the available "
                      "context size (256 tokens), try increasing it",
                      "type": "exceed_context_size_error", "n_prompt_tokens": 601,
                      "n_ctx": 256}}


@asynccontextmanager
async def recording_engine() -> AsyncIterator[tuple[str, list[tuple[str, dict[str, Any]]]]]:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.path, body))
        if request.path == "/v1/embeddings":
            return web.json_response({"object": "list", "data": [
                {"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                "usage": {"prompt_tokens": 1, "total_tokens": 1}})
        if body.get("prompt") == "too long":
            return web.json_response(OVERFLOW, status=400)
        return web.json_response({"object": "text_completion", "model": MODEL, "choices": [
            {"index": 0, "text": "hi", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, HOST, port).start()
    try:
        yield f"http://{HOST}:{port}", seen
    finally:
        await runner.cleanup()


async def test_routes_lengths_and_errors_that_benchmark_clients_met(
        database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    await db.execute("UPDATE models SET default_max_tokens = 256, max_tokens_limit = 512 "
                     "WHERE model_id = $1", MODEL)
    async with recording_engine() as (url, seen), running_gateway(database_url) as server, \
            httpx.AsyncClient(timeout=10) as http:
        await add_replica(db, deployment, "r-1", url)
        await until(lambda: ready_replicas(server, MODEL) == ["r-1"], what="routed")
        await until(lambda: server.gateway.table.models[MODEL].route.max_tokens_limit == 512,
                    what="the model's limits read")

        # A request naming no length gets the model's default, and is told so.
        resp = await http.post(server.url + "/v1/completions",
                               json={"model": MODEL, "prompt": "x"})
        assert resp.status_code == 200
        assert seen[-1][1]["max_tokens"] == 256
        assert resp.headers["x-modelkeeper-output-limit"].startswith("max_tokens=256; ")
        # -1 ("as many as may be"): the model's limit, not a 400.
        resp = await http.post(server.url + "/v1/completions",
                               json={"model": MODEL, "prompt": "x", "max_tokens": -1})
        assert resp.status_code == 200, resp.text
        assert seen[-1][1]["max_tokens"] == 512
        assert "lowered from -1" in resp.headers["x-modelkeeper-output-limit"]
        # Within the limit: as asked, and no header.
        resp = await http.post(server.url + "/v1/completions",
                               json={"model": MODEL, "prompt": "x", "max_tokens": 7})
        assert seen[-1][1]["max_tokens"] == 7
        assert "x-modelkeeper-output-limit" not in resp.headers

        # Embeddings reach the engine as sent: no length added.
        resp = await http.post(server.url + "/v1/embeddings",
                               json={"model": MODEL, "input": "hello"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["data"][0]["embedding"] == [0.1, 0.2]
        assert seen[-1] == ("/v1/embeddings", {"model": MODEL, "input": "hello"})
        empty = await http.post(server.url + "/v1/embeddings",
                                json={"model": MODEL, "input": ""})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"

        # One model, as the list shows it; an unknown one names the known.
        one = await http.get(server.url + f"/v1/models/{MODEL}")
        assert one.status_code == 200 and one.json()["id"] == MODEL
        assert one.json() == (await http.get(server.url + "/v1/models")).json()["data"][0]
        missing = await http.get(server.url + "/v1/models/nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["known_models"] == [MODEL]

        # Routes not passed on: a 404 that names them, not "no route".
        for path in ("/v1/responses", "/v1/messages"):
            resp = await http.post(server.url + path, json={"model": MODEL})
            assert resp.status_code == 404
            error = resp.json()["error"]
            assert error["code"] == "unsupported_route" and path in error["message"]

        # The context overflow keeps llama.cpp's counts.
        resp = await http.post(server.url + "/v1/completions",
                               json={"model": MODEL, "prompt": "too long", "max_tokens": 4})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["type"] == "exceed_context_size_error"
        assert (error["n_prompt_tokens"], error["n_ctx"]) == (601, 256)
        assert json.loads(resp.content)["error"]["message"].startswith("request (601 tokens)")
