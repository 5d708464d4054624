"""An agent ahead of its API: the API's strict registration model refuses the engines
report (422), and the agent registers again without it instead of giving up
(agent.main._register_once)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from agent.main import NodeIdentity, _register_once
from agent.shards import ShardManager
from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.shards import EngineKind

WELCOME = {"node_id": "n1", "temporal_address": "127.0.0.1:7233",
           "temporal_namespace": "default", "task_queue": "node-n1",
           "heartbeat_interval_s": 5.0, "node_key": "k"}


async def test_an_api_older_than_the_engines_report_is_registered_with_again_without_it(
        tmp_path: Path) -> None:
    bodies: list[dict[str, object]] = []

    def older_api(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        if "engines" in body:  # extra="forbid", as an API before the field answers
            return httpx.Response(422, json={"detail": [{"loc": ["body", "engines"],
                                                         "msg": "Extra inputs"}]})
        return httpx.Response(200, json=WELCOME)

    reg = AgentRegistration(node_id=NodeId("n1"), name="n1", inventory=Inventory(),
                            engines={EngineKind.SIM: "0.2.0"})
    manager = ShardManager(node_id=NodeId("n1"), agent_dir=tmp_path, engine_host="127.0.0.1",
                           port_range=(20000, 20010))
    try:
        async with httpx.AsyncClient(transport=httpx.MockTransport(older_api),
                                     base_url="http://api") as http:
            welcome = await _register_once(http, reg, NodeIdentity(tmp_path, "token"), manager)
    finally:
        await manager.close()
    assert welcome.node_id == "n1"
    assert [("engines" in b) for b in bodies] == [True, False]
    assert bodies[0]["engines"] == {"sim": "0.2.0"}
