"""The live event stream's pure parts: an entry's SSE frame, the filters, and where a
resumed stream starts (api/event_stream.py, modelkeeper.domain.events.EventFilter)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from fastapi import HTTPException

from api.event_stream import _after, sse_frame
from modelkeeper.domain.events import Event, EventFilter
from modelkeeper.domain.ids import DeploymentId, NodeId

AT = datetime(2026, 12, 4, 18, 0, tzinfo=UTC)


def _event(kind: str = "replica.ready", *, deployment: str | None = "d1",
           node: str | None = "n1", message: str = "r1 is ready") -> Event:
    return Event(event_id=42, at=AT, kind=kind, message=message,
                 deployment_id=None if deployment is None else DeploymentId(deployment),
                 node_id=None if node is None else NodeId(node), data={"line": "a\nb"})


def test_a_frame_has_the_id_the_kind_and_the_entry_as_one_line_of_json() -> None:
    frame = sse_frame(_event(message="two\nlines"))
    assert frame.endswith("\n\n")
    lines = frame[:-2].split("\n")
    assert lines[:2] == ["id: 42", "event: replica.ready"]
    [data] = lines[2:]  # newlines inside the entry are escaped in its JSON
    parsed = json.loads(data.removeprefix("data: "))
    assert Event.model_validate(parsed) == _event(message="two\nlines")


def test_a_kind_with_a_line_break_cannot_end_the_frame_early() -> None:
    frame = sse_frame(_event(kind="bad\nkind"))
    assert frame.split("\n")[1] == "event: bad kind"


@pytest.mark.parametrize(("only", "matches"), [
    (EventFilter(), True),
    (EventFilter(deployment_id=DeploymentId("d1")), True),
    (EventFilter(deployment_id=DeploymentId("d2")), False),
    (EventFilter(node_id=NodeId("n1")), True),
    (EventFilter(node_id=NodeId("n2")), False),
    (EventFilter(kind="replica.ready"), True),
    (EventFilter(kind="replica."), True),  # a prefix
    (EventFilter(kind="replica"), False),  # no dot: exact only
    (EventFilter(kind="deployment."), False),
    (EventFilter(deployment_id=DeploymentId("d1"), kind="node."), False),  # all must hold
    (EventFilter(deployment_id=DeploymentId("d1"), node_id=NodeId("n1"), kind="replica."),
     True),
])
def test_a_filter_passes_what_every_part_of_it_allows(only: EventFilter,
                                                      matches: bool) -> None:
    assert only.matches(_event()) is matches


def test_an_entry_of_no_deployment_fails_a_deployment_filter() -> None:
    assert not EventFilter(deployment_id=DeploymentId("d1")).matches(_event(deployment=None))


def test_last_event_id_wins_over_after_and_a_bad_one_is_a_422_naming_it() -> None:
    assert _after(None, None) is None
    assert _after(7, None) == 7
    assert _after(7, "12") == 12
    assert _after(7, " ") == 7  # an empty header: as if none
    for bad in ("x", "-1", "1.5"):
        with pytest.raises(HTTPException) as refused:
            _after(None, bad)
        assert refused.value.status_code == 422
        assert "Last-Event-ID" in str(refused.value.detail)
