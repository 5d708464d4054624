"""`modelkeeper quota`, `owner`, `deploy --owner --class` and `tokens create --scope`:
the requests built from the arguments alone, the renderings, and each user mistake as one
sentence naming the flag, the value and the limit (exit 2, never a traceback)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from cli import main as cli
from cli.main import build_parser
from cli.operator_cli import OPERATOR_COMMANDS, Request, UsageError, render, run_tokens_command

pytestmark = pytest.mark.timeout(10)

GiB = 1 << 30

DEPLOYMENTS: list[dict[str, Any]] = [{"deployment_id": "d1", "model_id": "big"}]


def parse(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


def request(*argv: str) -> Request:
    return OPERATOR_COMMANDS[argv[0]].request(parse(*argv))


@pytest.mark.parametrize(("argv", "expected"), [
    (["quota"], Request("GET", "/quotas")),
    (["quota", "ls"], Request("GET", "/quotas")),
    (["quota", "set", "acme/a", "--guarantee-memory", "16GiB", "--limit-memory", "24GiB",
      "--guarantee-gpus", "1", "--limit-gpus", "2", "--guarantee-cores", "0.5",
      "--limit-cores", "8"],
     Request("PUT", "/quotas/acme/a", body={
         "guarantee": {"memory_bytes": 16 * GiB, "gpus": 1, "cpu_cores": 0.5},
         "limit": {"memory_bytes": 24 * GiB, "gpus": 2, "cpu_cores": 8.0}})),
    (["quota", "set", "acme", "--limit-gpus", "0"],
     Request("PUT", "/quotas/acme", body={"guarantee": {}, "limit": {"gpus": 0}})),
    (["deploy", "m", "--owner", "acme/a/p", "--class", "critical"],
     Request("POST", "/deployments", body={
         "model_id": "m", "replicas": 1, "min_nodes": 1, "node_ids": None, "labels": {},
         "owner": "acme/a/p", "capacity_class": "critical"})),
])
def test_requests(argv: list[str], expected: Request) -> None:
    assert request(*argv) == expected


def test_quota_rm_and_owner_send_after_their_lookup() -> None:
    rm = request("quota", "rm", "acme/a")
    assert (rm.method, rm.path) == ("DELETE", "/quotas/acme/a") and rm.then is not None
    assert rm.then(None) == {"scope": "acme/a", "removed": True}
    owner = request("owner", "big", "acme/b")
    assert (owner.method, owner.path) == ("GET", "/deployments") and owner.then
    assert owner.then(DEPLOYMENTS) == Request("PATCH", "/deployments/d1",
                                              body={"owner": "acme/b"})


@pytest.mark.parametrize(("argv", "message"), [
    (["quota", "set", "Acme"], "SCOPE 'Acme': a scope is org, org/team or org/team/project"),
    (["quota", "set", "a/b/c/d"], "at most 3 parts"),
    (["quota", "set", "acme"], "quota set acme: give at least one of --guarantee-memory"),
    (["quota", "rm"], "quota rm needs a SCOPE, and none was given"),
    (["quota", "set", "acme", "--limit-memory", "lots"],
     "--limit-memory: invalid byte quantity 'lots'"),
    (["quota", "set", "acme", "--limit-gpus", "1.5"], "--limit-gpus '1.5': must be a whole"),
    (["quota", "set", "acme", "--guarantee-cores", "-1"],
     "--guarantee-cores -1: must be at least 0 and at most 1,000,000"),
    (["quota", "set", "acme", "--limit-cores", "nan"], "--limit-cores nan: must be at least 0"),
    (["quota", "set", "acme", "--limit-memory", "2EiB"], "--limit-memory: invalid byte"),
    (["quota", "set", "acme", "--limit-memory", str(5 << 50)], "at most 4194304.0 GiB"),
    (["deploy", "m", "--owner", "Team A"], "--owner 'Team A': a scope is org"),
    (["owner", "big", "acme//a"], "SCOPE 'acme//a': a scope is org"),
])
def test_mistakes_are_one_sentence(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as info:
        request(*argv)
    assert message in str(info.value)


def test_a_limit_past_the_largest_is_refused_naming_it() -> None:
    with pytest.raises(UsageError) as info:
        request("quota", "set", "acme", "--limit-memory", str(2**61))
    assert str(info.value) == (f"--limit-memory {2**61}: must be at least 0 and at most "
                               "4194304.0 GiB")


def test_a_class_outside_the_three_is_argparses_exit_2() -> None:
    with pytest.raises(SystemExit) as info:
        parse("deploy", "m", "--class", "urgent")
    assert info.value.code == 2


def test_quota_ls_renders_a_table() -> None:
    views = [{"scope": "acme/a", "guarantee": {"memory_bytes": 16 * GiB, "gpus": 0,
                                               "cpu_cores": 0.0},
              "limit": {"memory_bytes": 24 * GiB, "gpus": None, "cpu_cores": None},
              "held": {"memory_bytes": 24 * GiB, "gpus": 1, "cpu_cores": 2.0},
              "borrowed": {"memory_bytes": 8 * GiB, "gpus": 1, "cpu_cores": 2.0},
              "at_limit": ["memory"]},
             {"scope": "acme/b", "guarantee": {"memory_bytes": 0, "gpus": 0, "cpu_cores": 0},
              "limit": {"memory_bytes": None, "gpus": None, "cpu_cores": None},
              "held": {"memory_bytes": 0, "gpus": 0, "cpu_cores": 0},
              "borrowed": {"memory_bytes": 0, "gpus": 0, "cpu_cores": 0}, "at_limit": []}]
    shown = render(parse("quota", "ls"), views)
    lines = shown.splitlines()
    assert lines[0].split() == ["SCOPE", "GUARANTEE", "LIMIT", "HELD", "BORROWED", "AT",
                                "LIMIT"]
    assert lines[1].split() == ["acme/a", "16.0", "GiB", "24.0", "GiB", "24.0", "GiB,", "1",
                                "GPU,", "2", "cores", "8.0", "GiB,", "1", "GPU,", "2",
                                "cores", "memory"]
    assert lines[2].split() == ["acme/b", "-", "unlimited", "-", "-", "-"]
    assert render(parse("quota", "rm", "acme/a"), {"scope": "acme/a", "removed": True}) \
        == "quota of acme/a removed"


def test_a_refusal_with_numbers_exits_2_with_its_sentence(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    sentence = ("scope 'acme/a' would pass its memory limit: it holds 16.0 GiB, this asks "
                "16.0 GiB more, and its limit is 24.0 GiB")

    def answer(req: httpx.Request) -> httpx.Response:
        return httpx.Response(409, json={"detail": sentence, "quota": {
            "scope": "acme/a", "part": "memory", "held": 16 * GiB, "asked": 16 * GiB,
            "limit": 24 * GiB}})

    transport = httpx.MockTransport(answer)
    real = httpx.Client

    def client(**kwargs: Any) -> httpx.Client:
        return real(**{**kwargs, "transport": transport})

    monkeypatch.setattr(httpx, "Client", client)
    monkeypatch.setenv("MODELKEEPER_TOKEN", "mko-test")
    code = cli.run(["deploy", "m", "--owner", "acme/a", "--api-url", "http://api.test"])
    assert code == 2
    assert sentence in capsys.readouterr().err


def test_tokens_create_refuses_a_bad_scope_before_any_connection() -> None:
    args = parse("tokens", "create", "team-a", "--role", "admin", "--scope", "Acme")
    with pytest.raises(UsageError) as info:
        run_tokens_command("postgresql://unused:1/none", args, out=print)
    assert "--scope 'Acme'" in str(info.value)
