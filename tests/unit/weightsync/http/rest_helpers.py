"""Helpers of the HTTP tests (a uniquely named module: `conftest` is ambiguous across test dirs)."""

import json
import urllib.error
import urllib.request

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def http(
    port: int,
    path: str,
    body=None,
    method: str | None = None,
    headers=None,
    raw: bytes | None = None,
    timeout: float = 60.0,
):
    """(status, headers, text) of one HTTP request to 127.0.0.1:port."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method=method or ("POST" if data is not None else "GET"),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def error_message(text: str) -> str:
    """The message of an error answer, which is OpenAI's body `{"error": {"message", "type", "param", "code"}}`."""
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err["message"]
