"""Auth that cannot be half-configured.

A key that no client could send (empty, blank, whitespace at an end, not printable ASCII) is
refused at start, by ``serve()`` and by the command line, before any model is loaded. With a
key, every route but ``/health`` wants it: ``/v1/*``, ``/metrics`` and the docs (against a real
server on 127.0.0.1). The key can come from a file or ``$PAGEDLEARN_API_KEY``, out of ``ps``.
A server on an address other than loopback without a key says the risk, and its startup line
says the address it listens on.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from helpers import serve_command  # noqa: E402

from pagedlearn.serve import serve  # noqa: E402
from pagedlearn.serve.auth import (  # noqa: E402
    ApiKeyError,
    check_api_key,
    exposure_warning,
    listen_line,
    resolve_api_key,
)

KEY = "sekret-key"
TIMEOUT = 30.0
BAD_KEYS = [  # (key, words in the error)
    ("", "empty"),
    (" ", "blank"),
    ("\t\n", "blank"),
    (" key", "whitespace"),
    ("key\n", "whitespace"),
    ("k\u00e9y", "printable ASCII"),
    ("a\x00b", "printable ASCII"),
]


def serve_parser():
    from pagedlearn.__main__ import build_parser

    return build_parser()[1]["serve"]


def run_cli(args: list[str], env: dict | None = None, timeout: float = 60) -> tuple[int, str]:
    """``python -m pagedlearn serve ARGS``: its exit code and what it said. (60 s: it must exit
    before loading a model; the code before this fix served instead, and is killed here.)"""
    command = [sys.executable, "-m", "pagedlearn", "serve", "--model", "tiny-gpt2", *args]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"serve {args} kept running: {e.stdout!r} {e.stderr!r}")
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("key, says", BAD_KEYS)
def test_a_key_no_client_could_send_is_refused(key, says):
    with pytest.raises(ApiKeyError, match=says):
        check_api_key(key)
    with pytest.raises(ApiKeyError) as e:
        check_api_key(" " + KEY)
    assert KEY not in str(e.value)  # a message never quotes the key
    assert check_api_key(KEY) == KEY and check_api_key(None) is None


@pytest.mark.parametrize("key", ["", " "])
def test_serve_refuses_an_empty_or_blank_key_before_it_starts(key):
    with pytest.raises(ApiKeyError, match=r"empty|blank"):
        srv = serve("tiny-gpt2", port=0, api_key=key, verbose=False, num_blocks=4)
        srv.stop()  # (the code before this fix served: open for "", locked for " ")


def test_the_command_line_refuses_an_empty_key_before_loading_a_model():
    code, said = run_cli(["--port", "0", "--api-key", ""])
    assert code == 2 and "--api-key" in said and "empty" in said, said
    assert "Traceback" not in said


def test_a_blank_key_in_the_environment_is_refused(monkeypatch, capsys):
    from pagedlearn.__main__ import main
    from pagedlearn.serve import ServerHandle

    def interrupted(self):  # (the code before this fix served, locked: stop it at once)
        raise KeyboardInterrupt

    monkeypatch.setattr(ServerHandle, "wait", interrupted)
    for value in (" ", ""):
        monkeypatch.setenv("PAGEDLEARN_API_KEY", value)
        assert main(["serve", "--model", "tiny-gpt2", "--port", "0", "--num-blocks", "4"]) == 1
        err = capsys.readouterr().err
        assert "$PAGEDLEARN_API_KEY is" in err and ("blank" in err or "empty" in err), err


def test_the_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    parser = serve_parser()
    monkeypatch.delenv("PAGEDLEARN_API_KEY", raising=False)
    assert resolve_api_key(parser.parse_args([])) is None
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")  # (echo KEY > file writes a line end: dropped)
    assert resolve_api_key(parser.parse_args(["--api-key-file", str(key_file)])) == KEY
    monkeypatch.setenv("PAGEDLEARN_API_KEY", "from-env")
    assert resolve_api_key(parser.parse_args([])) == "from-env"
    assert resolve_api_key(parser.parse_args(["--api-key", "flag"])) == "flag"
    key_file.write_text("  \n")
    bad_args = [
        ["--api-key-file", str(key_file)],  # blank
        ["--api-key-file", str(tmp_path / "none")],  # no such file
        ["--api-key", "a", "--api-key-file", str(key_file)],  # one or the other
        ["--api-key", " "],
    ]
    for bad in bad_args:
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    help_text = " ".join(parser.format_help().split())
    assert "ps" in help_text and "--api-key-file" in help_text and "from-env" not in help_text


def test_a_network_address_without_a_key_is_warned_about():
    warning = exposure_warning("0.0.0.0", None, 8000)
    assert "without an API key" in warning and "anyone who can reach port 8000" in warning
    assert "run the model" in warning and "/metrics" in warning
    assert exposure_warning("::", None) and exposure_warning("192.168.1.7", None)
    assert exposure_warning("my-host.example", None)  # (a name may resolve to anything)
    for local in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert exposure_warning(local, None) is None
    assert exposure_warning("0.0.0.0", KEY) is None
    line = listen_line("0.0.0.0", 8000, "tiny-gpt2")
    assert "http://0.0.0.0:8000/v1" in line and "http://127.0.0.1:8000/v1" in line
    assert " at http://127.0.0.1:8000/v1 " in listen_line("127.0.0.1", 8000, "m")
    assert "http://[::]:8000/v1" in listen_line("::", 8000)


def test_serving_on_every_address_without_a_key_warns_and_says_where(tmp_path):
    """The command line on 0.0.0.0 (stopped as soon as it listens): the warning on stderr, and
    the startup line names 0.0.0.0, the address it bound."""
    args = ["--model", "tiny-gpt2", "--host", "0.0.0.0", "--port", "0", "--num-blocks", "4"]
    env = {k: v for k, v in os.environ.items() if k != "PAGEDLEARN_API_KEY"}
    with serve_command(args, env) as (_, lines):
        pass  # (stopped as soon as it listens)
    said = "".join(lines)
    assert "WARNING" in said and "anyone who can reach port" in said, said
    assert " at http://0.0.0.0:" in said, said


@pytest.fixture(scope="module")
def srv():
    with serve("tiny-gpt2", port=0, api_key=KEY, verbose=False, num_blocks=8) as s:
        yield s


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models"])
def test_every_route_but_health_follows_the_key(srv, path):
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as anonymous:
        r = anonymous.get(path)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "AuthenticationError"
        assert r.headers["www-authenticate"] == "Bearer"
        assert anonymous.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert anonymous.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_health_stays_open_and_an_unknown_path_wants_the_key(srv):
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as anonymous:
        assert anonymous.get("/health").status_code == 200  # load balancers send no key
        assert anonymous.get("/no-such-route").status_code == 401  # deny by default
        auth = {"Authorization": f"Bearer {KEY}"}
        assert anonymous.get("/no-such-route", headers=auth).status_code == 404
