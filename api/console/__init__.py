"""The web console at ``/ui`` (docs/console.md): server-rendered pages (Jinja2) that
refresh their live parts with htmx, served by the API itself with every file they load.

Behind the API's operator tokens (session.py): a viewer reads, an admin acts. The pages
(pages.py) read what the API's read routes read; the actions (actions.py) are the API's
route functions, called with the session's operator.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from . import actions, pages
from .render import STATIC_PATH

ROUTERS = (pages.router, actions.router)


def install(app: FastAPI) -> None:
    """Serve the console and its static files on ``app``."""
    app.mount(STATIC_PATH, StaticFiles(directory=str(files(__name__) / "static")),
              name="console-static")
    for router in ROUTERS:
        app.include_router(router)
