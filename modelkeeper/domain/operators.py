"""Operators of the control API: their tokens' roles, and what each role may do.

Pure, so each rule has its test (tests/security/test_api_auth.py):

1. ``admin`` may send anything.
2. ``viewer`` may read: :data:`READ_METHODS` only. Every other method changes something.
3. A token's name is what the audit log records as the actor of each change, so it is
   short and plain: :data:`TOKEN_NAME_PATTERN`.
4. A token bound to a scope of the tenancy tree changes only the deployments owned by
   that scope or beneath it, and nothing else (:func:`scope_refusal`); it reads as its
   role lets it.
"""

from __future__ import annotations

import re
from enum import StrEnum

from .base import Frozen
from .capacity import within


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
    #: The scope its token is bound to; None: unbound.
    scope: str | None = None


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


def scope_refusal(scope: str | None, owner: str | None, what: str) -> str | None:
    """Why a token bound to ``scope`` may not change ``what``, a deployment owned by
    ``owner`` (None: by nobody); None when it may. An unbound token may change any
    deployment its role allows."""
    if scope is None or (owner is not None and within(owner, scope)):
        return None
    whose = "owned by nobody" if owner is None else f"owned by {owner!r}"
    return (f"this token is bound to scope {scope!r}: it changes only deployments owned by "
            f"{scope!r} or a scope beneath it, and {what} is {whose}")


def unscoped_refusal(scope: str | None, what: str) -> str | None:
    """Why a token bound to ``scope`` may not change ``what``, which is no deployment (a
    node, a model, a quota, an operation); None for an unbound token."""
    if scope is None:
        return None
    return (f"this token is bound to scope {scope!r}: it changes only that scope's "
            f"deployments, and {what} is not one; an unbound admin token may")
