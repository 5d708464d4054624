"""`ls` and `ops` reasons that went stale or ran on (issue 24, section 8), in the pure
functions that build them:

* a sharing note is shown only for replicas that still share a node with a live one;
* a last failure from before a restart (an older generation) is no longer history;
* an operation's summary or error is cut to one bounded line with an ellipsis.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from cli.main import build_parser
from cli.operator_cli import ELLIPSIS, MAX_CELL_CHARS, MIN_CELL_CHARS, cell_width, clip, render
from modelkeeper.domain.catalog import ReplicaView, current_placement_note
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.status import ReplicaState, failure_is_current

pytestmark = pytest.mark.timeout(10)

NOTE = ("shares node vm with another replica of d1: no other node has room (node b: 1.0 GiB "
        "free, needs 2.0 GiB)")


def replica(replica_id: str, *nodes: str, state: ReplicaState = ReplicaState.READY
            ) -> ReplicaView:
    return ReplicaView(replica_id=ReplicaId(replica_id), deployment_id=DeploymentId("d1"),
                       model_id=ModelId("m"), nodes=[NodeId(n) for n in nodes], state=state,
                       endpoint=None, started_at=None, ready_at=None)


def test_a_sharing_note_goes_once_the_replica_shares_no_node() -> None:
    note = f"d1-r2 {NOTE}"
    # While the old replica is there, the new one shares its node: said.
    assert current_placement_note(note, [replica("d1-r1", "vm"), replica("d1-r2", "vm")]) \
        == note
    # The old one stopping, or gone (a 1/1 deployment after a restart): not any more.
    assert current_placement_note(note, [replica("d1-r1", "vm", state=ReplicaState.STOPPING),
                                         replica("d1-r2", "vm")]) is None
    assert current_placement_note(note, [replica("d1-r2", "vm")]) is None


def test_only_the_parts_of_replicas_still_sharing_stay() -> None:
    note = f"d1-r2 {NOTE}; d1-r3 shares node b with another replica of d1: x; y"
    replicas = [replica("d1-r2", "vm"), replica("d1-r3", "b"), replica("d1-r4", "b")]
    assert current_placement_note(note, replicas) == (
        "d1-r3 shares node b with another replica of d1: x; y")
    # A note naming no replica it knows is kept as written; none at all is None.
    assert current_placement_note(NOTE, replicas) == NOTE
    assert current_placement_note(None, replicas) is None


def test_a_failure_from_an_older_generation_is_over() -> None:
    assert failure_is_current(None, 3)  # recorded before its generation was kept
    assert failure_is_current(3, 3)
    assert not failure_is_current(2, 3)


def _ls(**fields: Any) -> str:
    deployment = {"deployment_id": "d1", "model_id": "m", "status": "serving",
                  "ready_replicas": 1, "desired_replicas": 1, "consecutive_failures": 0,
                  "placement_error": None, "last_failure": "d1-r1: engine exited (oom)",
                  "workflow_id": "deployment/d1", "generation": 4, **fields}
    return render(build_parser().parse_args(["ls"]), [deployment]).splitlines()[1]


def test_ls_shows_a_last_failure_only_while_it_is_current() -> None:
    assert _ls(last_failure_generation=4).endswith("(last failure: d1-r1: engine exited (oom))")
    # A normal restart since (generation 5): the old failure is not shown.
    assert "last failure" not in _ls(last_failure_generation=4, generation=5)


def test_an_operations_long_summary_is_cut_to_one_bounded_line() -> None:
    long = "restart d1: " + "replace replica; " * 40 + "\nend"
    assert len(long) > 600
    cut = clip(long, 80)
    assert len(cut) == 80 and cut.endswith(ELLIPSIS) and "\n" not in cut
    assert clip("short", 80) == "short"
    assert MIN_CELL_CHARS <= cell_width() <= MAX_CELL_CHARS
    operation = {"operation_id": "restart/d1/1", "state": "failed",
                 "updated_at": datetime(2026, 1, 1, tzinfo=UTC).isoformat(),
                 "summary": long, "error": "x" * 600}
    shown = render(build_parser().parse_args(["ops"]), [operation])
    [row] = shown.splitlines()[1:]
    assert len(row) < 2 * MAX_CELL_CHARS + 80 and row.count(ELLIPSIS) == 2
    # Whole in --json, and in `ops show`.
    assert long in render(build_parser().parse_args(["ops", "--json"]), [operation]) \
        .replace("\\n", "\n")
