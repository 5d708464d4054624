"""The error answers routes document in the OpenAPI spec, so that every status code a
client can get is in it (the fuzzing suite, tests/security/test_fuzz_api.py, checks).

Each is a sentence in FastAPI's ``HTTPException`` shape, ``{"detail": "..."}``, naming
what was not found, what conflicts, or what could not be reached.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class Problem(BaseModel):
    """An error answered with a sentence."""

    detail: str


#: What each status means on the routes that document it.
_MEANINGS = {
    404: "Not found: the sentence names what does not exist.",
    409: "Conflict with the current state (already exists, in use, deleting, an operation "
         "running, already ended): the sentence says which.",
    503: "Temporal could not be reached or the workflow could not be started or signalled: "
         "nothing changed, and repeating the request is safe.",
    502: "A node's agent answered with a failure: the sentence says which.",
    504: "A node's agent did not answer in time (it is down, or busy): the sentence names "
         "the node; repeating the request is safe.",
}


def problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route that may answer with ``codes``."""
    return {code: {"model": Problem, "description": _MEANINGS[code]} for code in codes}
