"""The operator CLI's part of issue 24 (sections 6 and 8): ``models edit`` (with
``--apply``), and the newcomer's frictions it fixes. No server: httpx.MockTransport
answers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from cli.main import build_parser
from cli.operator_cli import UsageError, render, run_operator_command

pytestmark = pytest.mark.timeout(10)

GiB = 1 << 30
API = "http://api.test"
Handler = Callable[[httpx.Request], httpx.Response]


def parse(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


def run(argv: list[str], handler: Handler) -> tuple[list[str], list[str]]:
    """The lines printed, and each request sent as ``METHOD path body``."""
    lines: list[str] = []
    sent: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        body = request.content.decode() if request.content else ""
        sent.append(f"{request.method} {request.url.path}"
                    + (f"?{request.url.query.decode()}" if request.url.query else "")
                    + (f" {body}" if body else ""))
        return handler(request)

    assert run_operator_command(parse(*argv), API, lines.append,
                                transport=httpx.MockTransport(record)) == 0
    return lines, sent


# --- models edit -----------------------------------------------------------------------

MODEL = {"model_id": "m", "engine": "sim", "source": "sim", "memory_bytes": GiB,
         "engine_args": {"load_time_s": 1, "tokens_per_second": 5}}


def _changed(deployments: list[str]) -> dict[str, Any]:
    return {"model": {**MODEL, "memory_bytes": 2 * GiB},
            "changes": ["memory 1.0 GiB -> 2.0 GiB"], "deployments": deployments,
            "deployment_count": len(deployments)}


def _api(deployments: list[str]) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json=MODEL)
        if request.method == "PATCH":
            return httpx.Response(200, json=_changed(deployments))
        deployment = request.url.path.split("/")[2]
        return httpx.Response(202, json={"operation_id": f"restart/{deployment}/1",
                                         "summary": f"restart {deployment} (m)"})
    return handler


def test_edit_sends_only_what_changes_and_says_what_runs_the_old_spec() -> None:
    lines, sent = run(["models", "edit", "m", "--memory", "2GiB"], _api(["d1"]))
    assert sent == [f'PATCH /models/m {{"memory_bytes":{2 * GiB}}}']
    assert lines == ["model m changed: memory 1.0 GiB -> 2.0 GiB\n"
                     "deployments serving it: d1; their replicas run the old spec (outdated "
                     "in ls) until restarted: modelkeeper restart DEPLOYMENT, or models edit "
                     "m ... --apply"]


def test_edit_lays_engine_arguments_over_the_models_and_unsets_those_named() -> None:
    _, sent = run(["models", "edit", "m", "--engine-arg", "tokens_per_second=50",
                   "--unset-engine-arg", "load_time_s"], _api([]))
    assert sent == ["GET /models/m",
                    'PATCH /models/m {"engine_args":{"tokens_per_second":50}}']


def test_edit_apply_restarts_each_deployment_and_prints_the_operations() -> None:
    lines, sent = run(["models", "edit", "m", "--source", "sim2", "--apply"],
                      _api(["d1", "d2"]))
    assert sent == ['PATCH /models/m {"source":"sim2"}', "POST /deployments/d1/restart",
                    "POST /deployments/d2/restart"]
    [shown] = lines
    assert shown.splitlines()[:3] == [
        "model m changed: memory 1.0 GiB -> 2.0 GiB",
        "rolling it out: a restart of each deployment serving it",
        "restart/d1/1 started: restart d1 (m)"]
    assert "restart/d2/1 started: restart d2 (m)" in shown.splitlines()


def test_edit_with_nothing_to_change_or_a_part_that_cannot_change_is_a_usage_error() -> None:
    command = parse("models", "edit", "m")
    with pytest.raises(UsageError, match="give what changes"):
        run_operator_command(command, API, print, transport=httpx.MockTransport(_api([])))
    with pytest.raises(UsageError, match="--engine cannot change"):
        run_operator_command(parse("models", "edit", "m", "--engine", "vllm"), API, print,
                             transport=httpx.MockTransport(_api([])))
    with pytest.raises(UsageError, match="--unset-engine-arg nope: model 'm' has no such"):
        run_operator_command(parse("models", "edit", "m", "--unset-engine-arg", "nope"), API,
                             print, transport=httpx.MockTransport(_api([])))
    with pytest.raises(UsageError, match="--apply goes with models edit"):
        run_operator_command(parse("models", "add", "m", "--apply"), API, print,
                             transport=httpx.MockTransport(_api([])))


def test_edit_that_changed_nothing_says_so() -> None:
    unchanged = {**_changed(["d1"]), "changes": []}
    assert render(parse("models", "edit", "m", "--memory", "1GiB"), unchanged) == (
        "model m: nothing changed (it already has these values)")
    assert json.loads(render(parse("models", "edit", "m", "--memory", "1GiB", "--json"),
                             unchanged)) == unchanged


# --- explain --deployment --------------------------------------------------------------

DEPLOYMENTS = [{"deployment_id": "d-1", "model_id": "chat"}]
EXPLAINED = {"model_id": "chat", "deployment_id": "d-1", "fits": False, "nodes_chosen": [],
             "summary": "no node has label gpu=a100",
             "nodes": [{"node_id": "n-vm", "name": "vm", "fits": False,
                        "message": "lacks label gpu=a100"}]}


def test_explain_of_a_deployment_by_name_asks_for_its_next_replica() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/deployments":
            return httpx.Response(200, json=DEPLOYMENTS)
        return httpx.Response(200, json=EXPLAINED)

    lines, sent = run(["explain", "--deployment", "chat"], handler)
    assert sent == ["GET /deployments", "GET /placement/explain?deployment_id=d-1"]
    assert lines[0].splitlines()[0] == (
        "chat (deployment d-1): cannot be placed: no node has label gpu=a100")
    with pytest.raises(UsageError, match="explain needs a MODEL or --deployment"):
        run_operator_command(parse("explain"), API, print,
                             transport=httpx.MockTransport(handler))
    with pytest.raises(UsageError, match="no deployment has that id or model id"):
        run_operator_command(parse("explain", "--deployment", "nope"), API, print,
                             transport=httpx.MockTransport(handler))
