"""Just enough PromQL reading for tests: the metric names an expression selects, the
labels it matches on and groups by, and a Grafana query made into plain PromQL.

Not a parser: promtool checks the syntax (tests/unit/test_prometheus_rules.py and
tests/unit/test_grafana_dashboard.py run it on the same expressions). This finds the
names, which promtool accepts whatever they are.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass

import pytest

#: Words of PromQL that look like metric names.
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on",
                      "ignoring", "group_left", "group_right", "inf", "nan", "atan2"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)")
_WORD = re.compile(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")

#: What each Grafana variable stands for in a query checked outside Grafana.
GRAFANA_VARIABLES = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}


@dataclass(frozen=True)
class Reading:
    """What one expression reads: metric names, each selector's matched labels, and the
    labels it groups or matches by."""

    metrics: frozenset[str]
    matched: tuple[tuple[str, frozenset[str]], ...]
    grouped: frozenset[str]


def read(expr: str) -> Reading:
    """The names ``expr`` selects and the labels it uses (strings masked first)."""
    masked = _STRING.sub('""', expr)
    grouped = frozenset(label.strip() for _, labels in _GROUPING.findall(masked)
                        for label in labels.split(",") if label.strip())
    masked = _GROUPING.sub(" ", masked)
    masked = _RANGE.sub("", masked)
    matched = []
    for name, body in _SELECTOR.findall(masked):
        labels = frozenset(label for label, _ in _MATCHER.findall(body))
        assert "__name__" not in labels, f"select a metric by its name, not {body!r}"
        assert name, f"a selector without a metric name in {expr!r}"
        matched.append((name, labels))
    masked = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", masked)
    metrics = set()
    for word, call in _WORD.findall(masked):
        if call or word.lower() in KEYWORDS:
            continue  # a function, or an operator word
        metrics.add(word)
    return Reading(frozenset(metrics), tuple(matched), grouped)


def plain(query: str, variables: dict[str, str]) -> str:
    """A Grafana query as Prometheus would run it: ``$name``, ``${name}`` and
    ``[[name]]`` replaced, by ``variables`` or :data:`GRAFANA_VARIABLES`."""
    values = {**GRAFANA_VARIABLES, **variables}

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        assert name in values, f"the query {query!r} uses ${name}, which nothing defines"
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", value, query)


def promtool() -> str:
    """promtool's path; the test fails, loudly, where it is missing: the alert rules are
    unchecked without it (Debian: `apt-get install prometheus`; ./dev installs it)."""
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not installed: these checks need it (Debian's `prometheus` "
                    "package: apt-get install prometheus)")
    return found
