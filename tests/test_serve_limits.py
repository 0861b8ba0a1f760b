"""The server's limits (serve/limits.py), against the real server on 127.0.0.1.

Each test is a finding of issue 32 that held on the server before the limits: a body over the
limit was read whole (here the client never sends it all, and the 413 still comes), a huge or
many-headered request was served, a client dribbling its headers or body held its connection
forever, connections past any cap were taken until file descriptors ran out, and a long prompt
was tokenized on the event loop while ``/health`` waited (and any prompt was tokenized, however
much longer than the context it was). Small limits are passed as keywords so that the tests are
quick; the last tests use the defaults (and SmolLM2's tokenizer, whose encoding of a long prompt
takes seconds: the byte tokenizer of tiny-gpt2 is too fast).
Requests are written on raw sockets: what a hostile client sends, no HTTP library in between.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from pagedlearn.models.tokenizer import max_chars_per_token  # noqa: E402
from pagedlearn.serve import serve  # noqa: E402
from pagedlearn.serve.request_checks import PROMPT_CHARS_MARGIN  # noqa: E402

SMALL = dict(max_body_bytes=4096, max_header_bytes=2048, max_headers=20)
READ = 10.0  # seconds a test waits for an answer: far above every limit's (a bound, not a timing)


@pytest.fixture(scope="module")
def srv():
    with serve("tiny-gpt2", port=0, verbose=False, header_timeout=1.0, body_timeout=1.0,
               **SMALL) as s:  # fmt: skip
        yield s


def port_of(srv) -> int:
    return int(srv.url.rsplit(":", 1)[1])


def connect(srv) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port_of(srv)), timeout=READ)
    return sock


def answer(sock: socket.socket) -> tuple[int, dict | None]:
    """Read until the server closes: (status, JSON body or None). A read that times out fails
    the test: the server did not answer."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), data[:200]
    return int(head.split()[1]), (json.loads(body) if body else None)


def assert_refused(status_and_body, status: int, says: str) -> None:
    got, body = status_and_body
    assert got == status, body
    err = body["error"]  # OpenAI's error shape
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert says in err["message"], err["message"]


def head(path="/v1/completions", extra=b"", method=b"POST") -> bytes:
    return (method + b" " + path.encode() + b" HTTP/1.1\r\nHost: t\r\n"
            b"Content-Type: application/json\r\n" + extra)  # fmt: skip


def test_a_body_over_the_limit_by_its_content_length_is_refused_before_it_is_read(srv):
    with connect(srv) as sock:  # says 100 MB, sends 1 kB: the server must not wait for the rest
        sock.sendall(head(extra=b"Content-Length: 100000000\r\n\r\n") + b"{" * 1000)
        assert_refused(answer(sock), 413, "100000000 bytes")


def test_a_chunked_body_is_counted_as_it_arrives(srv):
    with connect(srv) as sock:  # 8 kB of chunks and no last chunk: refused once past 4 kB
        sock.sendall(head(extra=b"Transfer-Encoding: chunked\r\n\r\n"))
        for _ in range(8):
            sock.sendall(b"400\r\n" + b" " * 1024 + b"\r\n")
        assert_refused(answer(sock), 413, "more than 4096 bytes")


def test_a_body_within_the_limit_is_served(srv):
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    with connect(srv) as sock:
        sock.sendall(head(extra=b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)))
        sock.sendall(body)
        status, out = answer(sock)
    assert status == 200 and out["choices"][0]["finish_reason"] == "length"


def test_too_many_headers_and_too_large_headers_are_refused(srv):
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(30))
    with connect(srv) as sock:
        sock.sendall(head("/health", many + b"\r\n", b"GET"))
        assert_refused(answer(sock), 431, "32 headers, more than 20")
    with connect(srv) as sock:  # arrives whole, in one read
        sock.sendall(head("/health", b"X-Big: " + b"a" * 3000 + b"\r\n\r\n", b"GET"))
        assert_refused(answer(sock), 431, "over 2048 bytes")
    with connect(srv) as sock:  # never ends: refused once past the limit, not when it ends
        sock.sendall(head("/health", b"X-Big: " + b"a" * 3000, b"GET"))
        assert_refused(answer(sock), 431, "over 2048 bytes")


def test_a_client_that_dribbles_its_headers_or_its_body_is_cut_off(srv):
    with connect(srv) as sock:  # one header line every 0.3 s: the headers take longer than 1 s
        sock.sendall(head("/health", method=b"GET"))
        with pytest.raises(OSError):  # (the server closes the connection: a write fails)
            for i in range(int(READ / 0.3)):
                sock.sendall(b"X-Slow-%d: v\r\n" % i)
                time.sleep(0.3)
        assert_refused(answer(sock), 408, "headers did not arrive within 1 s")
    with connect(srv) as sock:  # the headers, then 2 of the 50 bytes it announced
        sock.sendall(head(extra=b'Content-Length: 50\r\n\r\n{"'))
        assert_refused(answer(sock), 408, "body did not arrive within 1 s")
    with connect(srv) as sock:  # nothing at all: closed without an answer
        assert sock.recv(100) == b""


