"""``/console``: the web console, a framework-free page shipped in this package.

The files in ``holdfast_gateway/console/`` are the whole console (HTML, CSS,
one script; no build step) and are read once, at import. Every answer carries
a Content-Security-Policy that allows only this origin's script, style and
fetches: the page renders model output with ``textContent``, and the policy
is the second line should a bug ever let markup through. The page itself needs
no key to load; it asks for one and sends it as ``X-Engine-Key`` on its calls.

``/favicon.ico`` is the console's icon (an SVG, which every current browser
takes there): browsers ask for it on any page of the origin, and a 404 for
it is noise in every log and devtools console.
"""

from __future__ import annotations

from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Path
from fastapi.responses import Response
from holdfast_shared.errors import ErrorCode

from holdfast_gateway.errors import ApiError

router = APIRouter()

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self' data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    # The replay URLs the page opens carry a stream token: never send them on.
    "Referrer-Policy": "no-referrer",
    # A new gateway version brings its own console; a stale cached script
    # against a newer API helps nobody.
    "Cache-Control": "no-cache",
}
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


def _load() -> dict[str, tuple[bytes, str]]:
    files: dict[str, tuple[bytes, str]] = {}
    for entry in resources.files("holdfast_gateway").joinpath("console").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in _TYPES:
            files[entry.name] = (entry.read_bytes(), _TYPES[suffix])
    if "index.html" not in files:
        raise RuntimeError("holdfast_gateway/console/index.html is missing from the package")
    return files


_FILES = _load()


def _serve(name: str) -> Response:
    found = _FILES.get(name)
    if found is None:
        raise ApiError(404, ErrorCode.NOT_FOUND, f"no console file {name!r}")
    body, media_type = found
    return Response(body, media_type=media_type, headers=_HEADERS)


@router.get("/console", include_in_schema=False)
async def console_page() -> Response:
    return _serve("index.html")


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> Response:
    return _serve("favicon.svg")


@router.get("/console/{name}", include_in_schema=False)
async def console_file(name: Annotated[str, Path(max_length=64)]) -> Response:
    return _serve(name or "index.html")
