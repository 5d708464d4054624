"""``/docs``: Swagger UI, from files this API serves itself.

FastAPI's own /docs page loads Swagger UI's script and stylesheet from a CDN, and /redoc
its script and fonts: on the page where operators paste their tokens, a script from
another site could read them. Here the page names only this API's own paths; the files
are those the ``fastapi-offline`` package ships (pinned), served under
:data:`ASSETS_PATH`. ReDoc is not served.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from starlette.requests import Request
from starlette.staticfiles import StaticFiles

DOCS_PATH = "/docs"
OAUTH2_REDIRECT_PATH = "/docs/oauth2-redirect"
#: Where Swagger UI's files are served from.
ASSETS_PATH = "/docs/assets"
#: The package whose ``static`` folder holds them.
ASSETS_PACKAGE = "fastapi_offline"


def install(app: FastAPI) -> None:
    """Serve /docs and its files on ``app``, which must be built with ``docs_url=None``
    and ``redoc_url=None`` (FastAPI's pages, which load from a CDN)."""
    assert app.docs_url is None and app.redoc_url is None
    app.mount(ASSETS_PATH, StaticFiles(directory=str(files(ASSETS_PACKAGE) / "static")),
              name="docs-assets")

    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_PATH}/favicon.png",
            oauth2_redirect_url=f"{root}{OAUTH2_REDIRECT_PATH}")

    async def oauth2_redirect(request: Request) -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    # Plain Starlette routes, as FastAPI's own pages are: no data behind them.
    app.add_route(DOCS_PATH, docs, include_in_schema=False)
    app.add_route(OAUTH2_REDIRECT_PATH, oauth2_redirect, include_in_schema=False)
