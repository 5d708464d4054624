"""A standalone agent's log while its control plane is away (modelkeeper.infra.logs):
few lines, each one sentence, no traceback for a refused connection, no colour codes."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import httpx
import pytest
from temporalio.service import RPCError, RPCStatusCode

from modelkeeper.infra.logs import (
    LOG_FORMAT,
    LogBackoff,
    OneLineFormatter,
    RepeatFilter,
    is_unreachable,
    repeat_note,
)


def test_a_repeated_failure_is_logged_at_once_then_after_growing_gaps() -> None:
    backoff = LogBackoff(first_gap_s=5, max_gap_s=20, reset_after_s=60)
    # One failure a second for a minute.
    lines = {t: n for t in range(60) if (n := backoff.failed("api", now=float(t))) is not None}
    assert lines == {0: 1, 5: 5, 15: 10, 35: 20, 55: 20}


def test_a_recovery_ends_the_streak_and_says_how_long_it_lasted() -> None:
    backoff = LogBackoff(first_gap_s=5, max_gap_s=20, reset_after_s=60)
    backoff.failed("api", now=0.0)
    assert backoff.failed("api", now=1.0) is None
    assert backoff.recovered("api", now=12.0) == 12.0
    assert backoff.recovered("api", now=13.0) is None
    assert backoff.failed("api", now=14.0) == 1  # a new outage: a line at once


def test_a_failure_quiet_for_long_starts_over() -> None:
    backoff = LogBackoff(first_gap_s=5, max_gap_s=20, reset_after_s=60)
    backoff.failed("api", now=0.0)
    assert backoff.failed("api", now=100.0) == 1


def test_kinds_are_counted_apart() -> None:
    backoff = LogBackoff()
    assert backoff.failed("heartbeat", now=0.0) == 1
    assert backoff.failed("liveness stream", now=0.0) == 1
    assert repeat_note(1) == ""
    assert repeat_note(4) == " (3 more like it since the last line)"


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO, list[float]]]:
    """A logger writing through the agent's formatter and filter, on a clock of our own."""
    now = [0.0]
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter(LOG_FORMAT))
    handler.addFilter(RepeatFilter(clock=lambda: now[0]))
    logger = logging.getLogger("temporalio.test-agent-logs")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield logger, out, now
    finally:
        logger.removeHandler(handler)


def test_the_sdk_s_retry_warnings_are_thinned_whatever_their_numbers(
        captured: tuple[logging.Logger, io.StringIO, list[float]]) -> None:
    logger, out, now = captured
    for attempt in range(31):
        now[0] = attempt * 0.5
        logger.warning("gRPC call poll_activity_task_queue retried %d times", attempt)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines  # at 0 s, 5 s and 15 s of 15 s
    assert lines[1].endswith("retried 10 times (9 more like it since the last line)")
    logger.info("registered")  # below WARNING: never thinned
    assert out.getvalue().splitlines()[-1].endswith("registered")


def test_an_unreachable_peer_is_one_line_any_other_error_keeps_its_traceback(
        captured: tuple[logging.Logger, io.StringIO, list[float]]) -> None:
    logger, out, now = captured
    try:
        raise RuntimeError("complete failed") from RPCError(
            "tcp connect error", RPCStatusCode.UNAVAILABLE, b"")
    except RuntimeError:
        logger.warning("Failed completing activity task", exc_info=True)
    now[0] = 1000.0
    try:
        raise KeyError("a bug")
    except KeyError:
        logger.warning("Something else", exc_info=True)
    text = out.getvalue()
    first, *rest = text.splitlines()
    assert first.endswith("Failed completing activity task (RuntimeError: complete failed)")
    assert "Traceback" in rest[1] and "KeyError: 'a bug'" in text
    assert "\x1b[" not in text


def test_what_counts_as_unreachable() -> None:
    assert is_unreachable(httpx.ConnectError("All connection attempts failed"))
    assert is_unreachable(ConnectionRefusedError())
    assert is_unreachable(RPCError("x", RPCStatusCode.UNAVAILABLE, b""))
    assert not is_unreachable(RPCError("x", RPCStatusCode.NOT_FOUND, b""))
    assert not is_unreachable(ValueError("a bug"))
