"""Drive a notebook open in JupyterLab (a Playwright page), the way a person would use it.

Commands go through ``window.jupyterapp.commands`` (the server runs with
``--LabApp.expose_app_in_browser``): the same commands JupyterLab's menus, toolbar buttons and
keyboard shortcuts call, without depending on menu labels, key bindings or keyboard focus. The
run commands return a promise that resolves when the last cell they run is done, so waiting for
it beats guessing from the kernel indicator (which goes idle between two cells). What a test
*checks* is read from the page (``cells()``): what the notebook holds, and what is on screen.

Playwright is imported by the caller (the fixtures skip without it); this module needs only a
``page`` object.
"""

from __future__ import annotations

import contextlib
import io
import time

from PIL import Image, ImageChops

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# What a widget output shows when the browser side is broken: the widget manager cannot find or
# build the view, or a Python error shown inside the view.
BROKEN = ("Error displaying widget", "Loading widget", "Traceback")

# JavaScript run in the page. `window.__nb` is the notebook panel once `open` found it.
_FIND_NOTEBOOK = """async (path) => {
  const app = window.jupyterapp;
  await app.restored;
  const panel = Array.from(app.shell.widgets('main')).find(
    w => w.context && w.context.path === path);
  if (!panel) return false;
  await panel.context.ready;
  await panel.sessionContext.ready;
  window.__nb = panel;
  app.shell.activateById(panel.id);
  return true;
}"""
_KERNEL_STATUS = "() => window.__nb.sessionContext.session?.kernel?.status ?? 'none'"
_RUN_COMMAND = """([command, key]) => {
  window[key] = undefined;
  window.jupyterapp.shell.activateById(window.__nb.id);
  window.jupyterapp.commands.execute(command).then(
    ok => { window[key] = {ok}; }, err => { window[key] = {error: String(err)}; });
}"""
_ADD_CELL = """async (source) => {
  const app = window.jupyterapp, nb = window.__nb.content;
  app.shell.activateById(window.__nb.id);
  nb.activeCellIndex = nb.widgets.length - 1;
  await app.commands.execute('notebook:insert-cell-below');
  await app.commands.execute('notebook:change-cell-to-code');
  nb.activeCell.model.sharedModel.setSource(source);
}"""
# Per code cell: its execution count, its outputs as the notebook model holds them, and per
# output what the page shows: a widget view or not, its pictures, its text.
_CELLS = """() => window.__nb.content.widgets.filter(c => c.model.type === 'code').map(c => ({
  count: c.model.executionCount,
  source: c.model.sharedModel.getSource().slice(0, 50),
  outputs: c.model.outputs.toJSON().map((o, j) => {
    const node = c.outputArea.widgets[j]?.node;
    return {
      type: o.output_type, ename: o.ename, evalue: o.evalue,
      mimes: Object.keys(o.data || {}),
      widget: !!node?.querySelector('.jupyter-widgets'),
      text: (node?.textContent || '').slice(0, 300),
      images: Array.from(node?.querySelectorAll('.jupyter-widgets img.widget-image') || []).map(
        i => ({loaded: i.complete && i.naturalWidth > 0, width: i.naturalWidth})),
    };
  }),
}))"""


class Timeout(AssertionError):
    pass


