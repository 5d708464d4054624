"""Who is using the console: an operator token carried in a cookie, and the checks a
change from a browser must pass (docs/security.md, "The console").

* **Login.** ``POST /ui/login`` takes an operator token (the same tokens as the API's:
  ``modelkeeper tokens create``), checks it as the API does and sets it in a cookie that is
  ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's page sends it),
  ``Path=/ui`` (the JSON API never takes it: the API stays bearer-only) and ``Secure`` when
  the console is reached over https. It lasts the Temporal UI's session (a working day,
  ``temporal_ui.SESSION_TTL_S``), or until logout.
* **Each request** looks the token up again (:func:`authenticate_operator`, the API's
  own), so a revoked token stops working at once, and a viewer's change gets the API's 403.
* **Changes** (every ``POST`` under ``/ui`` but the login) must carry the session's CSRF
  token in a header (htmx sends it: ``hx-headers`` on the page's body), and a request that
  names its origin (``Origin``, ``Sec-Fetch-Site``) must name this one. The CSRF token is
  an HMAC of the session's token, so it needs no state and no other site can compute it.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from fastapi import HTTPException, Request
from starlette.responses import Response

from modelkeeper.domain.operators import Operator, OperatorRole
from modelkeeper.settings import Settings
from modelkeeper.store import Store

from ..auth import authenticate_operator
from ..temporal_ui import SESSION_TTL_S

#: The cookie that holds the operator token.
COOKIE = "modelkeeper_console"
#: Where the console lives; the cookie is sent only below it.
PREFIX = "/ui"
#: The header a change carries its CSRF token in.
CSRF_HEADER = "X-Modelkeeper-CSRF"
#: What the CSRF token is an HMAC of, keyed by the session's operator token.
_CSRF_PURPOSE = b"modelkeeper console: a change sent from the console's own pages"


@dataclass(frozen=True, slots=True)
class Session:
    """The operator behind a console request, and the CSRF token their pages send."""

    operator: Operator
    csrf: str

    @property
    def can_act(self) -> bool:
        """Whether the token may change anything (an admin's, not a viewer's)."""
        return self.operator.role is OperatorRole.ADMIN


class LoginNeeded(Exception):
    """No valid token in the cookie: the page answers by sending the browser to log in."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def csrf_token(token: str) -> str:
    """The CSRF token of a session holding ``token``."""
    return hmac.new(token.encode(), _CSRF_PURPOSE, hashlib.sha256).hexdigest()


def _bearer(request: Request) -> str:
    return request.cookies.get(COOKIE, "")


async def session(request: Request, *, method: str = "GET", path: str | None = None
                  ) -> Session:
    """The session of a console request, the operator allowed ``method`` on the API path
    ``path`` (default: the request's own), as the API would judge that call.

    Raises :class:`LoginNeeded` without a valid token (a 401 of the API's), and the API's
    HTTPException 403 for a token that may not do it.
    """
    store: Store = request.app.state.store
    settings: Settings = request.app.state.settings
    token = _bearer(request)
    try:
        operator = await authenticate_operator(
            store=store, settings=settings, method=method, path=path or request.url.path,
            authorization=f"Bearer {token}" if token else None)
    except HTTPException as refused:
        if refused.status_code == 401:
            raise LoginNeeded(str(refused.detail)) from None
        raise
    return Session(operator=operator, csrf=csrf_token(token))


def check_origin(request: Request) -> None:
    """A 403 for a request another site's page sent: its ``Origin`` is not this host's,
    or the browser says (``Sec-Fetch-Site``) it came from another site."""
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        raise HTTPException(403, f"the console takes changes only from its own pages; this "
                                 f"request came from a {fetch_site} page")
    origin = request.headers.get("origin")
    if origin is None:
        return
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin != own:
        raise HTTPException(403, f"the console takes changes only from its own pages "
                                 f"({own}); this request came from {origin}")


async def acting_session(request: Request, *, method: str, path: str) -> Session:
    """The session of a change: same origin, the CSRF token sent, and the operator allowed
    ``method path`` by the API's rules (403 otherwise)."""
    check_origin(request)
    found = await session(request, method=method, path=path)
    sent = request.headers.get(CSRF_HEADER, "")
    if not hmac.compare_digest(sent, found.csrf):
        raise HTTPException(403, f"the change carried no valid CSRF token (header "
                                 f"{CSRF_HEADER}): reload the page and try again")
    return found


def set_session_cookie(response: Response, request: Request, token: str) -> None:
    """Put ``token`` in the session cookie (see the module docstring for its attributes)."""
    response.set_cookie(COOKIE, token, path=PREFIX, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", max_age=int(SESSION_TTL_S))


def clear_session_cookie(response: Response, request: Request) -> None:
    response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")
