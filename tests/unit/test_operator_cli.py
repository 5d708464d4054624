"""The operator CLI's table: each command's request from its arguments, its renderings, and
its exit codes (2 for a user mistake, 1 for a failing API). No server: httpx.MockTransport
answers."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import pytest

from cli import main as cli
from cli.main import build_parser
from cli.operator_cli import (
    COMMANDS,
    OPERATOR_COMMANDS,
    ApiError,
    Request,
    UsageError,
    parse_pairs,
    render,
    run_operator_command,
)

pytestmark = pytest.mark.timeout(10)

GiB = 1 << 30
API = "http://api.test"

DEPLOYMENTS: list[dict[str, Any]] = [
    {"deployment_id": "d1", "model_id": "big", "status": "cant_place", "ready_replicas": 0,
     "desired_replicas": 1, "consecutive_failures": 0,
     "placement_error": "node small: 8.0 GiB free, needs 64.0 GiB", "last_failure": None,
     "workflow_id": "deployment/d1"},
    {"deployment_id": "d2", "model_id": "sim-12g", "status": "serving", "ready_replicas": 2,
     "desired_replicas": 2, "consecutive_failures": 1, "placement_error": None,
     "last_failure": "exit 137 (oom)", "workflow_id": "deployment/d2"},
]
NODES: list[dict[str, Any]] = [
    {"name": "small", "node_id": "n1", "state": "ready", "memory_total_bytes": 8 * GiB,
     "memory_claimed_bytes": 0, "memory_free_bytes": 8 * GiB,
     "memory_available_bytes": 12 * GiB, "cpu_count": 4,
     "labels": {"zone": "a", "gpu": "none"}, "last_seen": "2024-01-01T00:00:00Z"},
    {"name": "bare", "node_id": "n2", "state": "lost", "memory_total_bytes": None,
     "memory_claimed_bytes": None, "memory_free_bytes": None,
     "memory_available_bytes": None, "cpu_count": None,
     "labels": {}, "last_seen": "2024-01-01T00:00:01Z"},
]
EXPLAIN_NO: dict[str, Any] = {
    "model_id": "big", "fits": False, "nodes_chosen": [], "summary": "no node has 64.0 GiB free",
    "nodes": [{"node_id": "n1", "name": "small", "fits": False,
               "message": "8.0 GiB free, needs 64.0 GiB"}]}
EXPLAIN_YES: dict[str, Any] = {
    "model_id": "tiny", "fits": True, "nodes_chosen": ["n-7f3a9c"], "summary": "",
    "nodes": [{"node_id": "n-7f3a9c", "name": "small", "fits": True, "message": "fits"}]}
MODELS: list[dict[str, Any]] = [
    {"model_id": "sim-12g", "engine": "sim", "source": "sim", "memory_bytes": 12 * GiB,
     "memory_estimated": False, "min_nodes": 1},
    {"model_id": "qwen", "engine": "vllm", "source": "Qwen/Qwen2", "memory_bytes": None,
     "memory_estimated": True, "min_nodes": 2},
]


def parse(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


#: The fewest positional arguments each command takes.
POSITIONALS: dict[str, list[str]] = {
    "deploy": ["x"], "rm": ["x"], "explain": ["x"], "scale": ["x", "1"], "sleep": ["x"],
    "wake": ["x"], "retry": ["x"],
    "restart": ["x"], "switch": ["x", "m"], "reconfigure": ["x", "k=v"], "cordon": ["n"],
    "uncordon": ["n"], "drain": ["n"], "hold": ["n"], "unhold": ["n"],
    "schedule": ["ls", "x"], "headroom": ["x"],
    "owner": ["x", "acme"], "size": ["x", "--rps", "1"], "notify": ["test"]}


# --- The table ---------------------------------------------------------------------------


def test_the_table_holds_every_command_in_help_order() -> None:
    assert [c.name for c in COMMANDS] == [
        "deploy", "ls", "status", "headroom", "rm", "nodes", "explain", "models", "size",
        "scale", "sleep", "wake", "retry", "restart", "switch", "reconfigure", "cordon",
        "uncordon", "drain", "hold", "unhold", "operations", "schedule", "quota", "owner",
        "power-cap", "notify"]
    assert set(OPERATOR_COMMANDS) == {c.name for c in COMMANDS}
    for command in COMMANDS:  # each is registered with the common flags
        args = parse(command.name, *POSITIONALS.get(command.name, []), "--json",
                     "--api-url", API)
        assert (args.command, args.json, args.api_url) == (command.name, True, API)


def test_top_level_help_names_every_component_and_operator_command() -> None:
    shown = build_parser().format_help()
    described = shown.split("positional arguments")[0]
    for name in ["up", "worker", "api", "gateway", "agent", "keys", "tokens",
                 *OPERATOR_COMMANDS]:
        assert f"`{name}`" in described, name


def test_models_add_source_help_says_which_values_it_accepts() -> None:
    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    shown = " ".join(sub.choices["models"].format_help().split())
    for accepted in [".gguf path", "https URL", "Hugging Face repo id", "'smollm2'",
                     "sim engine"]:
        assert accepted in shown, accepted


@pytest.mark.parametrize(("argv", "expected"), [
    (["deploy", "m"],
     Request("POST", "/deployments", body={"model_id": "m", "replicas": 1, "min_nodes": 1,
                                           "node_ids": None, "labels": {}})),
    (["deploy", "m", "--replicas", "3", "--min-nodes", "2", "--node", "n1", "--node", "n2",
      "--require-label", "gpu=a100", "--require-label", "zone="],
     Request("POST", "/deployments", body={"model_id": "m", "replicas": 3, "min_nodes": 2,
                                           "node_ids": ["n1", "n2"],
                                           "labels": {"gpu": "a100", "zone": ""}})),
    (["ls"], Request("GET", "/deployments")),
    (["nodes"], Request("GET", "/nodes")),
    (["explain", "big"], Request("GET", "/placement/explain", params={"model_id": "big"})),
    (["models"], Request("GET", "/models")),
    (["models", "ls"], Request("GET", "/models")),
    (["models", "add", "m", "--engine", "sim", "--source", "sim"],
     Request("POST", "/models", body={"model_id": "m", "engine": "sim", "source": "sim",
                                      "engine_args": {}})),
    (["models", "add", "m", "--engine", "sim", "--source", "sim", "--default-max-tokens",
      "256", "--max-tokens-limit", "1024"],
     Request("POST", "/models", body={"model_id": "m", "engine": "sim", "source": "sim",
                                      "engine_args": {}, "default_max_tokens": 256,
                                      "max_tokens_limit": 1024})),
    # By name: the API resolves names to ids (api.nodes.resolve_node_ids).
    (["deploy", "m", "--node", "gpu-box-1"],
     Request("POST", "/deployments", body={"model_id": "m", "replicas": 1, "min_nodes": 1,
                                           "node_ids": ["gpu-box-1"], "labels": {}})),
    (["operations"], Request("GET", "/operations")),
    (["operations", "ls", "--deployment", "d1", "--state", "running", "--limit", "5"],
     Request("GET", "/operations", params={"deployment": "d1", "state": "running",
                                           "limit": "5"})),
    (["operations", "--node", "n1"], Request("GET", "/operations", params={"node": "n1"})),
    (["operations", "show", "restart/d1/1"], Request("GET", "/operations/restart/d1/1")),
    (["operations", "cancel", "drain/n1/2"],
     Request("POST", "/operations/drain/n1/2/cancel")),
    # `ops`, its name before 0.2, still answers: scripts that use it keep working.
    (["ops", "show", "restart/d1/1"], Request("GET", "/operations/restart/d1/1")),
    (["models", "add", "m", "--engine", "vllm", "--source", "org/m", "--memory", "12GiB",
      "--engine-arg", "tensor_parallel_size=2", "--engine-arg", "enforce_eager=true",
      "--engine-arg", "dtype=bfloat16", "--engine-arg", "x=a=b"],
     Request("POST", "/models", body={
         "model_id": "m", "engine": "vllm", "source": "org/m", "memory_bytes": 12 * GiB,
         "engine_args": {"tensor_parallel_size": 2, "enforce_eager": True,
                         "dtype": "bfloat16", "x": "a=b"}})),
])
def test_each_command_builds_its_request_from_its_arguments(
    argv: list[str], expected: Request,
) -> None:
    args = parse(*argv)
    assert OPERATOR_COMMANDS[args.command].request(args) == expected


def test_rm_looks_the_target_up_by_deployment_or_model_id_then_deletes_it() -> None:
    lookup = OPERATOR_COMMANDS["rm"].request(parse("rm", "sim-12g"))
    assert (lookup.method, lookup.path, lookup.then is not None) == ("GET", "/deployments",
                                                                     True)
    assert lookup.then is not None
    assert lookup.then(DEPLOYMENTS) == Request("DELETE", "/deployments/d2")
    by_id = OPERATOR_COMMANDS["rm"].request(parse("rm", "d1"))
    assert by_id.then is not None and by_id.then(DEPLOYMENTS) == Request("DELETE",
                                                                         "/deployments/d1")


def test_rm_of_an_unknown_target_is_a_usage_error_naming_it_and_what_exists() -> None:
    lookup = OPERATOR_COMMANDS["rm"].request(parse("rm", "nope"))
    assert lookup.then is not None
    with pytest.raises(UsageError) as info:
        lookup.then(DEPLOYMENTS)
    assert "'nope'" in str(info.value) and "big, sim-12g" in str(info.value)


@pytest.mark.parametrize(("argv", "expected"), [
    (["scale", "sim-12g", "3"], Request("PATCH", "/deployments/d2", body={"replicas": 3})),
    (["retry", "d1"], Request("POST", "/deployments/d1/retry")),
    (["restart", "sim-12g"], Request("POST", "/deployments/d2/restart")),
    (["switch", "d2", "big"], Request("POST", "/deployments/d2/switch",
                                      body={"model_id": "big"})),
    (["reconfigure", "sim-12g", "load_time_s=2", "fail_at_start=true", "x=a=b"],
     Request("POST", "/deployments/d2/reconfigure", body={"engine_args": {
         "load_time_s": 2, "fail_at_start": True, "x": "a=b"}})),
])
def test_deployment_changes_look_the_target_up_by_id_or_model_then_send(
    argv: list[str], expected: Request,
) -> None:
    lookup = OPERATOR_COMMANDS[argv[0]].request(parse(*argv))
    assert (lookup.method, lookup.path) == ("GET", "/deployments") and lookup.then
    assert lookup.then(DEPLOYMENTS) == expected
    with pytest.raises(UsageError) as info:
        lookup.then([])
    assert str(info.value) == (f"{argv[0]} {argv[1]!r}: no deployment has that id or model "
                               "id (deployed models: none)")


@pytest.mark.parametrize(("argv", "expected"), [
    (["cordon", "small"], Request("PATCH", "/nodes/n1", body={"cordoned": True})),
    (["cordon", "n2", "--reason", "disk swap"],
     Request("PATCH", "/nodes/n2", body={"cordoned": True, "cordon_reason": "disk swap"})),
    (["uncordon", "small"], Request("PATCH", "/nodes/n1", body={"cordoned": False})),
    (["drain", "bare"], Request("POST", "/nodes/n2/drain",
                                body={"uncordon_on_cancel": False})),
    (["drain", "n1", "--grace", "30", "--uncordon-on-cancel"],
     Request("POST", "/nodes/n1/drain", body={"uncordon_on_cancel": True, "grace_s": 30.0})),
])
def test_node_changes_look_the_node_up_by_id_or_name_then_send(
    argv: list[str], expected: Request,
) -> None:
    lookup = OPERATOR_COMMANDS[argv[0]].request(parse(*argv))
    assert (lookup.method, lookup.path) == ("GET", "/nodes") and lookup.then
    assert lookup.then(NODES) == expected
    with pytest.raises(UsageError) as info:
        lookup.then([])
    assert str(info.value) == f"{argv[0]} {argv[1]!r}: no node has that id or name (nodes: none)"


def test_models_rm_deletes_and_reports_what_it_removed() -> None:
    request = OPERATOR_COMMANDS["models"].request(parse("models", "rm", "m"))
    assert (request.method, request.path) == ("DELETE", "/models/m")
    assert request.then is not None and request.then(None) == {"model_id": "m",
                                                               "deleted": True}


# --- Renderers ---------------------------------------------------------------------------


def text(argv: list[str], result: Any) -> str:
    return render(parse(*argv), result)


def test_ls_table_shows_reason_and_a_serving_deployments_failure_as_history() -> None:
    assert text(["ls"], DEPLOYMENTS).splitlines() == [
        "ID  MODEL    STATUS      READY  POLICY  FAILURES  REASON",
        "d1  big      cant_place  0/1    -       0         node small: 8.0 GiB free, needs "
        "64.0 GiB",
        "d2  sim-12g  serving     2/2    -       1         (last failure: exit 137 (oom))",
    ]
    assert text(["ls"], []) == "ID  MODEL  STATUS  READY  POLICY  FAILURES  REASON"


def test_ls_shows_degraded_with_its_reason_and_stopped_through_the_api() -> None:
    deployments = [
        {"deployment_id": "d3", "model_id": "limp", "status": "degraded", "ready_replicas": 1,
         "desired_replicas": 2, "consecutive_failures": 0, "placement_error": None,
         "last_failure": "d-r1 unreachable: no heartbeat from a", "workflow_id": "w3"},
        {"deployment_id": "d4", "model_id": "full", "status": "degraded", "ready_replicas": 0,
         "desired_replicas": 1, "consecutive_failures": 0,
         "placement_error": "node b: 2.0 GiB free, needs 8.0 GiB",
         "last_failure": "d4-r1 unreachable: no heartbeat from a", "workflow_id": "w4"},
        {"deployment_id": "d5", "model_id": "idle", "status": "stopped", "ready_replicas": 0,
         "desired_replicas": 0, "consecutive_failures": 0, "placement_error": None,
         "last_failure": None, "workflow_id": "w5"},
        {"deployment_id": "d6", "model_id": "rested", "status": "stopped", "ready_replicas": 0,
         "desired_replicas": 0, "consecutive_failures": 1, "placement_error": None,
         "last_failure": "exit 137 (oom)", "workflow_id": "w6"},
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("GET", "/deployments")
        return httpx.Response(200, json=deployments)

    [shown] = run(["ls"], handler)
    assert shown.splitlines() == [
        "ID  MODEL   STATUS    READY  POLICY  FAILURES  REASON",
        "d3  limp    degraded  1/2    -       0         d-r1 unreachable: no heartbeat from a",
        "d4  full    degraded  0/1    -       0         d4-r1 unreachable: no heartbeat from a; "
        "its replacement cannot be placed: node b: 2.0 GiB free, needs 8.0 GiB",
        "d5  idle    stopped   0/0    -       0",
        # Scaled to zero by an operator: an earlier failure is history, not the reason.
        "d6  rested  stopped   0/0    -       1         (last failure: exit 137 (oom))",
    ]
    assert json.loads(run(["ls", "--json"], handler)[0]) == deployments


def test_nodes_table_shows_memory_in_gib_and_dashes_for_unknowns() -> None:
    assert text(["nodes"], NODES).splitlines() == [
        "NAME   ID  STATE  MEMORY   CLAIMED  FREE     AVAIL     CPUS  LEVEL  HELD FOR  "
        "ENGINES  LABELS           LAST SEEN",
        "small  n1  ready  8.0 GiB  0.0 GiB  8.0 GiB  12.0 GiB  4     ok     -         "
        "?        gpu=none,zone=a  2024-01-01T00:00:00Z",
        "bare   n2  lost   -        -        -        -         -     ok     -         "
        "?                         2024-01-01T00:00:01Z",
    ]


def test_nodes_table_shows_each_engine_with_its_version() -> None:
    running = {**NODES[0], "engines": {"vllm": "0.6.3", "sim": "0.2.0"}}
    none = {**NODES[0], "engines": {}}
    lines = text(["nodes"], [running, none]).splitlines()
    assert "  sim 0.2.0,vllm 0.6.3  " in lines[1]
    assert lines[2].split()[13:15] == ["-", "-"]  # not held, no engine


def test_nodes_table_shows_the_memory_level_and_the_hold() -> None:
    held = {**NODES[0], "memory_level": "critical", "hold_class": "critical",
            "hold_owner": "acme/ml"}
    line = text(["nodes"], [held]).splitlines()[1]
    assert "critical  class critical, owner acme/ml  ?        gpu=none" in line


def test_nodes_flags_a_node_whose_real_free_memory_is_below_what_it_promises() -> None:
    # Declared 32 GiB, 10.7 claimed: placement counts 21.3 GiB free, and the machine has
    # 10 GiB available (the case the issue measured).
    promising = {**NODES[0], "memory_total_bytes": 32 * GiB,
                 "memory_claimed_bytes": 32 * GiB - int(21.3 * GiB),
                 "memory_free_bytes": int(21.3 * GiB), "memory_available_bytes": 10 * GiB}
    lines = text(["nodes"], [promising, NODES[1]]).splitlines()
    assert lines[0].split()[5:7] == ["FREE", "AVAIL"]
    assert lines[1].split()[7:10] == ["21.3", "GiB", "10.0"]
    assert "10.0 GiB!" in lines[1] and "!" not in lines[2]
    assert lines[-1].startswith("! promises more than it has: AVAIL")
    # A node with more available than free is not flagged, nor is the legend shown.
    assert "promises" not in text(["nodes"], NODES)


def test_explain_heads_the_per_node_table_with_the_verdict() -> None:
    assert text(["explain", "big"], EXPLAIN_NO).splitlines() == [
        "big: cannot be placed: no node has 64.0 GiB free",
        "NODE   FITS  WHY",
        "small  no    8.0 GiB free, needs 64.0 GiB",
    ]
    # The chosen node by its name, as the table shows it, not by its id.
    assert text(["explain", "tiny"], EXPLAIN_YES).splitlines()[0] == "tiny: fits on small"


def test_models_render_per_action() -> None:
    assert text(["models"], MODELS).splitlines() == [
        "MODEL    ENGINE  SOURCE      MEMORY         MIN NODES",
        "sim-12g  sim     sim         12.0 GiB       1",
        "qwen     vllm    Qwen/Qwen2  - (estimated)  2",
    ]
    assert text(["models", "rm", "m"], {"model_id": "m", "deleted": True}) == \
        "model m removed"
    added = {**MODELS[0], "model_id": "m"}
    assert text(["models", "add", "m", "--engine", "sim", "--source", "sim"], added) == \
        "model m added (12.0 GiB)"


def test_deploy_and_rm_render_one_line() -> None:
    assert text(["deploy", "big"], DEPLOYMENTS[0]) == \
        "deployment d1 of big: cant_place (workflow deployment/d1)"
    assert text(["rm", "d1"], {"deployment_id": "d1", "status": "deleting"}) == \
        "deployment d1: deleting"


OPERATION: dict[str, Any] = {
    "operation_id": "restart/d2/1", "kind": "restart", "deployment_id": "d2",
    "node_id": None, "state": "failed",
    "summary": "restart d2 (sim-12g): replace its 2 replicas one at a time",
    "steps": [{"name": "replace d2-r1", "state": "done", "detail": "d2-r3 ready"},
              {"name": "replace d2-r2", "state": "failed", "detail": "no room"}],
    "error": "d2-r2: no node has room for a second copy", "requested_by": "api",
    "created_at": "2024-01-01T00:00:00Z", "updated_at": "2024-01-01T00:01:00Z"}


def test_operations_render_as_a_list_one_with_its_steps_and_a_cancel() -> None:
    running = {**OPERATION, "operation_id": "drain/n1/1", "kind": "drain",
               "deployment_id": None, "node_id": "n1", "state": "running", "error": None,
               "summary": "drain node small (n1)", "steps": []}
    assert text(["operations"], [running, OPERATION]).splitlines() == [
        "ID            STATE    UPDATED               SUMMARY"
        "                                                     ERROR",
        "drain/n1/1    running  2024-01-01T00:01:00Z  drain node small (n1)",
        "restart/d2/1  failed   2024-01-01T00:01:00Z  restart d2 (sim-12g): replace its 2 "
        "replicas one at a time  d2-r2: no node has room for a second copy",
    ]
    assert text(["operations", "show", "restart/d2/1"], OPERATION).splitlines() == [
        "restart/d2/1: failed (restart of d2, requested by api, updated "
        "2024-01-01T00:01:00Z)",
        "restart d2 (sim-12g): replace its 2 replicas one at a time",
        "error: d2-r2: no node has room for a second copy",
        "STEP           STATE   DETAIL",
        "replace d2-r1  done    d2-r3 ready",
        "replace d2-r2  failed  no room",
    ]
    assert text(["operations", "cancel", "drain/n1/1"], running) == (
        "drain/n1/1: cancel requested; the saga undoes what it started and ends cancelled "
        "(watch: modelkeeper operations show drain/n1/1)")


def test_changes_render_one_sentence_each() -> None:
    started = {**OPERATION, "state": "running", "error": None, "steps": []}
    for argv in (["restart", "d2"], ["switch", "d2", "big"], ["reconfigure", "d2", "a=1"],
                 ["drain", "n1"]):
        assert text(argv, started).splitlines() == [
            "restart/d2/1 started: restart d2 (sim-12g): replace its 2 replicas one at a time",
            "watch: modelkeeper operations show restart/d2/1; "
            "cancel: modelkeeper operations cancel restart/d2/1"]
    assert text(["scale", "d2", "2"], DEPLOYMENTS[1]) == \
        "deployment d2 of sim-12g: 2 wanted, 2 ready (serving)"
    assert text(["retry", "d1"], {"deployment_id": "d1", "status": "parked"}) == \
        "deployment d1: retry requested (it was parked)"
    node = {"name": "small", "node_id": "n1", "cordoned": True, "cordon_reason": "disk swap"}
    assert text(["cordon", "n1"], node) == "node small (n1): cordoned: disk swap"
    assert text(["cordon", "n1"], {**node, "cordon_reason": None}) == \
        "node small (n1): cordoned"
    assert text(["uncordon", "n1"], {**node, "cordoned": False, "cordon_reason": None}) == \
        "node small (n1): uncordoned"


def test_json_prints_the_answer_as_it_is_for_every_command() -> None:
    for command in COMMANDS:
        args = parse(command.name, *POSITIONALS.get(command.name, []), "--json")
        assert json.loads(render(args, DEPLOYMENTS)) == DEPLOYMENTS


# --- Through the HTTP client -------------------------------------------------------------

Handler = Callable[[httpx.Request], httpx.Response]


def run(argv: list[str], handler: Handler) -> list[str]:
    lines: list[str] = []
    assert run_operator_command(parse(*argv), API, lines.append,
                                transport=httpx.MockTransport(handler)) == 0
    return lines


def test_requests_reach_the_api_as_built() -> None:
    seen: list[tuple[str, str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, str(request.url),
                     json.loads(request.content) if request.content else None))
        if request.method == "GET" and request.url.path == "/deployments":
            return httpx.Response(200, json=DEPLOYMENTS)
        if request.method == "DELETE" and request.url.path == "/models/m":
            return httpx.Response(204)
        return httpx.Response(202, json={"deployment_id": "d2", "status": "deleting"})

    assert run(["rm", "sim-12g"], handler) == ["deployment d2: deleting"]
    assert seen == [("GET", f"{API}/deployments", None),
                    ("DELETE", f"{API}/deployments/d2", None)]
    seen.clear()
    assert json.loads(run(["models", "rm", "m", "--json"], handler)[0]) == \
        {"model_id": "m", "deleted": True}
    seen.clear()
    run(["explain", "big model", "--json", "--api-url", "http://other.test"], handler)
    assert seen[0][1] == "http://other.test/placement/explain?model_id=big+model"


@pytest.mark.parametrize(("status", "detail", "words"), [
    (404, "model 'x' is not in the catalog", ["404", "'x'"]),
    (409, "model 'm' already has a deployment", ["409", "'m'"]),
    (422, [{"loc": ["body", "replicas"], "msg": "Input should be greater than or equal to 1",
            "input": 0}], ["422", "replicas", "greater than or equal to 1", "(got 0)"]),
])
def test_a_4xx_is_a_usage_error_with_the_apis_sentence(
    status: int, detail: Any, words: list[str],
) -> None:
    with pytest.raises(UsageError) as info:
        run(["deploy", "m"], lambda _: httpx.Response(status, json={"detail": detail}))
    assert all(w in str(info.value) for w in words), str(info.value)
    assert info.value.exit_code == 2


def test_a_5xx_or_no_answer_is_an_api_error() -> None:
    with pytest.raises(ApiError) as info:
        run(["ls"], lambda _: httpx.Response(503, json={"detail": "temporal is down"}))
    assert str(info.value) == "503 temporal is down" and info.value.exit_code == 1

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(ApiError, match=f"cannot reach the API at {API}"):
        run(["ls"], refuse)
    with pytest.raises(ApiError, match="non-JSON"):
        run(["ls"], lambda _: httpx.Response(200, text="<html>"))


# --- User mistakes: exit 2, one sentence, never a traceback ------------------------------


def test_parse_pairs_names_the_flag_and_the_item() -> None:
    assert parse_pairs(["a=1", "b=", "c=x=y"], flag="--label") == {"a": "1", "b": "",
                                                                   "c": "x=y"}
    for bad in ("novalue", "=v"):
        with pytest.raises(UsageError) as info:
            parse_pairs(["ok=1", bad], flag="--label")
        assert str(info.value) == f"--label {bad!r} is not KEY=VALUE with a non-empty KEY"


def exit_of(argv: list[str], capsys: pytest.CaptureFixture[str],
            handler: Handler | None = None,
            monkeypatch: pytest.MonkeyPatch | None = None) -> tuple[int, list[str]]:
    if handler is not None and monkeypatch is not None:
        monkeypatch.setattr(cli, "run_operator_command", partial(
            run_operator_command, transport=httpx.MockTransport(handler)))
    code = cli.run(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip().splitlines()


def unreachable(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"a malformed command reached the API: {request.url}")


@pytest.mark.parametrize(("argv", "words"), [
    (["deploy", "m", "--require-label", "gpu"], ["--require-label", "'gpu'", "KEY=VALUE"]),
    (["models", "add", "m", "--engine", "sim", "--source", "s", "--engine-arg", "=1"],
     ["--engine-arg", "'=1'", "KEY=VALUE"]),
    (["models", "add", "m", "--engine", "sim", "--source", "s", "--memory", "12XB"],
     ["--memory", "'12XB'", "expected"]),
    (["models", "add", "m", "--source", "s"], ["--engine", "required", "'m'", "vllm, sglang"]),
    (["models", "add", "m", "--engine", "sim"], ["--source", "required", "'m'", ".gguf"]),
    (["models", "rm"], ["models rm", "MODEL_ID"]),
    (["reconfigure", "d1", "ctx_size=4096", "=1"], ["engine argument", "'=1'", "KEY=VALUE"]),
    (["operations", "show"], ["operations show", "operation id", "restart/d1/1"]),
    (["operations", "cancel"], ["operations cancel", "operation id"]),
    (["agent", "--label", "zone"], ["--label", "'zone'", "KEY=VALUE"]),
])
def test_a_malformed_argument_exits_2_with_one_sentence_before_any_request(
    argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, lines = exit_of(argv, capsys, unreachable, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"modelkeeper {argv[0]}: ")
    assert all(w in lines[0] for w in words), lines[0]


def test_a_4xx_exits_2_and_a_failing_api_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, lines = exit_of(["rm", "ghost"], capsys, lambda _: httpx.Response(200, json=[]),
                          monkeypatch)
    assert code == 2 and lines == ["modelkeeper rm: rm 'ghost': no deployment has that id "
                                   "or model id (deployed models: none)"]
    code, lines = exit_of(["deploy", "m"], capsys, lambda _: httpx.Response(
        409, json={"detail": "model 'm' already has a deployment"}), monkeypatch)
    assert (code, lines) == (2, ["modelkeeper deploy: 409 model 'm' already has a deployment"])
    code, lines = exit_of(["ls"], capsys, lambda _: httpx.Response(500, text="boom"),
                          monkeypatch)
    assert (code, lines) == (1, ["modelkeeper ls: 500 boom"])


def test_a_saga_refused_by_the_api_exits_2_with_its_sentence(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    running = ("restart/d2/1 (restart) is running on d2; wait for it or cancel it: "
               "modelkeeper operations cancel restart/d2/1")
    seen: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        if request.url.path == "/deployments":
            return httpx.Response(200, json=DEPLOYMENTS)
        return httpx.Response(409, json={"detail": running})

    code, lines = exit_of(["switch", "sim-12g", "big"], capsys, handler, monkeypatch)
    assert (code, lines) == (2, [f"modelkeeper switch: 409 {running}"])
    assert seen == [("GET", "/deployments"), ("POST", "/deployments/d2/switch")]
    code, lines = exit_of(["operations", "cancel", "restart/d2/9"], capsys,
                          lambda _: httpx.Response(404, json={
                              "detail": "operation 'restart/d2/9' does not exist"}),
                          monkeypatch)
    assert (code, lines) == (2, ["modelkeeper operations: 404 operation 'restart/d2/9' does not "
                                 "exist"])


def test_a_started_saga_reaches_the_api_and_prints_how_to_watch_it() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/nodes":
            return httpx.Response(200, json=NODES)
        assert (request.method, request.url.path) == ("POST", "/nodes/n1/drain")
        assert json.loads(request.content) == {"uncordon_on_cancel": False, "grace_s": 60.0}
        return httpx.Response(202, json={**OPERATION, "operation_id": "drain/n1/1",
                                         "summary": "drain node small (n1)"})

    assert run(["drain", "small", "--grace", "60"], handler) == [
        "drain/n1/1 started: drain node small (n1)\n"
        "watch: modelkeeper operations show drain/n1/1; "
        "cancel: modelkeeper operations cancel drain/n1/1"]


def test_a_bad_flag_type_is_argparses_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.run(["deploy", "m", "--replicas", "two"])
    assert info.value.code == 2
    assert "--replicas: invalid int value: 'two'" in capsys.readouterr().err


def test_ls_names_the_model_behind_a_switched_name_outdated_replicas_and_shared_nodes() -> None:
    deployments = [
        {"deployment_id": "d7", "model_id": "chat", "status": "serving", "ready_replicas": 2,
         "desired_replicas": 2, "consecutive_failures": 0, "placement_error": None,
         "last_failure": None, "workflow_id": "w7", "runs_model_id": "chat-v2",
         "placement_note": "d7-r4 shares node n1 with another replica of d7: no other "
                           "node has room",
         "replicas": [{"replica_id": "d7-r3", "outdated": True},
                      {"replica_id": "d7-r4", "outdated": False}]},
    ]
    assert text(["ls"], deployments).splitlines()[1] == (
        "d7  chat   serving  2/2    -       0         runs chat-v2; outdated: d7-r3; d7-r4 "
        "shares node n1 with another replica of d7: no other node has room")


def test_ls_shows_a_multi_node_replicas_progress_while_it_loads() -> None:
    deployments = [
        {"deployment_id": "d8", "model_id": "big", "status": "starting", "ready_replicas": 0,
         "desired_replicas": 1, "consecutive_failures": 0, "placement_error": None,
         "last_failure": None, "workflow_id": "w8",
         "replicas": [{"replica_id": "d8-r1", "nodes": ["a", "b", "c", "d"],
                       "shards_ready": 2}]},
    ]
    assert text(["ls"], deployments).splitlines()[1].endswith(
        "d8-r1 loading, 2/4 shards ready")
