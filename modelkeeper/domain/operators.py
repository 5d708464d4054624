"""Operators of the control API: their tokens' roles, and what each role may do.

Pure, so each rule has its test (tests/security/test_api_auth.py):

1. ``admin`` may send anything.
2. ``viewer`` may read: :data:`READ_METHODS` only. Every other method changes something.
3. A token's name is what the audit log records as the actor of each change, so it is
   short and plain: :data:`TOKEN_NAME_PATTERN`.
"""

from __future__ import annotations

import re
from enum import StrEnum

from .base import Frozen


class OperatorRole(StrEnum):
    """What an operator token lets its holder do."""

    ADMIN = "admin"
    VIEWER = "viewer"


#: The methods that only read. FastAPI routes answer no others without a change.
READ_METHODS = frozenset({"GET", "HEAD"})

#: Letters, digits and ``. _ @ -``, 1 to 64 of them: a name that reads as one word in an
#: event, a table and a log line, whoever typed it.
TOKEN_NAME_PATTERN = re.compile(r"[\w.@-]{1,64}")


class Operator(Frozen):
    """Who is calling: a token's name and role (what the routes are handed)."""

    name: str
    role: OperatorRole


def refusal(role: OperatorRole, method: str) -> str | None:
    """Why ``role`` may not send ``method``; None when it may."""
    match role:
        case OperatorRole.ADMIN:
            return None
        case OperatorRole.VIEWER:
            if method.upper() in READ_METHODS:
                return None
            return (f"role viewer may only read ({', '.join(sorted(READ_METHODS))}); "
                    f"{method.upper()} needs an admin token")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a token; None when it can."""
    if TOKEN_NAME_PATTERN.fullmatch(name):
        return None
    return (f"token name {name!r} must be 1 to 64 letters, digits, '.', '_', '@' or '-' "
            f"(it has {len(name)} characters)")
