"""Fixtures of the browser tier: a JupyterLab server on a copy of a chapter, and a Chromium page.

See ``test_chapter06_in_jupyterlab.py`` for what the tier checks and why it is built this way.
Everything here is started per test module and torn down after it. What the server, kernel and
browser keep lives in temporary folders: the copied chapter, JupyterLab's settings, workspaces,
config, data and runtime files, IPython's profile and the browser profile; the repository is
never written to. The ``browser`` marker is registered in pyproject.toml.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pagedlearn.cli import chapters

# Switch this on in CI (`.ci/run`): there a missing browser is a broken set-up, not a reason to
# skip, and a tier that silently skips checks nothing.
REQUIRED = os.environ.get("PAGEDLEARN_BROWSER_REQUIRED") == "1"
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
TOKEN = "pagedlearn-browser-test"  # a fixed token: only this test talks to the server
CHROMIUM_NAMES = ("chromium", "chromium-browser")  # Debian's package; Ubuntu's name
CHROMIUM_ARGS = [  # a container without a GPU, a sandbox or network; a browser that stays quiet
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_START_S = 60


def _missing(reason: str):
    if REQUIRED:
        pytest.fail(f"{reason} (PAGEDLEARN_BROWSER_REQUIRED=1: the browser tier must run here)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def chromium_path() -> str:
    """The system's Chromium: $PAGEDLEARN_CHROMIUM (or $CHROMIUM, as `make test-browser
    CHROMIUM=...` passes it), else `chromium` on the PATH. Playwright drives it
    (``executable_path``); we never download Playwright's own browser build."""
    path = (
        os.environ.get("PAGEDLEARN_CHROMIUM")
        or os.environ.get("CHROMIUM")
        or next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)
    )
    if not path or not os.access(path, os.X_OK):
        _missing(
            "no Chromium: install Debian's `chromium` package (apt-get install chromium), "
            "or point PAGEDLEARN_CHROMIUM at a Chromium or Chrome binary"
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _missing("playwright is not installed: pip install playwright (no browser download)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copy_chapter(stem: str, root: Path) -> Path:
    """The chapter's .ipynb, outputs cleared, in ``root``: the committed file is never opened,
    so neither the test nor JupyterLab's autosave can change it; and every picture the test
    finds was drawn by this run, not stored by the last `make notebooks`."""
    import nbformat

    nb = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    # Opened alone: no .py twin next to it for jupytext's pairing to rewrite.
    nb.metadata.pop("jupytext", None)
    path = root / f"{stem}.ipynb"
    nbformat.write(nb, path)
    return path


def _lab_settings(settings: Path) -> None:
    """No news, no update check: both would ask the (absent) internet and show a toast."""
    notification = (
        settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    )
    notification.parent.mkdir(parents=True)
    notification.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))


class Lab:
    """A running JupyterLab: ``copy_chapter(stem)`` puts a chapter in its root folder,
    ``url(path)`` opens a file of that folder."""

    def __init__(self, port: int, root: Path, process: subprocess.Popen, log: Path) -> None:
        self.port, self.root, self.process, self.log = port, root, process, log

    def copy_chapter(self, stem: str) -> str:
        return _copy_chapter(stem, self.root).name

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/lab/tree/{path}?token={TOKEN}"

    def answers(self) -> bool:
        api = f"http://127.0.0.1:{self.port}/api/status?token={TOKEN}"
        try:
            with urllib.request.urlopen(api, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


@pytest.fixture(scope="module")
def lab(tmp_path_factory, chromium_path) -> Lab:
    """``jupyter lab`` on an empty temporary folder, offline: a chapter's ``setup()`` then picks
    the tiny models, as in tests/test_notebooks.py."""
    tmp = tmp_path_factory.mktemp("lab")
    root, settings = tmp / "root", tmp / "settings"
    root.mkdir()
    _lab_settings(settings)
    env = {
        **os.environ,
        **chapters.OFFLINE_ENV,  # the kernel inherits them: tiny models, no hub
        "JUPYTER_CONFIG_DIR": str(tmp / "config"),  # no user config (passwords, extensions...)
        "JUPYTER_DATA_DIR": str(tmp / "data"),  # the kernelspec comes from sys.prefix still
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
        "IPYTHONDIR": str(tmp / "ipython"),  # no user start-up scripts in the kernel
    }
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--allow-root",  # CI and course containers run as root
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",  # fail, rather than answer on a port we do not know
        f"--ServerApp.token={TOKEN}",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={settings}",
        f"--LabApp.workspaces_dir={tmp / 'workspaces'}",  # no layout restored from another run
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run commands as menus do
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    log = tmp / "jupyterlab.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = Lab(port, root, process, log)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while not server.answers():
            if process.poll() is not None:
                pytest.fail(f"jupyter lab exited with {process.returncode}:\n{server.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(
                    f"jupyter lab did not answer in {SERVER_START_S} s:\n{server.log_tail()}"
                )
            time.sleep(0.25)
        yield server
    finally:
        process.terminate()  # SIGTERM: the server shuts its kernels down and exits
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def browser(chromium_path, tmp_path_factory):
    """Headless Chromium from the system, driven by Playwright. ``launch`` gives it a fresh
    profile (a new user-data-dir in a temporary folder), deleted when it closes."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where screenshots go: $PAGEDLEARN_BROWSER_SHOTS (CI can keep them), else a temp folder."""
    where = os.environ.get("PAGEDLEARN_BROWSER_SHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("shots")
    path.mkdir(parents=True, exist_ok=True)
    return path
