"""The settling window stepped at chosen times."""

from __future__ import annotations

import pytest

from modelkeeper.domain.settling import SettlingWindow

pytestmark = pytest.mark.timeout(10)


def test_steady_count_for_half_the_window_settles_early() -> None:
    w = SettlingWindow(started_at=0, window_s=15)
    w.observe(1, 0.5)
    assert not w.settled(7.9)
    w.observe(3, 7.9)  # two more nodes reconnected: the clock restarts
    assert not w.settled(14.9)  # 7 s steady is not yet half of 15 s
    assert w.settled(15.0)  # the window itself has ended
    w2 = SettlingWindow(started_at=0, window_s=15)
    w2.observe(4, 0.5)
    w2.observe(4, 5)
    assert not w2.settled(7.9)
    assert w2.settled(8.0)


def test_window_ends_even_if_nodes_keep_changing() -> None:
    w = SettlingWindow(started_at=100, window_s=15)
    for t in range(100, 115):
        w.observe(t, t)
        assert not w.settled(t + 0.5)
    assert w.settled(115)
    assert w.remaining_s(110) == 5


def test_no_observation_waits_the_whole_window() -> None:
    w = SettlingWindow(started_at=0, window_s=15)
    assert not w.settled(14.9) and w.settled(15)


def test_no_ready_node_waits_the_whole_window_however_steady() -> None:
    # A restart: the nodes are known but none has reported yet; placing now can only fail.
    w = SettlingWindow(started_at=0, window_s=15)
    w.observe(0, 0.1)
    w.observe(0, 10)
    assert not w.settled(14.9) and w.settled(15)
    # The first node reports: the steady count is counted from then.
    w2 = SettlingWindow(started_at=0, window_s=30)
    w2.observe(0, 0.1)
    w2.observe(1, 11)
    assert not w2.settled(25.9) and w2.settled(26)


def test_zero_window_never_waits() -> None:
    assert SettlingWindow(started_at=0, window_s=0).settled(0)
