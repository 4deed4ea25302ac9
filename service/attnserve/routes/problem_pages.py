"""The pages of the problem types: ``GET /problems/{slug}``.

Every problem document's ``type`` is ``/problems/<slug>``, a URI relative to the
server; this route makes it resolve (RFC 9457, section 3.1.1: a ``type`` should
lead to documentation of the problem). The page says the title, the status, when
the problem happens and what to do, all from the one catalogue,
:mod:`attnserve_client.problems`: HTML by default, JSON when the request's Accept
header prefers ``application/json``. An unknown slug is a ``not-found`` problem.
"""

from __future__ import annotations

from html import escape

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse

from attnserve_client.problems import PROBLEM_HELP, PROBLEM_TYPES

from ..errors import RouteNotFound

__all__ = ["router", "problem_page"]

router = APIRouter()


def _wants_json(accept: str) -> bool:
    """Whether the Accept header ranks a JSON type above text/html (equal ranks: HTML)."""
    best = {"json": -1.0, "html": -1.0}
    for part in accept.split(","):
        media, _, params = part.strip().partition(";")
        q = 1.0
        for param in params.split(";"):
            name, _, value = param.strip().partition("=")
            if name == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        media = media.strip().lower()
        if media in ("application/json", "application/problem+json"):
            best["json"] = max(best["json"], q)
        elif media in ("text/html", "application/xhtml+xml", "text/*", "*/*"):
            best["html"] = max(best["html"], q)
    return best["json"] > 0 and best["json"] > best["html"]


def problem_page(slug: str) -> dict[str, object]:
    """The page of a problem type as data: ``type``, ``title``, ``status``, ``when``, ``action``."""
    kind, help_ = PROBLEM_TYPES[slug], PROBLEM_HELP[slug]
    return {
        "type": f"/problems/{slug}",
        "title": kind.title,
        "status": kind.status,
        "when": help_.when,
        "action": help_.action,
    }


def _html(page: dict[str, object]) -> str:
    title = escape(str(page["title"]))
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{title} ({page["status"]}) - attnserve</title></head>\n'
        "<body>\n"
        f"<h1>{title}</h1>\n"
        f"<p>HTTP status <strong>{page['status']}</strong>; "
        f"problem type <code>{escape(str(page['type']))}</code>.</p>\n"
        f"<h2>When it happens</h2>\n<p>{escape(str(page['when']))}</p>\n"
        f"<h2>What to do</h2>\n<p>{escape(str(page['action']))}</p>\n"
        "<p>The problem document's <code>detail</code> says what exactly was refused. "
        '<a href="/problems">Every problem type</a>; the API: <a href="/docs">/docs</a>.</p>\n'
        "</body></html>\n"
    )


@router.get("/problems", include_in_schema=False)
async def problem_index(request: Request) -> Response:
    pages = [problem_page(slug) for slug in PROBLEM_TYPES]
    if _wants_json(request.headers.get("accept", "")):
        return JSONResponse(pages)
    items = "\n".join(
        f'<li><a href="{escape(str(p["type"]))}">{escape(str(p["title"]))}</a> ({p["status"]})</li>' for p in pages
    )
    return HTMLResponse(
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>Problem types - attnserve</title>'
        f"</head>\n<body>\n<h1>Problem types</h1>\n<ul>\n{items}\n</ul>\n</body></html>\n"
    )


@router.get("/problems/{slug}", include_in_schema=False)
async def problem_type(slug: str, request: Request) -> Response:
    if slug not in PROBLEM_TYPES:
        raise RouteNotFound(f"no problem type {slug!r}; /problems lists them")
    page = problem_page(slug)
    if _wants_json(request.headers.get("accept", "")):
        return JSONResponse(page)
    return HTMLResponse(_html(page))