class NotebookPage:
    """One notebook open in JupyterLab in ``page``; console errors are collected from the start."""

    def __init__(self, page) -> None:
        self.page = page
        self.errors: list[str] = []  # console errors and uncaught page errors, in order
        page.on("console", lambda m: m.type == "error" and self.errors.append(_console(m)))
        page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        # A dialog in the way of a click is accepted first (Playwright calls this before acting).
        page.add_locator_handler(page.locator(".jp-Dialog"), self.accept_dialogs)

    def accept_dialogs(self) -> None:
        """Accept any JupyterLab dialog that is open (a kernel to choose, 'save?', ...)."""
        for _ in range(3):
            dialog = self.page.locator(".jp-Dialog")
            if not dialog.count():
                return
            accept = dialog.locator(".jp-mod-accept")
            if accept.count():
                accept.first.click()
            else:
                self.page.keyboard.press("Escape")
            self.page.wait_for_timeout(200)

    def until(self, check, timeout_s: float, what: str):
        """Poll ``check()`` (accepting dialogs meanwhile) until it returns something truthy."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.accept_dialogs()
            got = check()
            if got:
                return got
            if time.monotonic() > deadline:
                raise Timeout(f"{what}: not within {timeout_s:.0f} s")
            self.page.wait_for_timeout(250)

    def open(self, url: str, path: str, timeout_s: float = 60) -> None:
        """Load JupyterLab at ``url`` (which opens ``path``), and wait for its kernel."""
        self.page.goto(url)
        self.page.wait_for_function("() => window.jupyterapp", timeout=timeout_s * 1000)
        self.until(lambda: self.page.evaluate(_FIND_NOTEBOOK, path), timeout_s, f"{path} opens")
        self.kernel_idle(timeout_s)

    def kernel_idle(self, timeout_s: float = 60) -> None:
        status = lambda: self.page.evaluate(_KERNEL_STATUS)  # noqa: E731
        self.until(lambda: status() == "idle", timeout_s, "the kernel is idle")

    def run(self, command: str, timeout_s: float) -> None:
        """Run a JupyterLab command (e.g. ``notebook:run-all-cells``: Run > Run All Cells) and
        wait for the promise it returns."""
        key = "__pagedlearn_done"
        self.page.evaluate(_RUN_COMMAND, [command, key])
        done = self.until(lambda: self.page.evaluate(f"() => window.{key}"), timeout_s, command)
        assert "error" not in done, f"{command}: {done['error']}"

    def add_cell(self, source: str, timeout_s: float = 60) -> dict:
        """A new code cell at the end holding ``source``, run; returns it as ``cells()`` does."""
        self.page.evaluate(_ADD_CELL, source)
        self.run("notebook:run-cell", timeout_s)
        return self.cells()[-1]

    def cells(self) -> list[dict]:
        return self.page.evaluate(_CELLS)

    def screenshot(self, path) -> None:
        self.page.screenshot(path=str(path))


@contextlib.contextmanager
def chapter_after_run_all(lab, browser, stem: str, timeout_s: float, final_shot):
    """A new page with a fresh copy of chapter ``stem`` open in ``lab``, after Run > Run All
    Cells (``nb.run_all_s``: how long that took). On the way out, whatever happened, it saves a
    screenshot to ``final_shot``, prints both, and closes the page."""
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    nb = NotebookPage(page)
    t0 = time.monotonic()
    try:
        name = lab.copy_chapter(stem)
        nb.open(lab.url(name), name)
        nb.run("notebook:run-all-cells", timeout_s)
        nb.run_all_s = time.monotonic() - t0
        yield nb
    finally:
        nb.screenshot(final_shot)
        print(f"\nscreenshot: {final_shot}")
        print(f"browser tier: {time.monotonic() - t0:.0f} s with the page open")
        page.close()


def problems(cells: list[dict]) -> list[str]:
    """What a reader would see go wrong: a cell that did not run or raised, a widget output shown
    as anything but a widget with its pictures loaded."""
    found = []
    for c in cells:
        if not c["count"]:
            found.append(f"cell {c['source']!r} did not run")
        for o in c["outputs"]:
            if o["type"] == "error":
                found.append(f"cell {c['source']!r} raised {o['ename']}: {o['evalue']}")
            if WIDGET_MIME not in o["mimes"]:
                continue
            shown = f"cell {c['source']!r} shows its widget output as {o['text'][:120]!r}"
            if not o["widget"] or any(b in o["text"] for b in BROKEN):
                found.append(shown)
            elif not o["images"] or not all(i["loaded"] and i["width"] for i in o["images"]):
                found.append(f"{shown}, pictures {o['images']}")
    return found


def pixels(locator) -> Image.Image:
    """The element as the screen shows it (an RGB image). An image widget's ``src`` is a new
    blob URL on every frame, so comparing pixels is what tells a changed picture."""
    return Image.open(io.BytesIO(locator.screenshot())).convert("RGB")


def changed(a: Image.Image, b: Image.Image) -> bool:
    return a.size != b.size or ImageChops.difference(a, b).getbbox() is not None


def _console(message) -> str:
    loc = message.location or {}
    where = f" ({loc.get('url')}:{loc.get('lineNumber')})" if loc.get("url") else ""
    return f"console {message.type}: {message.text}{where}"
