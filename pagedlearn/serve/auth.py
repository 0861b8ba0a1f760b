"""Who may use the server: the API key, where it comes from, what it may be, and the warning a
server open to the network gives.

With a key, every route but ``/health`` answers 401 unless the request carries
``Authorization: Bearer <key>`` (:class:`~pagedlearn.serve.middleware.ApiKeyMiddleware`). Without
one, anyone who can reach the port can run the model: fine on 127.0.0.1 (the default host), a
risk on any other address, which :func:`exposure_warning` says at start.

A key that cannot work is refused at start (:func:`check_api_key`, in ``serve()`` and on the
command line), never served half-configured:

- empty (``--api-key ""``, or ``PAGEDLEARN_API_KEY=`` from a variable that was not set): it
  looked like a key and left ``/v1`` open;
- blank, or with whitespace at either end (``PAGEDLEARN_API_KEY=" "``): HTTP drops whitespace
  around a header's value, so no client could ever send it and everyone got 401. pagedlearn
  refuses such a key rather than trimming it, so the key the server checks is the one the
  operator wrote; the one exception is the line end of a key file (``echo KEY > file`` writes
  one), which :func:`read_api_key_file` drops;
- a character that is not printable ASCII: a header is ASCII in practice (``httpx`` refuses to
  send anything else), so no client could send it either.

The key comes from ``--api-key-file PATH``, ``$PAGEDLEARN_API_KEY`` or ``--api-key KEY``. The
first two keep it out of ``ps`` and the shell's history; ``--api-key KEY`` is in both, for anyone
on the machine to read (``--help`` says so). No message ever quotes the key.
"""

from __future__ import annotations

import argparse
import ipaddress
import os

from pagedlearn.errors import PagedLearnError

ENV_VAR = "PAGEDLEARN_API_KEY"
MAX_KEY_FILE_BYTES = 4096  # a key file holds one line; anything longer is the wrong file


class ApiKeyError(PagedLearnError, ValueError):
    """An API key the server cannot work with (empty, blank, unsendable, an unreadable file)."""


def check_api_key(key: str | None, source: str = "api_key") -> str | None:
    """``key`` (None: no key) if a client could send it as ``Authorization: Bearer <key>``; else
    :class:`ApiKeyError`, naming ``source`` (never the key)."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise ApiKeyError(f"{source} must be a string, got {type(key).__name__}")
    if not key:
        raise ApiKeyError(
            f"{source} is empty: an empty key would leave the server open while it looks "
            "protected; give a key, or none at all to serve without one"
        )
    if not key.strip():
        raise ApiKeyError(
            f"{source} is blank (only whitespace): no client could send it, since HTTP drops "
            "the whitespace around a header's value, so every request would get 401"
        )
    if key != key.strip():
        raise ApiKeyError(
            f"{source} starts or ends with whitespace: HTTP drops it from a header's value, so no "
            "client could send this key; remove the whitespace (a key file's line end is fine)"
        )
    for i, c in enumerate(key):
        if not " " <= c <= "~":
            raise ApiKeyError(
                f"{source} holds a character that is not printable ASCII (at position {i}): an "
                "HTTP header cannot carry it, so no client could send this key"
            )
    return key


def read_api_key_file(path: str) -> str:
    """The key in the file at ``path``: its text without the line end that ``echo KEY > file``
    writes, checked (:func:`check_api_key`)."""
    source = f"the key in --api-key-file {path}"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise ApiKeyError(f"cannot read --api-key-file {path}: {e.strerror or e}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ApiKeyError(f"--api-key-file {path} is longer than {MAX_KEY_FILE_BYTES} bytes")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as e:
        raise ApiKeyError(
            f"{source} holds a byte that is not ASCII (at position {e.start}): an HTTP header "
            "cannot carry it, so no client could send this key"
        ) from None
    for end in ("\r\n", "\n"):
        if text.endswith(end):
            text = text[: -len(end)]
            break
    return check_api_key(text, source)


def add_auth_arguments(parser) -> None:
    """``--api-key KEY`` and ``--api-key-file PATH`` (one or the other), each checked as it is
    parsed: a bad key is a usage error before any model is loaded."""

    def key_type(text: str) -> str:
        try:
            return check_api_key(text, "the key")
        except ApiKeyError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    def file_type(path: str) -> str:
        try:
            return read_api_key_file(path)
        except ApiKeyError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    group = parser.add_mutually_exclusive_group()
    group.add_argument(  # never the key as its default: --help would print it
        "--api-key",
        type=key_type,
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health (/v1/*, /metrics, "
        "the docs). KEY shows in `ps` and the shell's history: prefer --api-key-file or "
        f"${ENV_VAR} (the default: ${ENV_VAR} if set, else no key)",
    )
    group.add_argument(
        "--api-key-file",
        type=file_type,
        default=None,
        metavar="PATH",
        help="read the key from PATH (one line), out of sight of `ps`",
    )


def resolve_api_key(args) -> str | None:
    """The key the command line asks for: ``--api-key``, else ``--api-key-file``'s (both
    checked when parsed), else ``$PAGEDLEARN_API_KEY``, else None. A variable that is set but
    empty or blank is an :class:`ApiKeyError`, not "no key": ``PAGEDLEARN_API_KEY=$SECRET``
    with ``SECRET`` unset must not start an open server."""
    for given in (getattr(args, "api_key", None), getattr(args, "api_key_file", None)):
        if given is not None:
            return check_api_key(given, "the key")
    if ENV_VAR not in os.environ:
        return None
    return check_api_key(os.environ[ENV_VAR], f"${ENV_VAR}")


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach ``host`` (127.0.0.0/8, ::1, ``localhost``). Any
    other name counts as reachable: it may resolve to a public address."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None, port: int | None = None) -> str | None:
    """The warning for a server listening on a network address without a key (None if it has
    one, or listens on loopback only)."""
    if api_key is not None or is_loopback(host):
        return None
    where = f"port {port}" if port is not None else "its port"
    return (
        f"pagedlearn: WARNING: serving on {host or 'every address'} without an API key: anyone "
        f"who can reach {where} can run the model (every /v1 route) and read /metrics. Give a "
        f"key (--api-key-file PATH or ${ENV_VAR}), or listen on 127.0.0.1 only"
    )


def listen_line(host: str, port: int, model_name: str | None = None) -> str:
    """The startup line: where the server listens, as bound (``0.0.0.0``: every IPv4 address of
    the machine), and the URL to use from this machine when that is not the same."""
    bound = _base_url(host, port)
    what = f"serving {model_name}" if model_name else "serving"
    wildcard = {"": "0.0.0.0", "0.0.0.0": "0.0.0.0", "::": "::"}.get(host)
    if wildcard is None:
        return f"pagedlearn: {what} at {bound} (Ctrl-C stops it)"
    every = "every IPv4 address" if wildcard == "0.0.0.0" else "every address"
    local = _base_url("127.0.0.1" if wildcard == "0.0.0.0" else "::1", port)
    return (
        f"pagedlearn: {what} at {_base_url(wildcard, port)}, on {every} of this machine "
        f"(from this machine: {local}; Ctrl-C stops it)"
    )


def _base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"
