"""Every bad request gets its 4xx in OpenAI's error shape, and the server goes on serving.

One server on tiny-gpt2 with an API key and a small pool (8 blocks of 16 tokens: 128 tokens,
less than the model's context of 512, so the server serves a context of 128). Each bad body is
sent as raw bytes (what a broken client sends), then a good request must still succeed on the
same connection (a 500 that Starlette raises again makes uvicorn close it). Then the API key,
the ``openai`` client's typed errors, a bug in the server (a JSON 500, logged once), and the
engine's faults: a step that raises once (the request still completes), a request the engine
gives up on (500), a broken engine (503). Then the command line.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from helpers import assert_error, assert_serves, serve_command  # noqa: E402

from pagedlearn.serve import serve  # noqa: E402

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def srv():
    with serve("tiny-gpt2", port=0, api_key=KEY, verbose=False, block_size=16, num_blocks=8) as s:
        yield s


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=TIMEOUT) as h:
        yield h


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0, timeout=TIMEOUT)


COMPLETIONS = [  # (body, status, param, words in the message)
    (b"", 400, None, "empty"),
    (b"{", 400, None, "not valid JSON"),
    (b"[]", 400, None, "JSON object"),
    (b'{"prompt": "x", "model": "nope"}', 404, "model", "does not exist"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens", "at least 1"),
    # the context served is what the pool holds: 8 x 16 = 128 tokens (the model's: 512)
    ({"prompt": "x", "max_tokens": 600}, 400, "max_tokens", "maximum context length is 128"),
    ({"prompt": "x", "max_tokens": 128}, 400, "max_tokens", "129 tokens (1 in the prompt"),
    ({"prompt": "y" * 200}, 400, "prompt", "200 input tokens, which exceeds this limit even"),
    ({"prompt": "y" * 128}, 400, "prompt", "128 input tokens, which leaves no room"),
    # samples that the pool could never hold at once: 2 x 8 blocks less 6 shared, 20 x 1
    ({"prompt": "y" * 100, "max_tokens": 20, "n": 2}, 400, "n", "needs 10 blocks of 16 tokens"),
    ({"prompt": "y" * 10, "max_tokens": 8, "n": 20}, 400, "n", "more than the whole pool of 8"),
    ({"prompt": "x", "foo": 1}, 400, "foo", "unknown field 'foo'"),
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ({"prompt": "x", "logit_bias": {"65": 5}}, 400, "logit_bias", "not supported"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of", "not supported"),
    ({"prompt": "x", "echo": True}, 400, "echo", "not supported"),
    ({"prompt": "x", "suffix": "!"}, 400, "suffix", "not supported"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature", "valid number"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature", ">= 0"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "temperature", "finite"),
    (b'{"prompt": "x", "temperature": Infinity}', 400, "temperature", "finite"),
    ({"prompt": "x", "seed": 2**64}, 400, "seed", "[0, 2**63 - 1]"),
    ({"prompt": "x", "seed": 2**63}, 400, "seed", "[0, 2**63 - 1]"),
    # a lone surrogate (JSON's "\ud800", json.dumps' escape): no tokenizer can encode it
    ({"prompt": "a\ud800"}, 400, "prompt", "lone surrogate"),
    ({"prompt": "x", "stop": ["\udfff"]}, 400, "stop.0", "lone surrogate"),
    ({"prompt": "x", "model": "\ud800"}, 404, "model", "does not exist"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"prompt": "x", "n": 0}, 400, "n", ">= 1"),
    ({"prompt": "x", "n": 100}, 400, "n", "whole pool"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    ({"prompt": "x", "cache_salt": ""}, 400, "cache_salt", "non-empty"),
    ({"prompt": "x", "cache_salt": "s" * 129}, 400, "cache_salt", "at most 128 characters"),
    ({"prompt": "x", "cache_salt": "a/b"}, 400, "cache_salt", "must not contain '@'"),
    ({"prompt": "x", "cache_salt": "a\x00"}, 400, "cache_salt", "or NUL"),
    ({"prompt": "x", "cache_salt": 123}, 400, "cache_salt", "valid string"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ({"prompt": [1, 2, 999]}, 400, "prompt", "outside the vocabulary"),
    ({"prompt": ""}, 400, "prompt", "empty prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ({"prompt": 5}, 400, "prompt", "valid string"),
    ({"max_tokens": 5}, 400, "prompt", "required"),
]
CHAT = [
    ({"messages": []}, 400, "messages", "at least 1"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", "'user'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, ..., ""),
    ({"top_logprobs": 2}, 400, "top_logprobs", "`logprobs` must be set"),
    ({"tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format", "not supported"),
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens", "at least 1"),
    ({"logprobs": True, "top_logprobs": 30}, 400, "top_logprobs", "[0, 20]"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages.0.content", "surrogate"),
    (
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "user", "content": [{"type": "text", "text": "x\udc00"}]},
            ]
        },
        400,
        "messages.1.content.0.text",
        "lone surrogate",
    ),
    ({"max_tokens": None, "n": 9}, 400, "n", "whole pool of 8"),
]


@pytest.mark.parametrize("body, status, param, says", COMPLETIONS)
def test_bad_completion_bodies(http, body, status, param, says):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    assert_error(
        http.post("/v1/completions", content=content, headers=headers), status, param, says
    )
    assert_serves(http)


@pytest.mark.parametrize("body, status, param, says", CHAT)
def test_bad_chat_bodies(http, body, status, param, says):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body}
    content = json.dumps(body).encode()  # (httpx's json= cannot write a lone surrogate)
    headers = {"Content-Type": "application/json"}
    r = http.post("/v1/chat/completions", content=content, headers=headers)
    assert_error(r, status, param, says)
    assert_serves(http)


def test_a_body_without_a_json_content_type_is_a_400_that_says_so(http):
    content = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    for headers in ({"Content-Type": ""}, {"Content-Type": "text/plain"}):
        r = http.post("/v1/completions", content=content, headers=headers)
        assert_error(r, 400, None, "'Content-Type: application/json'")
    json_ish = {"Content-Type": "application/json; charset=utf-8"}
    assert http.post("/v1/completions", content=content, headers=json_ish).status_code == 200


def test_the_served_context_is_what_the_pool_holds(srv, http):
    assert srv.max_model_len == 8 * 16 < srv.engine.max_model_len == 512
    (card,) = http.get("/v1/models").json()["data"]
    assert card["max_model_len"] == 128
    # chat's default max_tokens: the rest of the served context (the model's would never fit)
    body = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 128
    # samples that fit at once only because they share the prompt's 6 whole blocks: 2 x 7 - 6
    body = {"prompt": "y" * 100, "max_tokens": 4, "n": 2, "temperature": 1, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
    assert srv.call(pool_clean)


def test_neutral_values_of_unsupported_fields_are_accepted(http):
    body = {"prompt": "Hi", "max_tokens": 2, "presence_penalty": 0, "frequency_penalty": 0.0}
    body.update(logit_bias={}, echo=False, best_of=1, n=1, suffix=None, user="someone")
    assert http.post("/v1/completions", json=body).status_code == 200
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    chat.update(max_tokens=2, tools=[], tool_choice="none", response_format={"type": "text"})
    assert http.post("/v1/chat/completions", json=chat).status_code == 200


def test_unknown_routes_and_methods(http):
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_api_key(srv, http):
    body = {"prompt": "Hi", "max_tokens": 2}
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as anonymous:
        assert_error(anonymous.post("/v1/completions", json=body), 401, None, "API key")
        wrong = {"Authorization": "Bearer not-the-key"}
        assert_error(anonymous.get("/v1/models", headers=wrong), 401)
        # checked before the body is read: a bad body without a key is still a 401
        assert_error(anonymous.post("/v1/completions", content=b"{"), 401)
        assert anonymous.get("/health").status_code == 200  # open, as in vLLM
        assert anonymous.get("/metrics").status_code == 401  # guarded (middleware.py: why)
    bad = openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=srv.model_name, prompt="Hi", max_tokens=2)
    assert_serves(http)


def test_the_openai_client_gets_typed_errors(srv, client):
    def create(**kw):
        args = {"model": srv.model_name, "prompt": "Hi", "max_tokens": 4, **kw}
        return client.completions.create(**args)

    with pytest.raises(openai.BadRequestError, match="maximum context length is 128"):
        create(max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="at least 1"):
        create(max_tokens=0, stream=True)  # refused before the stream starts
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        create(model="gpt-4")
    with pytest.raises(openai.BadRequestError, match="the whole pool"):
        create(n=9, temperature=1, stream=True)
    assert create().choices[0].finish_reason in ("length", "stop")


def test_a_bug_in_the_server_is_a_json_500_logged_once_and_the_connection_stays(srv, caplog):
    uvicorn_said = []
    catch = logging.Handler()
    catch.emit = lambda record: uvicorn_said.append(record.getMessage())
    logging.getLogger("uvicorn.error").addHandler(catch)

    def add_request(*args, **kwargs):
        raise RuntimeError("an injected bug")

    srv.call(lambda engine: setattr(engine, "add_request", add_request))
    try:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=TIMEOUT) as one:
            with caplog.at_level(logging.ERROR, logger="pagedlearn.serve"):
                r = one.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert_error(r, 500, None, "RuntimeError: an injected bug")
            srv.call(lambda engine: vars(engine).pop("add_request"))
            port = r.extensions["network_stream"].get_extra_info("client_addr")
            assert_serves(one)  # on the same connection: it was not closed
            again = one.get("/v1/models")
            assert again.extensions["network_stream"].get_extra_info("client_addr") == port
    finally:
        srv.call(lambda engine: vars(engine).pop("add_request", None))
        logging.getLogger("uvicorn.error").removeHandler(catch)
    logged = [rec for rec in caplog.records if rec.name == "pagedlearn.serve"]
    assert len(logged) == 1 and "an injected bug" in str(logged[0].exc_info[1])
    assert not any("Exception in ASGI application" in m for m in uvicorn_said), uvicorn_said


def pool_clean(engine) -> bool:
    return not engine.requests and engine.kv.stats()["used_blocks"] == 0


def inject_faults(srv, times: int):
    """Make the next ``times`` forwards raise (on the engine thread); returns a function that
    takes the fault away."""

    def patch(engine):
        runner, left = engine.runner, [times]
        real = runner.execute

        def execute(batch):
            if left[0] > 0:
                left[0] -= 1
                raise RuntimeError("injected fault")
            return real(batch)

        runner.execute = execute  # an instance attribute: del gives the class's method back

    srv.call(patch)
    return lambda: srv.call(lambda engine: vars(engine.runner).pop("execute", None))


def test_the_engine_loop_survives_a_step_that_raises(srv, http):
    body = {"prompt": "Fault", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    clean = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    undo = inject_faults(srv, 1)
    try:
        r = http.post("/v1/completions", json=body)  # its step raised; recovery re-queued it
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == clean
        assert srv.call(lambda e: e.last_recovery.requeued) != []
        stream = {**body, "stream": True}
        with http.stream("POST", "/v1/completions", json=stream) as s:
            assert s.status_code == 200 and list(s.iter_lines())[-2] == "data: [DONE]"
    finally:
        undo()
    assert http.get("/health").status_code == 200
    assert srv.call(pool_clean)


def test_a_request_the_engine_gives_up_on_is_a_500(srv, http):
    undo = inject_faults(srv, 100)  # every forward raises: the request fails after MAX_FAULTS
    try:
        body = {"prompt": "Doomed", "max_tokens": 4}
        assert_error(http.post("/v1/completions", json=body), 500, None, "failed")
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            lines = [x for x in s.iter_lines() if x]
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == 500
        assert lines[-1] == "data: [DONE]"
    finally:
        undo()
    assert srv.call(pool_clean)
    assert_serves(http)


def slow_steps(srv, seconds: float):
    """Make every step slower (a stats subscriber on the engine thread); returns the undo."""
    unsubscribe = srv.call(lambda e: e.subscribe_stats(lambda stats: time.sleep(seconds)))
    return lambda: srv.call(lambda e: unsubscribe())


def stream_until_first_token(http, body: dict):
    """Open a stream of ``body``; returns (its response, its lines) once a token came."""
    request = http.build_request("POST", "/v1/completions", json={**body, "stream": True})
    r = http.send(request, stream=True)  # (the caller closes it: last_events)
    lines = r.iter_lines()
    assert r.status_code == 200 and next(x for x in lines if x).startswith("data: ")
    return r, lines


def last_events(r, lines) -> tuple[dict, str]:
    rest = [x for x in lines if x]
    r.close()
    return json.loads(rest[-2].removeprefix("data: ")), rest[-1]


LONG = {"prompt": "Hi", "max_tokens": 120, "ignore_eos": True}  # (the served context: 128)


def test_a_request_aborted_by_a_call_ends_its_stream(srv, http):
    undo = slow_steps(srv, 0.005)
    try:
        r, lines = stream_until_first_token(http, LONG)
        srv.call(lambda e: [e.abort_request(rid) for rid in list(e.requests)])
        event, done = last_events(r, lines)
        assert event["error"]["code"] == 500 and "aborted" in event["error"]["message"]
        assert done == "data: [DONE]"
    finally:
        undo()
    assert srv.call(pool_clean)
    assert_serves(http)


def test_a_broken_engine_answers_503(srv, http):
    undo = slow_steps(srv, 0.005)
    r, lines = stream_until_first_token(http, LONG)
    srv.call(lambda e: setattr(e, "broken", "a test broke it"))
    try:
        event, _ = last_events(r, lines)  # the stream in flight ends with the reason
        assert event["error"]["code"] == 503 and "a test broke it" in event["error"]["message"]
        err = assert_error(http.post("/v1/completions", json={"prompt": "x"}), 503)
        assert "a test broke it" in err["message"] and err["type"] == "ServiceUnavailableError"
        assert_error(http.get("/health"), 503, None, "broken")
    finally:
        srv.call(lambda e: setattr(e, "broken", None))
        srv.call(lambda e: [e.abort_request(rid) for rid in list(e.requests)])
        undo()
    assert http.get("/health").status_code == 200
    assert_serves(http)


def test_without_the_web_stack_the_error_says_what_to_install(monkeypatch):
    from pagedlearn.serve import ServeUnavailableError

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # what `import uvicorn` finds: nothing
    with pytest.raises(ServeUnavailableError, match=r'pip install "pagedlearn\[serve\]"'):
        serve("tiny-gpt2", port=0)


def serve_parser():
    from pagedlearn.__main__ import build_parser

    return build_parser()[1]["serve"]


def test_command_line_options(monkeypatch):
    monkeypatch.setenv("PAGEDLEARN_API_KEY", "from-env-secret")
    parser = serve_parser()
    assert "from-env-secret" not in parser.format_help()  # --help never shows the key
    args = parser.parse_args([])
    assert (args.model, args.host, args.port, args.api_key) == (
        "smollm2",  # the real model by default
        "127.0.0.1",
        8000,
        None,
    )  # fmt: skip  (cli() reads $PAGEDLEARN_API_KEY)
    args = parser.parse_args(["--port", "0", "--backend", "reference", "--no-prefix-caching"])
    assert args.port == 0 and args.backend == "reference" and args.no_prefix_caching
    for bad in (["--port", "70000"], ["--num-blocks", "0"], ["--preemption-mode", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_a_block_longer_than_the_context_is_refused_as_the_demo_does(capsys, monkeypatch):
    from pagedlearn.__main__ import main
    from pagedlearn.cli.demo import OptionError
    from pagedlearn.serve import ServerHandle

    def interrupted(self):  # a server that started after all stops at once (no hang)
        raise KeyboardInterrupt

    monkeypatch.setattr(ServerHandle, "wait", interrupted)

    for command in ("serve", "demo"):  # the same options, the same error, exit 2
        with pytest.raises(SystemExit) as e:
            main([command, "--model", "tiny-gpt2", "--block-size", "100000"])
        assert e.value.code == 2
        assert "--block-size: must be at most 4096" in capsys.readouterr().err
        port = ["--port", "0"] if command == "serve" else []
        with pytest.raises(SystemExit) as e:
            main([command, "--model", "tiny-gpt2", "--block-size", "1000", *port])
        assert e.value.code == 2
        assert "block_size 1000 is more than tiny-gpt2's context of 512" in capsys.readouterr().err
    with pytest.raises(OptionError, match="a block that long could never fill"):
        serve("tiny-gpt2", port=0, block_size=1000, verbose=False)


def test_a_port_in_use_is_said_in_words_for_python_too():
    from pagedlearn.errors import PagedLearnError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(PagedLearnError, match="pick another port") as e:
            serve("tiny-gpt2", port=port, verbose=False)
    assert "--port" not in str(e.value)


def test_serve_stops_on_sigterm_and_says_its_context(tmp_path):
    """``python -m pagedlearn serve`` in a subprocess (its SIGINT ignored, as for ``serve &``
    in a script): it says the context it serves, takes the key from $PAGEDLEARN_API_KEY, and
    SIGTERM stops it as Ctrl-C does (exit 0)."""
    env = {**os.environ, "PAGEDLEARN_API_KEY": "env-key"}
    args = ["--model", "tiny-gpt2", "--port", "0", "--num-blocks", "4"]
    ignore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731
    with serve_command(args, env, preexec_fn=ignore_sigint) as (proc, lines):
        said = "".join(lines)
        assert "serving a context of 64 tokens, what the pool holds (4 blocks x 16" in said
        url = said.split(" at ", 1)[1].split()[0]
        assert httpx.get(url + "/models", timeout=TIMEOUT).status_code == 401
        models = httpx.get(url + "/models", headers={"Authorization": "Bearer env-key"})
        assert models.json()["data"][0]["max_model_len"] == 64
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "pagedlearn: stopping" in out and "Traceback" not in out
