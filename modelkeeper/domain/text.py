"""Which strings the store can hold. PostgreSQL's text and jsonb refuse NUL (``\\u0000``),
and a lone surrogate (``\\ud800`` to ``\\udfff`` without its pair) is not Unicode text at
all: JSON's escapes and URL-encoding let a client send either, and each reached the store
as a 500. The API refuses them at its edge with a 422 naming where they were.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

#: A location in a request, FastAPI's way: ``("body", "labels", "team")``.
Loc = tuple[str | int, ...]

NUL = "\x00"


def text_problem(text: str) -> str | None:
    """Why the store cannot hold ``text``; None when it can."""
    if NUL in text:
        return "holds a NUL character (\\u0000), which the store cannot hold"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return ("holds a lone surrogate (\\ud800 to \\udfff without its pair), which is "
                    "not Unicode text")
    return None


def unstorable(value: Any, loc: Loc) -> Iterator[tuple[Loc, str, str]]:
    """Every string in the JSON value ``value`` at ``loc`` that the store cannot hold, keys
    of objects included: where it is, why, and the string."""
    if isinstance(value, str):
        problem = text_problem(value)
        if problem is not None:
            yield loc, problem, value
    elif isinstance(value, dict):
        for key, item in value.items():
            problem = text_problem(key) if isinstance(key, str) else None
            if problem is not None:
                yield (*loc, key), f"is a key that {problem}", key
            yield from unstorable(item, (*loc, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from unstorable(item, (*loc, index))


def printable(text: str) -> str:
    """``text`` with each NUL and lone surrogate written as its escape (``\\u0000``,
    ``\\ud800``), for an error that echoes it: a surrogate cannot be encoded at all, and
    the API's documents promise strings without NUL, answers included."""
    if NUL in text:
        text = text.replace(NUL, "\\u0000")
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
