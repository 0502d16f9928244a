"""The chat page at `/` (on unless `--no-web-ui`): the files in serve/web, shipped inside the
package, read once and answered as they are (no build step, nothing fetched from elsewhere).

Every answer carries a Content-Security-Policy that lets the page run only its own scripts and
styles and talk only to this server, so even a renderer bug could not run a model's `<script>`
(the renderer, serve/web/markdown.js, makes text nodes and elements of its own choosing, never
markup). The page's files need no API key: the page asks the user for one when the API answers
401 and sends it with its own requests."""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

# URL path -> (file in serve/web, media type)
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/ui/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/ui/chat.css": ("chat.css", "text/css; charset=utf-8"),
}

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a restarted server's new page is seen at the next load
}


def page_routes() -> list[Route]:
    """One route per file of the page, its bytes read now."""
    folder = resources.files("jinfer_serve").joinpath("web")
    routes = []
    for path, (name, media_type) in PAGE_FILES.items():
        body = folder.joinpath(name).read_bytes()

        async def serve_file(request: Request, body=body, media_type=media_type) -> Response:
            return Response(body, media_type=media_type, headers=HEADERS)

        routes.append(Route(path, serve_file, methods=["GET", "HEAD"]))
    return routes
