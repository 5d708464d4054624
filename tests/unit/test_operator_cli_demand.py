"""The operator CLI's demand surfaces (docs/demand.md): `deploy --min/--max/--idle ...`,
`scale` by count or by policy, `sleep` and `wake`, durations and their bounds as one
sentence with exit 2, and `ls` showing the policy, sleeping replicas, the loading reason
and the last demand step. No server: httpx.MockTransport answers."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import pytest

from cli import main as cli
from cli.main import build_parser
from cli.operator_cli import OPERATOR_COMMANDS, Request, UsageError, render, run_operator_command
from modelkeeper.domain.demand import ScalingPolicy
from modelkeeper.domain.units import format_duration, parse_duration

pytestmark = pytest.mark.timeout(10)

POLICY = ScalingPolicy(min_replicas=0, max_replicas=2, idle_timeout_s=600,
                       sleep_after_s=120).model_dump(mode="json")
DEPLOYMENTS: list[dict[str, Any]] = [
    {"deployment_id": "d1", "model_id": "chat", "status": "idle", "ready_replicas": 0,
     "desired_replicas": 0, "consecutive_failures": 0, "placement_error": None,
     "last_failure": None, "workflow_id": "deployment/d1", "scaling": POLICY,
     "loading_since": None, "loading_reason": None,
     "demand_note": "2025-01-02 03:14:05: -1 (d1-r1): idle: unused for 10 min",
     "replicas": []},
    {"deployment_id": "d2", "model_id": "fixed", "status": "serving", "ready_replicas": 2,
     "desired_replicas": 2, "consecutive_failures": 0, "placement_error": None,
     "last_failure": None, "workflow_id": "deployment/d2", "scaling": None,
     "loading_since": None, "loading_reason": None, "demand_note": None, "replicas": []},
]


def parse(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


def request_of(*argv: str) -> Request:
    args = parse(*argv)
    return OPERATOR_COMMANDS[args.command].request(args)


def then(request: Request, answer: Any) -> Any:
    assert (request.method, request.path) == ("GET", "/deployments") and request.then
    return request.then(answer)


@pytest.mark.parametrize(("text", "seconds", "shown"), [
    ("10m", 600, "10m"), ("90s", 90, "90s"), ("1h", 3600, "1h"), ("1.5h", 5400, "90m"),
    ("2d", 172_800, "2d"), ("30", 30, "30s"), ("250ms", 0.25, "0.25s"), (" 5m ", 300, "5m"),
])
def test_durations_read_as_operators_write_them(text: str, seconds: float,
                                                shown: str) -> None:
    assert parse_duration(text) == seconds
    assert format_duration(parse_duration(text)) == shown
    assert parse_duration(format_duration(seconds)) == seconds


@pytest.mark.parametrize("bad", ["", "-5m", "10x", "10M", "m", "1e3", "ten minutes"])
def test_a_malformed_duration_names_itself_and_the_forms(bad: str) -> None:
    with pytest.raises(ValueError, match=f"invalid duration {bad!r}: expected a number of "
                                          "seconds, or a number with a unit"):
        parse_duration(bad)


@pytest.mark.parametrize(("argv", "body"), [
    (["deploy", "m", "--min", "0", "--max", "2", "--idle", "10m"],
     {"scaling": {"min_replicas": 0, "max_replicas": 2, "idle_timeout_s": 600.0}}),
    (["deploy", "m", "--min", "0", "--max", "2", "--idle", "10m", "--sleep-after", "2m",
      "--load-wait", "30s", "--standby", "1"],
     {"scaling": {"min_replicas": 0, "max_replicas": 2, "idle_timeout_s": 600.0,
                  "sleep_after_s": 120.0, "load_wait_s": 30.0, "warm_standby": 1}}),
    (["deploy", "m", "--min", "1", "--max", "4"],
     {"scaling": {"min_replicas": 1, "max_replicas": 4}}),
    (["deploy", "m", "--min", "0", "--max", "0"],  # configured, deliberately off
     {"scaling": {"min_replicas": 0, "max_replicas": 0}}),
    (["deploy", "m", "--replicas", "3"], {"replicas": 3}),
    (["deploy", "m"], {"replicas": 1}),
])
def test_deploy_sends_a_policy_or_a_count(argv: list[str], body: dict[str, Any]) -> None:
    assert request_of(*argv) == Request("POST", "/deployments", body={
        "model_id": "m", "min_nodes": 1, "node_ids": None, "labels": {}, **body})


@pytest.mark.parametrize(("argv", "sentence"), [
    (["deploy", "m", "--min", "0", "--max", "2", "--idle", "10x"],
     "--idle '10x': invalid duration '10x': expected a number of seconds, or a number with "
     "a unit: ms, s, m, h or d (e.g. 90s, 10m, 1.5h)"),
    (["deploy", "m", "--min", "0", "--max", "2", "--idle", "0s"],
     "--idle 0s: must be above 0s and at most 30d"),
    (["deploy", "m", "--min", "0", "--max", "2", "--idle", "31d"],
     "--idle 31d: must be above 0s and at most 30d"),
    (["deploy", "m", "--min", "0", "--max", "2", "--load-wait", "11m"],
     "--load-wait 11m: must be at least 0s and at most 10m"),
    (["deploy", "m", "--min", "0", "--max", "65"], "--max 65: must be at least 0 and at most 64"),
    (["deploy", "m", "--min", "-1", "--max", "2"], "--min -1: must be at least 0 and at most 64"),
    (["deploy", "m", "--max", "2", "--idle", "10m"],
     "--min must be given with --max 2 --idle 10m: a policy names its bounds (--min 0 "
     "--max 2 loads it on demand)"),
    (["deploy", "m", "--idle", "10m"], "--min and --max must be given with --idle 10m"),
    (["deploy", "m", "--replicas", "2", "--min", "0", "--max", "2"],
     "give --replicas (a fixed count) or --min/--max (a policy), not both: --replicas 2 and "
     "--min 0 --max 2 were given"),
    (["scale", "d1"], "give --replicas N (a fixed count) or policy flags (--min, --max, "
                      "--idle, --sleep-after, --load-wait, --standby)"),
    (["scale", "d1", "2", "--replicas", "3"],
     "give the count once: N 2 and --replicas 3 were given"),
    (["scale", "d1", "--replicas", "2", "--idle", "5m"],
     "give --replicas (a fixed count) or policy flags, not both: --replicas 2 and --idle 5m "
     "were given"),
    (["scale", "d1", "--sleep-after", "soon"], "--sleep-after 'soon': invalid duration"),
])
def test_a_bad_policy_flag_exits_2_with_one_sentence_before_any_request(
        argv: list[str], sentence: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"a malformed command reached the API: {request.url}")

    monkeypatch.setattr(cli, "run_operator_command", partial(
        run_operator_command, transport=httpx.MockTransport(unreachable)))
    code = cli.run(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"modelkeeper {argv[0]}: {sentence}"), err[0]


def test_scale_by_count_or_by_policy_a_flag_not_given_keeps_its_value() -> None:
    for argv in (["scale", "fixed", "3"], ["scale", "fixed", "--replicas", "3"]):
        assert then(request_of(*argv), DEPLOYMENTS) == Request(
            "PATCH", "/deployments/d2", body={"replicas": 3})
    # On a policy: only what is given changes.
    assert then(request_of("scale", "chat", "--max", "4", "--sleep-after", "off"),
                DEPLOYMENTS) == Request("PATCH", "/deployments/d1", body={"scaling": {
                    **POLICY, "max_replicas": 4, "sleep_after_s": None}})
    # On a fixed deployment: its count is the policy's bounds until given.
    assert then(request_of("scale", "fixed", "--min", "0", "--idle", "10m"),
                DEPLOYMENTS) == Request("PATCH", "/deployments/d2", body={"scaling": {
                    "min_replicas": 0, "max_replicas": 2, "idle_timeout_s": 600.0}})
    with pytest.raises(UsageError, match="scale 'ghost': no deployment has that id"):
        then(request_of("scale", "ghost", "--max", "2"), DEPLOYMENTS)


@pytest.mark.parametrize(("argv", "expected"), [
    (["sleep", "chat"], Request("POST", "/deployments/d1/sleep")),
    (["sleep", "d1", "--replica", "d1-r2"],
     Request("POST", "/deployments/d1/sleep", body={"replica_id": "d1-r2"})),
    (["wake", "chat"], Request("POST", "/deployments/d1/wake")),
    (["wake", "chat", "--replica", "d1-r2"],
     Request("POST", "/deployments/d1/wake", body={"replica_id": "d1-r2"})),
])
def test_sleep_and_wake_look_the_target_up_then_send(argv: list[str],
                                                     expected: Request) -> None:
    assert then(request_of(*argv), DEPLOYMENTS) == expected


def test_sleep_and_wake_render_one_sentence_and_a_refusal_exits_2_with_its_sentence(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    accepted = {"deployment_id": "d1", "status": "serving"}
    assert render(parse("sleep", "d1"), accepted) == (
        "deployment d1: sleep asked of each ready replica above its minimum (it was "
        "serving; modelkeeper ls shows the replicas)")
    assert render(parse("wake", "d1", "--replica", "d1-r2"), accepted) == (
        "deployment d1: wake asked of d1-r2 (it was serving; modelkeeper ls shows the "
        "replicas)")
    refusal = ("replica_id: any is not a replica of d1 whose engine can sleep (llama.cpp "
               "cannot: scale it down instead)")

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/deployments":
            return httpx.Response(200, json=DEPLOYMENTS)
        assert (request.method, request.url.path, request.content) == (
            "POST", "/deployments/d1/sleep", b"")
        return httpx.Response(409, json={"detail": refusal})

    monkeypatch.setattr(cli, "run_operator_command", partial(
        run_operator_command, transport=httpx.MockTransport(handler)))
    assert cli.run(["sleep", "chat"]) == 2
    assert capsys.readouterr().err.strip() == f"modelkeeper sleep: 409 {refusal}"


def test_ls_shows_the_policy_sleeping_replicas_the_loading_reason_and_the_last_step(
) -> None:
    loading = {**DEPLOYMENTS[0], "deployment_id": "d3", "model_id": "big",
               "status": "loading", "desired_replicas": 1, "demand_note": None,
               "loading_since": "2025-01-02T03:04:05Z",
               "loading_reason": "3 request(s) waiting"}
    asleep = {**DEPLOYMENTS[0], "deployment_id": "d4", "model_id": "nap",
              "status": "sleeping", "desired_replicas": 1, "demand_note": None,
              "scaling": {**POLICY, "warm_standby": 1, "load_wait_s": 30},
              "replicas": [{"replica_id": "d4-r1", "state": "sleeping"}]}
    shown = render(parse("ls"), [*DEPLOYMENTS, loading, asleep]).splitlines()
    assert shown == [
        "ID  MODEL  STATUS    READY          POLICY                                    "
        "FAILURES  REASON",
        "d1  chat   idle      0/0            0-2 sleep 2m idle 10m                     "
        "0         2025-01-02 03:14:05: -1 (d1-r1): idle: unused for 10 min",
        "d2  fixed  serving   2/2            -                                         0",
        "d3  big    loading   0/1            0-2 sleep 2m idle 10m                     "
        "0         3 request(s) waiting (since 2025-01-02T03:04:05Z)",
        "d4  nap    sleeping  0/1 +1 asleep  0-2 sleep 2m idle 10m wait 30s standby 1  0",
    ]
    assert json.loads(render(parse("ls", "--json"), [loading]))[0]["loading_reason"] == \
        "3 request(s) waiting"


def test_models_add_sends_what_a_sleeping_replica_keeps() -> None:
    request = request_of("models", "add", "m", "--engine", "sim", "--source", "sim",
                         "--memory", "16GiB", "--weights", "8GiB")
    assert request.body is not None
    assert (request.body["memory_bytes"], request.body["weights_bytes"]) == (16 << 30, 8 << 30)
    with pytest.raises(UsageError, match="--weights: "):
        request_of("models", "add", "m", "--engine", "sim", "--source", "sim",
                   "--weights", "lots")


def test_models_add_sends_gpus_nodes_and_the_engine_version() -> None:
    request = request_of("models", "add", "qwen", "--engine", "vllm", "--source", "org/qwen",
                         "--memory", "16GiB", "--gpus", "1", "--min-nodes", "2",
                         "--engine-version", ">=0.33")
    assert request.body is not None
    assert (request.body["gpus"], request.body["min_nodes"],
            request.body["engine_version"]) == (1, 2, ">=0.33")
    plain = request_of("models", "add", "m", "--engine", "sim", "--source", "sim")
    assert plain.body is not None
    assert not {"gpus", "min_nodes", "engine_version"} & set(plain.body)
