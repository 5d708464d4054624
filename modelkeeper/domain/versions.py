"""Engine versions: what a node's agent found it can run, and what a model or profile
requires (issue 23). Pure.

A requirement is a PEP 440 specifier set, as pip reads one: ``>=0.6.0``, ``==0.6.3``,
``>=0.6,<0.8``, ``~=0.6.3``; a bare version (``0.6.3``) is taken as ``==0.6.3``. A
reported version that is not PEP 440 (a native ``llama-server`` says its build, ``b4567``)
satisfies only an arbitrary-equality requirement naming it exactly (``===b4567``), so
nothing is guessed about how such builds order.
"""

from __future__ import annotations

import functools

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

#: Longest requirement accepted: a few clauses, not a document.
MAX_REQUIREMENT_CHARS = 64
#: Longest version an agent may report (``vllm --version`` prints a few words at most).
MAX_VERSION_CHARS = 64


def parse_requirement(text: str) -> SpecifierSet:
    """``text`` as a specifier set; ValueError naming what is wrong otherwise."""
    text = text.strip()
    if not text:
        raise ValueError("must not be empty: a version such as 0.6.3, or a requirement "
                         "such as >=0.6.0")
    if len(text) > MAX_REQUIREMENT_CHARS:
        raise ValueError(f"is {len(text)} characters long, at most {MAX_REQUIREMENT_CHARS}")
    if text[0].isdigit():
        text = f"=={text}"
    try:
        return SpecifierSet(text)
    except InvalidSpecifier as exc:
        raise ValueError(f"{text!r} is not a version requirement (PEP 440: >=0.6.0, "
                         f"==0.6.3, >=0.6,<0.8)") from exc


def normalise_requirement(text: str) -> str:
    """The requirement as stored and shown: a bare version made ``==``, spaces dropped."""
    return str(parse_requirement(text))


def satisfies(version: str, requirement: str) -> bool:
    """Whether a reported ``version`` meets ``requirement`` (see :func:`meets`)."""
    return meets(version, parse_requirement(requirement))


def meets(version: str, spec: SpecifierSet) -> bool:
    """Whether a reported ``version`` meets a parsed requirement. A pre-release counts (a
    node running 0.7.0rc1 meets >=0.6); a non-PEP 440 version meets only ``===`` naming it
    exactly."""
    parsed = _version(version)
    if parsed is None:
        return any(s.operator == "===" and s.version == version for s in spec)
    return spec.contains(parsed, prereleases=True)


@functools.lru_cache(maxsize=256)
def _version(text: str) -> Version | None:
    """A fleet reports a handful of distinct versions: each is parsed once, not once per
    node and placement (placement at 1,000 nodes must stay in milliseconds)."""
    try:
        return Version(text)
    except InvalidVersion:
        return None
