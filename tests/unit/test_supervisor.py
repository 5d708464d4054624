"""`up`'s supervision: the restart policy stepped at chosen times, then the loop acting on it.

The policy (:func:`after_exit`) is pure: each test feeds it exit times and checks what it
decides. The last tests drive :meth:`Stack.supervise` with a real child that exits at once,
with ``now`` chosen by the test, so no test waits out a backoff.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.stack import (
    FIRST_RESTART_DELAY_S,
    GIVE_UP_AFTER_EXITS,
    GIVE_UP_WINDOW_S,
    GiveUp,
    Restart,
    Stack,
    StackError,
    after_exit,
    describe_exit,
)
from modelkeeper.infra.processes import ManagedProcess
from modelkeeper.settings import Settings


def _exits_at(times: list[float]) -> list[Restart | GiveUp]:
    """Feed exits at ``times`` through the policy, as the supervision loop does."""
    decisions: list[Restart | GiveUp] = []
    exits: tuple[float, ...] = ()
    for now in times:
        decision = after_exit(exits, now=now)
        decisions.append(decision)
        if isinstance(decision, Restart):
            exits = decision.exits
    return decisions


def test_a_first_exit_is_restarted_after_the_first_delay() -> None:
    assert after_exit((), now=100.0) == Restart(delay_s=FIRST_RESTART_DELAY_S, exits=(100.0,))


def test_each_exit_within_the_window_doubles_the_wait() -> None:
    delays = [d.delay_s for d in _exits_at([0.0, 1.0, 3.0, 6.0]) if isinstance(d, Restart)]
    assert delays == [0.5, 1.0, 2.0, 4.0]


def test_the_fifth_exit_within_the_window_gives_up() -> None:
    *restarts, last = _exits_at([0.0, 1.0, 3.0, 6.0, 10.0])
    assert all(isinstance(d, Restart) for d in restarts)
    assert last == GiveUp(count=GIVE_UP_AFTER_EXITS, window_s=GIVE_UP_WINDOW_S)


def test_exits_older_than_the_window_no_longer_count() -> None:
    earlier = (0.0, 1.0, 2.0, 3.0)
    # 3.0 is 59.5 s old: it still counts, so the wait is the second step's.
    assert after_exit(earlier, now=62.5) == Restart(delay_s=1.0, exits=(3.0, 62.5))
    # A full window after the last exit, the component starts afresh: short wait, one exit.
    assert after_exit(earlier, now=63.0) == Restart(delay_s=FIRST_RESTART_DELAY_S,
                                                    exits=(63.0,))


def test_a_component_that_exits_now_and_then_is_restarted_for_ever() -> None:
    decisions = _exits_at([i * (GIVE_UP_WINDOW_S + 1) for i in range(20)])
    assert decisions == [Restart(delay_s=FIRST_RESTART_DELAY_S, exits=(d.exits[-1],))
                         for d in decisions if isinstance(d, Restart)]


@pytest.mark.parametrize("start_up_s", [0.0, 2.0, 10.0])
def test_a_crash_loop_is_given_up_on_whatever_its_pace(start_up_s: float) -> None:
    """A component that dies ``start_up_s`` after each restart: the backoff must fit in the
    window, or a slow crash loop would be restarted for ever."""
    now = 0.0
    exits: tuple[float, ...] = ()
    decision = after_exit(exits, now=now)
    while isinstance(decision, Restart):
        now += decision.delay_s + start_up_s
        exits = decision.exits
        decision = after_exit(exits, now=now)
    assert decision.count == GIVE_UP_AFTER_EXITS
    assert now < GIVE_UP_WINDOW_S


def test_exits_are_described_by_code_or_signal() -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"


# -- the loop, acting ---------------------------------------------------------------------


def _stack_with_crasher(tmp_path: Path) -> tuple[Stack, ManagedProcess]:
    stack = Stack(Settings(data_dir=tmp_path), demo=False)
    proc = ManagedProcess("crasher", ["sh", "-c", "exit 3"],
                          tmp_path / "crasher.log")
    proc.start()
    stack.add(proc)
    return stack, proc


def _wait_exit(proc: ManagedProcess) -> None:
    assert proc.popen is not None
    proc.popen.wait(30)


def test_supervise_restarts_an_exited_component_after_its_backoff(tmp_path: Path) -> None:
    stack, proc = _stack_with_crasher(tmp_path)
    try:
        first_pid = proc.pid
        _wait_exit(proc)
        stack.supervise(now=0.0)  # noticed: restart scheduled, not yet done
        assert proc.pid == first_pid
        stack.supervise(now=FIRST_RESTART_DELAY_S - 0.01)
        assert proc.pid == first_pid
        stack.supervise(now=FIRST_RESTART_DELAY_S)
        assert proc.pid != first_pid
    finally:
        stack.stop()


def test_supervise_gives_up_in_one_line_naming_the_component(tmp_path: Path) -> None:
    stack, proc = _stack_with_crasher(tmp_path)
    now = 0.0
    try:
        with pytest.raises(StackError) as raised:
            for _ in range(GIVE_UP_AFTER_EXITS):
                _wait_exit(proc)
                stack.supervise(now=now)  # notices the exit
                now += 10.0
                stack.supervise(now=now)  # past any backoff: starts it again
        message = str(raised.value)
        assert "\n" not in message
        assert message.startswith(
            f"giving up on crasher: it exited {GIVE_UP_AFTER_EXITS} times within 60s")
        assert "exit code 3" in message and str(tmp_path / "crasher.log") in message
    finally:
        stack.stop()
