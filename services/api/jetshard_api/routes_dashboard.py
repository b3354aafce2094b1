"""The dashboard: a page at `/` and its script, styles and icon under `/dashboard/`, shipped in this package.

Plain files, no build step and nothing from a CDN, so the page works offline. It renders `/view/stream` as it
comes and chats through `/v1/chat/completions`; it holds no data itself, so it is served without the API key
(the page asks for the key and sends it on its own requests).
"""

from __future__ import annotations

from pathlib import Path

from litestar import Router, get, head
from litestar.datastructures import CacheControlHeader
from litestar.handlers import HTTPRouteHandler
from litestar.response import File
from litestar.static_files import create_static_files_router

DASHBOARD_DIR = Path(__file__).parent / "dashboard"
DASHBOARD_ASSETS_PATH = "/dashboard"
REVALIDATE = CacheControlHeader(no_cache=True)
"""A browser asks again each time (and gets a 304 while unchanged): an upgraded API never runs an old script."""
PAGE_POLICY = "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
"""Only this API's own script and styles run, and no other site may frame the page."""


@get("/", include_in_schema=False, cache_control=REVALIDATE)
async def dashboard_page() -> File:
    return File(
        DASHBOARD_DIR / "index.html",
        content_disposition_type="inline",
        media_type="text/html",
        headers={"Content-Security-Policy": PAGE_POLICY},
    )


@head("/", include_in_schema=False)
async def server_is_up() -> None:
    """Ollama's clients (the `ollama` CLI before each command) ask `HEAD /` whether the server is up."""


def dashboard_routes() -> list[HTTPRouteHandler | Router]:
    assets = create_static_files_router(
        DASHBOARD_ASSETS_PATH, directories=[DASHBOARD_DIR], name="dashboard", cache_control=REVALIDATE
    )
    return [dashboard_page, server_is_up, assets]
