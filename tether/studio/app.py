"""The studio's FastAPI app: the pages, the security checks every request passes, the static files.

Adding a page is one module tether/studio/<page>.py (exposing `router`, an APIRouter with prefix
/api/<page>, and `TITLE`, its name in the navigation bar), one entry in PAGES below and its static
files tether/studio/static/<page>.html and <page>.js (docs/studio.md, "Adding a page").

Every request passes `guard`:
* bound to loopback (no token): the Host header must name loopback, so a web page elsewhere cannot
  reach the studio through DNS rebinding;
* bound elsewhere: the token printed at start must come with every request (header X-Tether-Token,
  query ?token= once, which sets a cookie, or that cookie), compared in constant time;
* a request that changes something (not GET/HEAD) with an Origin header must come from the
  studio's own origin (no cross-site form posts into the labeler's files).
"""

from __future__ import annotations

import hmac
import importlib
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from tether.studio.common import Studio

# the pages, in navigation order: each is the module tether.studio.<name> (docs/studio.md gives the
# order: runs, stages, labeler, grpo, algorithms, hacking, prm, episodes)
PAGES: tuple[str, ...] = ("runs", "stages", "labeler", "grpo", "algorithms", "hacking", "prm", "episodes")
STATIC = Path(__file__).parent / "static"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
COOKIE = "tether_token"
HEADERS = {  # no inline scripts, nothing from elsewhere, never framed
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def page_modules() -> dict:
    return {name: importlib.import_module(f"tether.studio.{name}") for name in PAGES}


def create_app(cfg, token: str | None = None) -> FastAPI:
    """The app for `cfg` (a StudioConfig). `token`: required on every request when set."""
    app = FastAPI(title="tether studio", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.studio = Studio(cfg=cfg, runs_dir=Path(cfg.runs_dir).resolve(), token=token)
    modules = page_modules()

    @app.middleware("http")
    async def guard(request: Request, call_next):
        studio: Studio = request.app.state.studio
        set_cookie = False
        if studio.token is None:
            if _hostname(request.headers.get("host", "")) not in LOOPBACK:
                return JSONResponse({"detail": "the studio answers only on loopback"}, status_code=403)
        else:
            given = (request.headers.get("x-tether-token") or request.cookies.get(COOKIE)
                     or request.query_params.get("token") or "")
            if not hmac.compare_digest(given.encode(), studio.token.encode()):
                return JSONResponse({"detail": "missing or wrong token"}, status_code=401)
            # the printed URL's ?token= becomes a cookie, so the page's own requests carry it
            set_cookie = "token" in request.query_params and request.cookies.get(COOKIE) != studio.token
        origin = request.headers.get("origin")
        if request.method not in ("GET", "HEAD") and origin and urlsplit(origin).netloc != request.headers.get("host"):
            return JSONResponse({"detail": "cross-origin request refused"}, status_code=403)
        response = await call_next(request)
        response.headers.update(HEADERS)
        if set_cookie:
            response.set_cookie(COOKIE, studio.token, httponly=True, samesite="strict")
        return response

    for mod in modules.values():
        app.include_router(mod.router)
        if hasattr(mod, "startup"):  # optional: work a page starts when the app is made (in a thread)
            mod.startup(app.state.studio)

    @app.get("/api/pages")
    def pages():
        """The navigation bar: every page's name and title."""
        return [{"name": n, "title": m.TITLE} for n, m in modules.items()]

    @app.get("/favicon.ico")
    def favicon():
        return Response(status_code=204)

    @app.get("/")
    def index():
        return RedirectResponse(f"/{PAGES[0]}")

    @app.get("/{page}")
    def page(page: str):
        if page not in modules:  # a fixed set of names: nothing from the request reaches a path
            raise HTTPException(404, f"no page {page!r}")
        return FileResponse(STATIC / f"{page}.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _hostname(host: str) -> str:
    """The host name of a Host header, without its port ("[::1]:7860" -> "::1")."""
    if host.startswith("["):
        return host[1:host.find("]")]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
