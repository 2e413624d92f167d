"""Cross-origin requests (CORS) of the OpenAI API, for browser clients on other origins.

`server.requests.cors_allowed_origins` lists the origins a browser may call the API
from ("*": any, as vLLM's default; empty, spur's default: no CORS headers, so browsers
refuse cross-origin calls; server-side clients are unaffected either way). The ingress
replica installs its list at start (`install_origins`); `CORSGate`, the outermost ASGI
middleware, then answers preflight requests (OPTIONS, before the API key check: browsers
send no key with them) and adds the headers to every answer, with Starlette's
CORSMiddleware. Methods GET and POST; any request header (Authorization included);
Retry-After readable by the page. No credentials mode: API keys travel in the
Authorization header, not in cookies.
"""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

_ORIGINS: tuple[str, ...] = ()


def install_origins(origins: list[str] | tuple[str, ...]) -> None:
    """Set this process's allowed origins (the ingress replica calls it from its
    constructor, as `auth.install_guard`: the app Serve runs is a copy of the module's)."""
    global _ORIGINS
    _ORIGINS = tuple(origins)


class CORSGate:
    """ASGI middleware: Starlette's CORSMiddleware over `app` with this process's
    origins, or `app` itself while there are none."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._cors: CORSMiddleware | None = None
        self._for: tuple[str, ...] = ()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origins = _ORIGINS
        if not origins or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._cors is None or self._for != origins:
            self._cors = CORSMiddleware(
                self.app,
                allow_origins=list(origins),
                allow_methods=["GET", "POST"],
                allow_headers=["*"],
                expose_headers=["Retry-After"],
                max_age=600,
            )
            self._for = origins
        await self._cors(scope, receive, send)
