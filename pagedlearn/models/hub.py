"""Reaching the Hugging Face hub -- or learning within seconds that it cannot be reached.

``load("gpt2")`` (see loader.py) first looks in the local cache, and only then goes to the hub. This
module answers the three questions that path asks, so that a lab without a network fails at once
with a useful message instead of hanging:

- :func:`in_cache` -- is the model in the local cache? Looked up on disk only.
- :func:`why_unreachable` -- may the hub be asked, and does it answer? ``None`` if so, else why not:
  offline mode is on, or no TCP connection opens within ``PROBE_TIMEOUT_S`` seconds. Without this,
  ``from_pretrained`` finds out by itself: huggingface_hub retries 5 times with back-off (23 s
  measured where DNS fails; add a 10 s timeout per try where a firewall drops packets).
- :func:`missing_from_cache` -- did ``from_pretrained`` fail because files were not in the cache
  (go on to the hub, or say it did not serve them), rather than because they are broken?

It raises no errors of its own: loader.py turns its answers into ``ModelLoadError`` messages.
huggingface_hub is imported when a function runs, not with this module.
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.request
from urllib.parse import urlsplit

PROBE_TIMEOUT_S = 3.0  # a hub that does not take a TCP connection within this is unreachable


def in_cache(name: str) -> bool:
    """Whether the hub cache holds ``name``'s config.json, looked up on disk only: even with
    local_files_only=True, huggingface_hub 2.x may first go online (for a user-agent registry,
    3 s timeout), which a lab without a network should not wait for just to learn "not cached".
    Raises huggingface_hub's ``HFValidationError`` when ``name`` is no valid hub model name."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def why_unreachable() -> str | None:
    """None if the hub may be asked and takes a connection, else why not (offline mode is
    checked first: then the hub is not even probed)."""
    return _offline_mode() or _probe_hub()


def missing_from_cache(e: BaseException) -> bool:
    """Whether ``e`` (from ``from_pretrained``), or an error that led to it, says that a file
    was not in the local cache -- transformers wraps huggingface_hub's error in its own."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    return any(isinstance(c, LocalEntryNotFoundError) for c in _causes(e))


def _causes(e: BaseException | None) -> list[BaseException]:
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def _offline_mode() -> str | None:
    """Why the hub must not be asked, if offline mode is on (in the environment, or in the
    huggingface_hub constant that was read from it at import)."""
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return f"offline mode is on ({var}={os.environ[var]}), so it was not asked"
    if constants.HF_HUB_OFFLINE:
        return "offline mode is on (HF_HUB_OFFLINE), so it was not asked"
    return None


def _probe_hub() -> str | None:
    """None if a TCP connection to the hub endpoint (or the proxy in front of it) opens within
    ``PROBE_TIMEOUT_S`` seconds, else why not. ``create_connection``'s own timeout does not cover
    the DNS look-up, which can stall for long, so the attempt runs in a thread we stop waiting for.
    """
    from huggingface_hub import constants

    timeout, url = PROBE_TIMEOUT_S, urlsplit(constants.ENDPOINT)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme)  # httpx honours HTTPS_PROXY & co. too
    if proxy and not urllib.request.proxy_bypass(host):
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = p.hostname or "", p.port or 80
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(f"cannot connect to {host}:{port} ({type(e).__name__}: {e})")

    thread = threading.Thread(target=connect, name="pagedlearn-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer from {host}:{port} within {timeout:g} s"
