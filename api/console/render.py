"""Rendering the console's pages: one Jinja2 environment over the package's templates,
the filters they share, and the headers every page carries.

A page template extends ``base.html`` and puts what changes in its ``live`` block; the
page polls its own URL with ``?part=live`` and gets that block alone (:func:`page`), so
a live table refreshes without the forms beside it losing what an operator typed.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from starlette.responses import HTMLResponse

from .session import CSRF_HEADER, Session

#: Where the console's own files (htmx, the stylesheet, the script) are served from.
STATIC_PATH = "/ui/static"
#: The one script the pages load besides the console's own: htmx, vendored (see
#: static/README.md for its version, source and licence).
HTMX_FILE = "htmx-2.0.11.min.js"
#: How often a page refreshes its live part, in milliseconds (htmx's ``every``).
POLL_MS = 2000
#: How often a deployment's card counts its room for more again: each count judges the
#: whole fleet once per further replica (pages.deployment_room).
ROOM_POLL_MS = 10_000

#: Only this API's own files run or style a page; nothing may frame it. htmx is
#: configured (base.html) to need neither eval nor inline styles.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    # Not no-referrer: under it a browser sends "Origin: null" with a form, which the
    # origin check (session.check_origin) must refuse.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

_GIB = 1024 ** 3


def _bytes(value: int | None) -> str:
    if value is None:
        return "?"
    if abs(value) >= _GIB:
        return f"{value / _GIB:.1f} GiB"
    return f"{value / 1024 ** 2:.0f} MiB"


def _ago(value: datetime | None) -> str:
    if value is None:
        return "-"
    seconds = (datetime.now(UTC) - value).total_seconds()
    if seconds < 120:
        return f"{max(seconds, 0):.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.0f}h ago"


def _percent(part: int | float | None, whole: int | float | None) -> int:
    if not part or not whole:
        return 0
    return max(0, min(100, round(100 * part / whole)))


def _environment() -> Environment:
    env = Environment(loader=PackageLoader("api.console", "templates"),
                      autoescape=select_autoescape(default=True, default_for_string=True),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(bytes=_bytes, ago=_ago)
    env.globals.update(percent=_percent, static=STATIC_PATH, htmx=HTMX_FILE,
                       poll_ms=POLL_MS, room_poll_ms=ROOM_POLL_MS,
                       csrf_header=CSRF_HEADER)
    return env


ENV = _environment()


def page(name: str, *, session: Session | None, part: str | None = None,
         status_code: int = 200, **values: Any) -> HTMLResponse:
    """Template ``name`` with ``values``; with ``part="live"``, its live block alone."""
    template = ENV.get_template(name)
    values = {"session": session, **values}
    if part == "live":
        context = template.new_context(values)
        body = "".join(template.blocks["live"](context))
    else:
        body = template.render(values)
    return HTMLResponse(body, status_code=status_code, headers=SECURITY_HEADERS)
