"""The pages a person opens in a browser: the problem types' pages at their ``type``
URIs (``/problems/<slug>``), and the API pages (``/docs``, ``/redoc``) with every
asset served by the server itself, none from a CDN."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import httpx
import pytest

from attnserve import errors as server_errors
from attnserve.app import DOCS_ASSETS
from attnserve_client.problems import PROBLEM_HELP, PROBLEM_TYPES


def _server_slugs() -> set[str]:
    """Every slug an ApiError class of the server can send (the classes walked, not listed)."""
    slugs, todo = set(), [server_errors.ApiError]
    while todo:
        cls = todo.pop()
        slugs.add(cls.slug)
        todo.extend(cls.__subclasses__())
    return slugs


def test_every_problem_type_has_its_help():
    assert set(PROBLEM_HELP) == set(PROBLEM_TYPES)
    for slug, help_ in PROBLEM_HELP.items():
        assert help_.when.strip() and help_.action.strip(), slug


@pytest.mark.parametrize("slug", sorted(_server_slugs()))
def test_every_problem_type_the_server_sends_resolves_to_a_page(server, slug):
    kind, help_ = PROBLEM_TYPES[slug], PROBLEM_HELP[slug]
    with httpx.Client(base_url=server.url) as http:
        page = http.get(f"/problems/{slug}", headers={"Accept": "text/html"})
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        text = page.text
        for shown in (kind.title, str(kind.status), f"/problems/{slug}"):
            assert shown in text, (shown, text)
        assert "When it happens" in text and "What to do" in text
        as_json = http.get(f"/problems/{slug}", headers={"Accept": "application/json"})
        assert as_json.status_code == 200 and as_json.headers["content-type"].startswith("application/json")
        assert as_json.json() == {
            "type": f"/problems/{slug}",
            "title": kind.title,
            "status": kind.status,
            "when": help_.when,
            "action": help_.action,
        }


def test_a_problem_document_type_resolves_where_it_was_sent(server):
    with httpx.Client(base_url=server.url) as http:
        http.put("/v1/sessions/pages-demo", json={"num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 4})
        try:
            k = [[[1.0, 0.0, 0.0, 0.0]]]
            r = http.post("/v1/sessions/pages-demo/layers/0/kv", json={"k": k, "v": k, "offset": 5})
            assert r.status_code == 409
            page = http.get(urljoin(str(r.url), r.json()["type"]))
            assert page.status_code == 200 and "Offset mismatch" in page.text
        finally:
            http.delete("/v1/sessions/pages-demo")


def test_an_unknown_problem_type_is_a_404_problem(server):
    with httpx.Client(base_url=server.url) as http:
        r = http.get("/problems/no-such-problem")
        assert r.status_code == 404
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["type"] == "/problems/not-found"
        index = http.get("/problems")
        assert index.status_code == 200
        for slug in PROBLEM_TYPES:
            assert f'href="/problems/{slug}"' in index.text


class _Refs(HTMLParser):
    """Every src= and href= of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.refs += [value for name, value in attrs if name in ("src", "href") and value]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_api_pages_load_only_local_assets(server, page):
    with httpx.Client(base_url=server.url) as http:
        r = http.get(page)
        assert r.status_code == 200
        parser = _Refs()
        parser.feed(r.text)
        # the scripts' own URLs too (Swagger UI's url: '/openapi.json', ReDoc's spec-url)
        quoted = re.findall(r"""(?:url|spec-url)\s*[:=]\s*['"]([^'"]+)['"]""", r.text)
        refs = parser.refs + quoted
        assert refs, r.text
        for ref in refs:
            assert not urlsplit(ref).netloc and not urlsplit(ref).scheme, f"{page} loads {ref} from elsewhere"
        assets = [ref for ref in parser.refs if ref.startswith(DOCS_ASSETS + "/")]
        assert any(a.endswith(".js") for a in assets), parser.refs
        for asset in assets:
            got = http.get(asset)
            assert got.status_code == 200 and len(got.content) > 1000, asset
        assert http.get("/openapi.json").status_code == 200
