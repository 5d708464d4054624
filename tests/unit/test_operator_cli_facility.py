"""`modelkeeper hold`, `unhold` and `power-cap` (docs/capacity.md, "Facility-aware
placement"): the requests built from the arguments alone, the renderings, and each user
mistake as one sentence (exit 2, never a traceback). No server."""

from __future__ import annotations

from typing import Any

import pytest

from cli.main import build_parser
from cli.operator_cli import OPERATOR_COMMANDS, Request, UsageError, render

pytestmark = pytest.mark.timeout(10)

NODES: list[dict[str, Any]] = [{"node_id": "n-1", "name": "gpu-a"}]
HELD: dict[str, Any] = {"node_id": "n-1", "name": "gpu-a", "hold_class": "critical",
                        "hold_owner": "acme/ml"}


def parse(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


def request(*argv: str) -> Request:
    return OPERATOR_COMMANDS[argv[0]].request(parse(*argv))


def test_hold_and_unhold_patch_the_node_found_by_name() -> None:
    hold = request("hold", "gpu-a", "--class", "critical", "--owner", "acme/ml")
    assert (hold.method, hold.path) == ("GET", "/nodes") and hold.then is not None
    assert hold.then(NODES) == Request("PATCH", "/nodes/n-1", body={
        "hold_class": "critical", "hold_owner": "acme/ml"})
    owner_only = request("hold", "n-1", "--owner", "acme")
    assert owner_only.then is not None
    assert owner_only.then(NODES) == Request("PATCH", "/nodes/n-1",
                                             body={"hold_owner": "acme"})
    unhold = request("unhold", "gpu-a")
    assert unhold.then is not None
    assert unhold.then(NODES) == Request("PATCH", "/nodes/n-1", body={"release_hold": True})


@pytest.mark.parametrize(("argv", "expected"), [
    (["power-cap"], Request("GET", "/power-caps")),
    (["power-cap", "ls"], Request("GET", "/power-caps")),
    (["power-cap", "set", "pdu-3", "7200"],
     Request("PUT", "/power-caps/pdu-3", body={"watts": 7200})),
    (["power-cap", "set", "_facility", "50000"],
     Request("PUT", "/power-caps/_facility", body={"watts": 50000})),
    (["power-cap", "rm", "pdu-3"], Request("DELETE", "/power-caps/pdu-3")),
])
def test_power_cap_requests(argv: list[str], expected: Request) -> None:
    assert request(*argv) == expected


@pytest.mark.parametrize(("argv", "message"), [
    (["hold", "gpu-a"], "hold gpu-a: give --class, --owner or both"),
    (["hold", "gpu-a", "--owner", "Acme ML"], "--owner 'Acme ML': a scope is org"),
    (["power-cap", "set"], "power-cap set needs a PDU"),
    (["power-cap", "rm"], "power-cap rm needs a PDU"),
    (["power-cap", "set", "pdu-3"], "power-cap set pdu-3: WATTS is missing"),
])
def test_mistakes_are_one_sentence(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as info:
        request(*argv)
    assert message in str(info.value)


@pytest.mark.parametrize("argv", [["hold", "gpu-a", "--class", "urgent"],
                                  ["power-cap", "set", "pdu-3", "lots"]])
def test_a_value_argparse_cannot_read_is_its_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2


def test_renderings() -> None:
    assert render(parse("hold", "gpu-a", "--class", "critical"), HELD) == (
        "node gpu-a (n-1): held for class critical, owner acme/ml")
    released = {**HELD, "hold_class": None, "hold_owner": None}
    assert render(parse("unhold", "gpu-a"), released) == "node gpu-a (n-1): not held"
    caps = render(parse("power-cap"), {"_facility": 50000, "pdu-3": 7200}).splitlines()
    assert caps[0].split() == ["PDU", "CAP"]
    assert caps[1].split() == ["facility", "50,000", "W"]
    assert caps[2].split() == ["pdu-3", "7,200", "W"]
    assert render(parse("power-cap"), {}) == "no power cap in force"