def test_connections_past_the_cap_get_503_and_slowloris_cannot_take_the_slots():
    with serve("tiny-gpt2", port=0, verbose=False, max_connections=3, body_timeout=30.0) as s:
        health = head("/health", b"Connection: close\r\n\r\n", b"GET")
        # three connections hold a request in progress (headers in, body awaited)
        busy = [connect(s) for _ in range(3)]
        for sock in busy:
            sock.sendall(head(extra=b"Content-Length: 10\r\n\r\n"))
        time.sleep(0.5)  # (the server has read their headers)
        for _ in range(3):  # every newcomer gets a 503 at once, /health's too
            with connect(s) as sock:
                sock.sendall(health)
                assert_refused(answer(sock), 503, "connection limit (3 connections")
        for sock in busy:
            sock.close()
        # three connections that only ever send half their headers (slowloris): each newcomer
        # closes the oldest of them, so /health answers
        slow = [connect(s) for _ in range(3)]
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.5)
        for _ in range(3):
            with connect(s) as sock:
                sock.sendall(health)
                assert answer(sock) == (200, None)
        for sock in slow:
            sock.close()


def test_a_bad_limit_is_refused_before_the_model_loads():
    from pagedlearn.serve.limits import LimitError

    for bad in (dict(max_body_bytes=0), dict(header_timeout=-1.0), dict(max_connections=True)):
        with pytest.raises(LimitError, match=next(iter(bad))):
            serve("no-such-model", port=0, **bad)


# --- the defaults ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    with serve("smollm2", port=0, verbose=False) as s:  # every limit at its default
        yield s


def test_defaults_refuse_a_50_mb_body_at_once_and_serve_a_normal_request(smollm2):
    with connect(smollm2) as sock:
        sock.sendall(head(extra=b"Content-Length: 50000000\r\n\r\n"))
        assert_refused(answer(sock), 413, "more than the server takes: 16777216")
    with httpx.Client(base_url=smollm2.base_url, timeout=READ * 6) as http:
        r = http.post("/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = http.post("/completions", json={"prompt": list(range(100)), "max_tokens": 2})
        assert r.status_code == 200, r.text


def longest_prompt(srv) -> int:
    """The most characters a text prompt may have before it is tokenized (protocol.py)."""
    per_token = max_chars_per_token(srv.engine.tokenizer)
    return srv.max_model_len * per_token * PROMPT_CHARS_MARGIN


def test_a_prompt_longer_than_the_context_can_hold_is_refused_untokenized(smollm2):
    prompt = "hello world " * (longest_prompt(smollm2) // 12 + 1)
    with httpx.Client(base_url=smollm2.base_url, timeout=READ * 6) as http:
        r = http.post("/completions", json={"prompt": prompt, "max_tokens": 1})
        assert_refused((r.status_code, r.json()), 400, "it was not tokenized")
        chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
        r = http.post("/chat/completions", json=chat)
        assert_refused((r.status_code, r.json()), 400, "it was not tokenized")


def test_health_answers_while_a_long_prompt_is_tokenized(smollm2):
    # As long as a prompt may be before it is tokenized, in characters that are three bytes
    # each in UTF-8 (about 2.7 tokens each in SmolLM2's tokenizer): seconds to tokenize
    rng = random.Random(0)
    prompt = "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(longest_prompt(smollm2)))
    result = {}

    def big() -> None:
        r = httpx.post(smollm2.base_url + "/completions", timeout=READ * 12,
                       json={"prompt": prompt, "max_tokens": 1})  # fmt: skip
        result.update(status=r.status_code, done=time.monotonic())

    thread = threading.Thread(target=big)
    thread.start()
    answered = []  # when each /health answered
    with httpx.Client(timeout=READ * 12) as http:
        while thread.is_alive():
            assert http.get(smollm2.url + "/health").status_code == 200
            answered.append(time.monotonic())
            time.sleep(0.02)
    thread.join()
    assert result["status"] == 400  # far longer than the context: refused, after tokenizing
    # On the event loop, tokenizing stalls every /health until the 400 is out (at most one
    # could answer while the body was still on its way); on a worker thread they go on.
    assert sum(t < result["done"] for t in answered) >= 5, len(answered)


def test_serve_help_lists_every_limit():
    out = subprocess.run([sys.executable, "-m", "pagedlearn", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    text = " ".join(out.split())  # (argparse wraps lines)
    for flag, says in [
        ("--max-body-bytes", "default: 16777216 = 16 MiB"),
        ("--max-header-bytes", "default: 16384 = 16 KiB"),
        ("--max-headers", "default: 100"),
        ("--header-timeout", "default: 10"),
        ("--body-timeout", "default: 60"),
        ("--max-connections", "default: 1024, or fewer"),
    ]:
        assert flag in text and says in text, (flag, says)
