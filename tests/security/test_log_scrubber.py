"""The log scrubber misses no kind of secret (issue 19, low finding).

It used to know engine keys, node keys and node credentials in plain text only. An
operator token (``mko-``), the cluster secret (64 bare hex digits, as `up` makes it) and
a key written with escapes (JSON's ``\\u002d``, a JSON string inside a JSON string, a
Python repr) went through. Checked where secrets leave a process: the log tail an agent
sends to Temporal (``ShardExit``) and the log handler every component writes through.
"""

from __future__ import annotations

import codecs
import io
import json
import logging
import secrets
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

from agent.engine_process import read_log_tail
from modelkeeper.domain.engine_keys import derive_engine_key, derive_node_key
from modelkeeper.infra.logs import LOG_FORMAT, OneLineFormatter
from modelkeeper.store.tokens import new_operator_token

CLUSTER_SECRET = secrets.token_hex(32)
NODE_KEY = derive_node_key(CLUSTER_SECRET.encode(), "n-scrub")
ENGINE_KEY = derive_engine_key(NODE_KEY.encode(), "r-scrub")
OPERATOR_TOKEN = new_operator_token()


def _lines() -> dict[str, tuple[str, str]]:
    """A log line per form, each with the secret it holds."""
    escaped = ENGINE_KEY.replace("-", "\\u002d")
    return {
        "an operator token": (f"GET /nodes Authorization: Bearer {OPERATOR_TOKEN}",
                              OPERATOR_TOKEN),
        "the cluster secret": (f"engine_key_secret={CLUSTER_SECRET}", CLUSTER_SECRET),
        "a key with a JSON escape": (json.dumps({"api_key": "x"}).replace('"x"',
                                                                          f'"{escaped}"'),
                                     ENGINE_KEY),
        "a key in JSON inside JSON": (json.dumps(json.dumps({"api_key": escaped})),
                                      ENGINE_KEY),
        "a key with every character escaped": ("".join(f"\\u{ord(c):04x}"
                                                       for c in ENGINE_KEY), ENGINE_KEY),
        "a key in a Python repr of escaped text": (repr(f"args\n{escaped}"), ENGINE_KEY),
        "a node key, URL-encoded": (f"?key={NODE_KEY.replace('-', '%2D')}", NODE_KEY),
    }


def _readings(text: str) -> list[str]:
    """``text``, and as a reader would decode it: URL-decoded, and its escapes read
    (Python's own decoder, not the scrubber's), up to three times over."""
    readings = [text, unquote(text)]
    for _ in range(3):
        try:
            text = codecs.decode(text, "unicode_escape")
        except UnicodeDecodeError:
            break
        readings.append(text)
    return readings


def _leaks(text: str) -> list[str]:
    """Which secrets ``text`` holds any 16 characters of, in any reading (by name, never
    by value)."""
    found = []
    for name, secret in (("operator token", OPERATOR_TOKEN), ("cluster secret", CLUSTER_SECRET),
                         ("node key", NODE_KEY), ("engine key", ENGINE_KEY)):
        body = secret.split("-", 1)[-1]
        if any(body[i:i + 16] in reading for reading in _readings(text)
               for i in range(len(body) - 15)):
            found.append(name)
    return found


@pytest.mark.parametrize("form", sorted(_lines()))
def test_the_log_tail_sent_to_temporal_holds_no_secret(tmp_path: Path, form: str) -> None:
    line, _ = _lines()[form]
    log = tmp_path / "engine.log"
    log.write_text(f"before\n{line}\nafter\n")
    tail = read_log_tail(log)
    assert _leaks("\n".join(tail)) == [], form
    assert tail[0] == "before" and tail[-1] == "after"


@pytest.fixture
def component_log() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger writing through the formatter of every component's log handler."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter(LOG_FORMAT))
    logger = logging.getLogger("test-log-scrubber")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield logger, out
    finally:
        logger.removeHandler(handler)


def test_a_component_s_own_log_holds_no_secret(
        component_log: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = component_log
    for form, (line, _) in sorted(_lines().items()):
        logger.info("%s: %s", form, line)
    logger.info("plain key %s", ENGINE_KEY)
    try:
        raise ValueError(f"refused token {OPERATOR_TOKEN}")
    except ValueError:
        logger.exception("a traceback quoting a secret")
    text = out.getvalue()
    assert _leaks(text) == []
    assert "a traceback quoting a secret" in text and "ValueError" in text
