"""Strict JSON types, one surrogate rule for every string, and errors that quote a bounded prefix.

One server on tiny-gpt2 (a small pool: 8 blocks of 16 tokens), without a key. Each bad body is
sent as raw bytes and must get a 400 in OpenAI's shape that names its field: an integer field
takes no ``"4"``, ``true`` or ``4.0``, a token id is an int in the vocabulary, and a lone
surrogate is refused in every string field, not only the prompt and the messages' content. Then
the bodies whose 400 used to quote the whole rejected value (10 MB of stop strings, 500,000
``logit_bias`` keys): the error stays small. What clients do send (``"temperature": 1``, an int
where OpenAI takes a number) still works.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from helpers import assert_error, assert_serves  # noqa: E402

from pagedlearn.serve import serve  # noqa: E402
from pagedlearn.serve.middleware import clip, preview  # noqa: E402

TIMEOUT = 60.0
MAX_ERROR_BYTES = 4096  # a generous bound: the point is "not megabytes", not an exact size


@pytest.fixture(scope="module")
def srv():
    with serve("tiny-gpt2", port=0, verbose=False, block_size=16, num_blocks=8) as s:
        yield s


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as h:
        yield h


def post(http, path: str, body: dict) -> httpx.Response:
    content = json.dumps(body).encode()  # (httpx's json= cannot write a lone surrogate)
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


def assert_400(r, param: str, says: str = "") -> dict:
    """OpenAI's error shape, status 400, naming ``param`` (the field or a path inside it)."""
    return assert_error(r, 400, param, says, inside=True)


LENIENT = [  # (body, the field named, words in the message): each was accepted before
    ({"max_tokens": "4"}, "max_tokens", "valid integer"),
    ({"max_tokens": True}, "max_tokens", "valid integer"),
    ({"max_tokens": 4.0}, "max_tokens", "valid integer"),
    ({"n": 1.0}, "n", "valid integer"),
    ({"seed": "7"}, "seed", "valid integer"),
    ({"stream": "true"}, "stream", "valid boolean"),
    ({"ignore_eos": 1}, "ignore_eos", "valid boolean"),
    ({"temperature": True}, "temperature", "valid number"),
    ({"prompt": [1.0, 2.0]}, "prompt", "item 0 is 1.0"),
    ({"prompt": [True, False]}, "prompt", "item 0 is True"),
    ({"prompt": [[1, -2]]}, "prompt", "token ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "greater than or equal to 0"),
    ({"stop_token_ids": [5, 10**12]}, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": [True]}, "stop_token_ids", "valid integer"),
]


@pytest.mark.parametrize("fields, param, says", LENIENT)
def test_integers_are_json_integers_and_token_ids_are_in_the_vocabulary(http, fields, param, says):
    body = {"prompt": "Hi", "max_tokens": 2, **fields}
    assert_400(post(http, "/v1/completions", body), param, says)
    assert_serves(http)


def test_what_clients_send_is_still_accepted(http, srv):
    vocab = srv.engine.model.config.vocab_size
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 1, "top_p": 1, "seed": 3}
    body.update(stop_token_ids=[0, vocab - 1], stream=False, n=1, presence_penalty=0)
    assert post(http, "/v1/completions", body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "Hi", "name": "ann"}], "max_tokens": 2}
    chat.update(temperature=0, user="someone", cache_salt="s1", stop=["\n"], logprobs=False)
    assert post(http, "/v1/chat/completions", chat).status_code == 200


SURROGATES = [  # (endpoint, fields, the field named): lone surrogates the server used to take
    ("/v1/completions", {"cache_salt": "salt\ud800"}, "cache_salt"),
    ("/v1/completions", {"user": "\udfffx"}, "user"),
    ("/v1/completions", {"stop": ["ok", "\ud800"]}, "stop.1"),
    ("/v1/completions", {"logit_bias": {"\ud800": 0}}, "logit_bias"),
    ("/v1/chat/completions", {"user": "a\udc00"}, "user"),
    ("/v1/chat/completions", {"cache_salt": "\ud800"}, "cache_salt"),
]


@pytest.mark.parametrize("path, fields, param", SURROGATES)
def test_a_lone_surrogate_is_refused_in_every_string_field(http, path, fields, param):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}
    else:
        body = {"prompt": "Hi", "max_tokens": 2, **fields}
    err = assert_400(post(http, path, body), param, "lone surrogate")
    assert err["param"] == param
    assert_serves(http)


def test_a_lone_surrogate_in_a_messages_name_is_refused(http):
    messages = [{"role": "system", "content": "Be brief."}]
    messages.append({"role": "user", "content": "Hi", "name": "b\ud800b"})
    r = post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert assert_400(r, "messages.1.name", "lone surrogate")["param"] == "messages.1.name"


def test_an_error_quotes_a_bounded_prefix_of_the_rejected_value(http):
    """The issue's rows: 1,000 stop strings of 10 kB (one of them empty) made a 10 MB error
    body; ``logit_bias`` with 500,000 keys, 8.5 MB. Now each is a few hundred bytes."""
    stop = ["x" * 10_000] * 999 + [""]
    r = post(http, "/v1/completions", {"prompt": "Hi", "stop": stop})
    assert_400(r, "stop", "empty")
    assert len(r.content) < MAX_ERROR_BYTES, len(r.content)

    bias = {str(i): 1.0 for i in range(500_000)}
    r = post(http, "/v1/completions", {"prompt": "Hi", "logit_bias": bias})
    err = assert_400(r, "logit_bias", "not supported")
    assert len(r.content) < MAX_ERROR_BYTES, len(r.content)
    assert "{'0': 1.0, '1': 1.0" in err["message"] and "(500,000 items)" in err["message"]

    # a field name is the client's too: an unknown one of 1 MB is quoted in part
    r = post(http, "/v1/completions", {"prompt": "Hi", "k" * 1_000_000: 1})
    assert r.status_code == 400 and len(r.content) < MAX_ERROR_BYTES, len(r.content)
    r = post(http, "/v1/completions", {"prompt": "Hi", "max_tokens": "9" * 1_000_000})
    assert_400(r, "max_tokens", "valid integer")
    assert len(r.content) < MAX_ERROR_BYTES, len(r.content)
    assert_serves(http)


def test_preview_and_clip_bound_what_they_quote():
    assert preview("abc") == "'abc'" and preview([1, {"a": None}]) == "[1, {'a': None}]"
    long = preview("x" * 10**6)
    assert long.startswith("'xxx") and long.endswith("... (1,000,000 characters)")
    assert len(long) < 120
    assert preview(10**1000) == "<an int of 3322 bits>"
    deep: list = []
    for _ in range(10_000):  # deeper than Python's recursion limit: no RecursionError
        deep = [deep]
    assert preview(deep).startswith("[[[[")
    assert clip("m" * 10) == "m" * 10
    assert clip("m" * 10**6, 100) == "m" * 100 + "... (message cut: 1,000,000 characters)"
