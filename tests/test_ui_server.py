"""The web page's server, over real sockets: the token of the printed URL is moved into a
cookie at the first visit."""

from __future__ import annotations

import http.client
import json
from typing import Callable
from urllib.parse import parse_qs, urlsplit

from test_ui import ui as ui  # the fixture that starts `chainrun ui`

WAIT = 30.0  # seconds: short of a hung test


def test_the_token_moves_from_the_url_into_a_cookie_at_the_first_visit(ui: Callable[..., str]) -> None:
    """`chainrun ui`'s printed URL (or a bookmark of any page with its token) sets an
    HttpOnly, SameSite=Strict cookie and sends the browser to the same URL without the
    token; the cookie alone is let in after; neither, a wrong one, or a wrong token in the
    URL: 403. The pages' own links carry no token."""
    url = urlsplit(ui())
    token = parse_qs(url.query)["token"][0]
    connection = http.client.HTTPConnection("127.0.0.1", url.port, timeout=WAIT)

    def ask(path: str, cookie: str = "") -> tuple[http.client.HTTPResponse, str]:
        connection.request("GET", path, headers={"Cookie": cookie} if cookie else {})
        answer = connection.getresponse()
        return answer, answer.read().decode()

    first, _ = ask(f"/?token={token}")
    assert first.status == 303 and first.getheader("Location") == "/"
    name, _, rest = first.getheader("Set-Cookie", "").partition("=")
    value, *attributes = rest.split(";")
    assert name.startswith("chainrun-") and value == token
    assert {a.strip() for a in attributes} == {"Path=/", "HttpOnly", "SameSite=Strict"}
    cookie = f"{name}={value}"
    deeper, _ = ask(f"/api/chains?fragment=1&token={token}")
    assert deeper.status == 303 and deeper.getheader("Location") == "/api/chains?fragment=1"

    page, body = ask("/", f"other=1; {cookie}")
    assert page.status == 200 and token not in body and "/static/ui.js" in body
    listed, body = ask("/api/chains", cookie)
    assert listed.status == 200 and json.loads(body) == []
    assert ask("/static/ui.js", cookie)[0].status == 200
    assert ask("/")[0].status == 403
    assert ask("/", f"{name}={token[:-1]}{'A' if token[-1] != 'A' else 'B'}")[0].status == 403
    assert ask("/", f"chainrun-other={token}")[0].status == 403
    assert ask(f"/?token={token[:-1]}", cookie)[0].status == 403
