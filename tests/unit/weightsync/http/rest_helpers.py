"""Helpers of the HTTP tests (a uniquely named module: `conftest` is ambiguous across test dirs)."""

import json
import socket
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


def open_stream(port: int, body: dict, path: str = "/v1/completions") -> socket.socket:
    """A raw connection that POSTed `body` (with the token) and read until the SSE stream started, so a
    test can drop it mid-stream as a client that goes away does (close it)."""
    raw = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    s.settimeout(60)
    got = b""
    while b"data: " not in got:
        more = s.recv(65536)
        assert more, f"the connection closed before the stream started: {got!r}"
        got += more
    return s


def error_message(text: str) -> str:
    """The message of an error answer, which is OpenAI's body `{"error": {"message", "type", "param", "code"}}`."""
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err["message"]


def byte_level_model(path, chat_template: str | None = None) -> str:
    """Write to `path` a tiny-qwen2 config and a byte-level tokenizer (every one of the model's 256 ids is
    a byte, so any generated id decodes, and multi-byte characters span tokens), with `chat_template`
    if given. Returns the path, as a `model` setting."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from weightsync.models import TINY

    kw = dict(TINY["tiny-qwen2"])
    AutoConfig.for_model(kw.pop("model_type"), **kw).save_pretrained(str(path))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(alphabet) == kw["vocab_size"] == 256
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return str(path)
