"""The operator CLI's room surfaces (docs/capacity.md, "Seeing the room" and "Fit plans"):
`status`, `headroom` of a deployment or of a model not deployed, `deploy` and `scale` with
`--if-no-room` and `--plan`, and a 409 with plans read as one sentence with exit 2. No
server: httpx.MockTransport answers."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from cli.main import build_parser
from cli.operator_cli import OPERATOR_COMMANDS, Request, UsageError, render, run_operator_command

pytestmark = pytest.mark.timeout(10)

GiB = 1 << 30
DEPLOYMENTS: list[dict[str, Any]] = [
    {"deployment_id": "d1", "model_id": "chat", "status": "serving", "desired_replicas": 1}]
FLEET: dict[str, Any] = {
    "at": "2026-12-01T12:00:00Z", "nodes": {"cordoned": 1, "ready": 2},
    "nodes_memory_unknown": 0,
    "memory": {"total_bytes": 32 * GiB, "used_bytes": 20 * GiB, "free_bytes": 12 * GiB},
    "gpus": [{"gpu_class": "NVIDIA H100", "total": 2, "used": 0, "free": 1, "unhealthy": 1}],
    "free_whole_nodes": ["n3"], "deployments": 2, "replicas": {"ready": 2},
    "models_in_catalog": 5, "models_deployed": 2,
    "cant_place": [{"deployment_id": "d9", "model_id": "huge", "status": "cant_place",
                    "reason": "node n1: 4.0 GiB free, needs 64.0 GiB"}],
    "unasked": [{"replica_id": "d2-r1", "deployment_id": "d2", "state": "ready",
                 "idle_s": 7500.0, "memory_bytes": 8 * GiB, "nodes": ["n2"]}],
    "usage_unknown": [{"replica_id": "d1-r1", "deployment_id": "d1", "state": "ready",
                       "idle_s": None, "memory_bytes": 12 * GiB, "nodes": ["n1"]}],
    "unasked_after_s": 3600.0}
HEADROOM: dict[str, Any] = {
    "model_id": "chat", "deployment_id": "d1", "memory_bytes": 8 * GiB,
    "total": 2,
    "headroom": {"now": 1, "capped": False,
                 "by_stopping": [{"victims": [{"replica_id": "d2-r1", "deployment_id": "d2",
                                               "kind": "preempt",
                                               "runs_as": "opportunistic"}],
                                  "frees": {"memory_bytes": 8 * GiB, "gpus": 0,
                                            "cpu_cores": 0.0},
                                  "place_on": ["n2"]}],
                 "reason": "no more by stopping others: d1-r1 (d1): a replica of the "
                           "deployment asking"}}


def parse(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


def request_of(*argv: str) -> Request:
    args = parse(*argv)
    return OPERATOR_COMMANDS[args.command].request(args)


def test_status_shows_the_aggregates_then_the_lists() -> None:
    assert (request_of("status").method, request_of("status").path) == ("GET", "/fleet")
    assert render(parse("status"), FLEET).splitlines() == [
        "nodes: 1 cordoned, 2 ready",
        "memory: 20.0 GiB used of 32.0 GiB, 12.0 GiB free",
        "GPU CLASS    TOTAL  USED  FREE  UNHEALTHY",
        "NVIDIA H100  2      0     1     1",
        "free whole nodes: 1 (n3)",
        "deployments: 2; replicas: 2 (2 ready); models: 2 deployed of 5 in the catalog",
        "cannot be placed:",
        "DEPLOYMENT  MODEL  STATUS      REASON",
        "d9          huge   cant_place  node n1: 4.0 GiB free, needs 64.0 GiB",
        "asked for by nobody in 1h or more:",
        "REPLICA  DEPLOYMENT  STATE  IDLE    MEMORY   NODES",
        "d2-r1    d2          ready  2h 05m  8.0 GiB  n2",
        "usage unknown (no gateway reports it; unknown is not idle): d1-r1"]


def test_headroom_asks_the_deployment_else_the_model() -> None:
    request = request_of("headroom", "chat")
    assert request.then is not None
    assert request.then(DEPLOYMENTS).path == "/deployments/d1/headroom"
    assert request.then(DEPLOYMENTS).then is None
    other = request_of("headroom", "new")
    assert other.then is not None
    assert other.then(DEPLOYMENTS).path == "/models/new/headroom"
    assert render(parse("headroom", "chat"), HEADROOM).splitlines() == [
        "chat (d1), 8.0 GiB a replica: 1 more fit now; 1 more by stopping others",
        "REPLICA  STOPPING                        FREES    ON",
        "+1       d2-r1 (preempt, opportunistic)  8.0 GiB  n2",
        "no more: no more by stopping others: d1-r1 (d1): a replica of the deployment "
        "asking"]


def test_deploy_and_scale_send_if_no_room_and_plan_only_when_given() -> None:
    plain = request_of("deploy", "chat")
    assert plain.body is not None and "plan" not in plain.body
    assert "if_no_room" not in plain.body
    planned = request_of("deploy", "chat", "--if-no-room", "plan", "--plan", "2")
    assert planned.body is not None
    assert (planned.body["if_no_room"], planned.body["plan"]) == ("plan", 2)
    scale = request_of("scale", "chat", "3", "--plan", "1")
    assert scale.then is not None
    patch = scale.then(DEPLOYMENTS)
    assert (patch.method, patch.path, patch.body) == ("PATCH", "/deployments/d1",
                                                      {"replicas": 3, "plan": 1})
    with pytest.raises(UsageError, match="--plan 0: must be a plan's number"):
        request_of("deploy", "chat", "--plan", "0")
    with pytest.raises(UsageError, match="go with a replica count"):
        request_of("scale", "chat", "--min", "0", "--max", "1", "--plan", "1")


def test_a_409_with_plans_is_one_sentence_naming_them() -> None:
    detail = ("a deployment of chat does not fit on the ready nodes; plan 1: sleep d2's "
              "replica d2-r1 (frees 6.0 GiB on n2)")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(409, json={"detail": detail, "plans": [{"number": 1}]})

    with pytest.raises(UsageError) as raised:
        run_operator_command(parse("deploy", "chat", "--if-no-room", "plan"), "http://api",
                             print, transport=httpx.MockTransport(handler))
    assert str(raised.value) == f"409 {detail}"
