"""The playground: a page at / that shows, as an answer streams, which tokens were drafted.

Three static files inside the package (serve/static/: index.html, playground.css,
playground.js), no CDN, no build step, nothing fetched from anywhere but this server, so it works
offline. The page is a client of the API like any other: it streams chat (or completions, for a
model without a chat template) with `stream_options.include_speculation`, colours each token by
its origin (serve.origins), draws a strip of rounds (drafted vs accepted), tokens per second as
they arrive and acceptance by position, and sends the same request with
`speculation: {"drafter": "none"}` to put both speeds side by side.

The API-key rule is the API's: the page itself holds nothing of the server's (no model name, no
data; the model list and every answer come from /v1, which needs the key). With a key set, the
page asks for it on the first 401 and sends it as a Bearer token, keeping it in the tab's
sessionStorage only. llama-server serves its web UI the same way.

Every file is served with a Content-Security-Policy that allows scripts, styles and fetches from
this origin only and no framing: a prompt typed into the page cannot be sent anywhere else, and
no other site can frame the page to click its buttons.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

#: URL path -> (file in serve/static/, media type)
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/playground.css": ("playground.css", "text/css; charset=utf-8"),
    "/static/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def read(name: str) -> bytes:
    """A static file's bytes, from inside the installed package."""
    return (resources.files("specdec.serve") / "static" / name).read_bytes()


def add_routes(app: FastAPI) -> None:
    """GET routes for the page and its two assets, read once (a fixed set: no path is ever
    joined with anything a client sent)."""
    for path, (name, media_type) in FILES.items():
        app.add_api_route(path, _page(read(name), media_type), methods=["GET"])


def _page(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def page() -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)

    return page
