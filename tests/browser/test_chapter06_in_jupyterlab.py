"""Chapter 06 in a real browser: JupyterLab in Chromium, as a student opens it.

The notebook tests (tests/test_notebooks.py) run every chapter with nbclient: they prove that the
Python runs and prints what the committed notebook shows, but no browser ever draws a widget.
This tier checks what only a browser shows, in the order a student meets it:

1. Run All: every cell runs, and the live and replay views *render* as widgets with their
   pictures loaded (not "Error displaying widget", not the text or PNG fallback a notebook
   without a widget front end shows);
2. Play, pressed right after Run All, answers (the issue: it did nothing and said nothing);
3. a request added in a new cell, then Play: the picture animates and the request is served;
4. and in each step, the browser console has no error (console ``error`` messages and uncaught
   page errors).

How it is built, and why:

- **marker ``browser``, deselected by default** (like ``slow`` and ``gpu``): it needs a system
  Chromium and starts a server, a kernel and a browser; ``make test-browser`` runs it (``pytest
  -m browser tests/browser``), and ``.ci/run`` calls that after ``make test``. About a minute on
  two cores, most of it the chapter itself.
- **Debian's Chromium, driven by Playwright** with ``executable_path``: no browser download
  (CI reaches package registries only), and the browser a course VM has. Headless, without
  sandbox, GPU, QUIC, first-run screens or background networking (a container, offline); a fresh
  profile, which ``launch`` creates in a temporary folder and deletes. Without Chromium or
  Playwright the tests skip and say which is missing; with ``PAGEDLEARN_BROWSER_REQUIRED=1``
  (CI) they fail instead, so that the tier cannot silently stop checking.
- **a copy of the chapter** (outputs cleared) in the server's temporary root folder: the
  committed ``.ipynb`` is never opened, JupyterLab's autosave cannot dirty the tree, and every
  picture found was drawn by this run. The server (and so the kernel) runs offline
  (``PAGEDLEARN_OFFLINE=1``, as tests/test_notebooks.py runs chapters): ``setup()`` picks the
  tiny models. JupyterLab's news and update checks are off (both would ask the internet and show
  a toast); any dialog that opens is accepted.
- **JupyterLab's own commands** drive it, the *checks* read the page (see ``lab_driver.py``):
  widget pictures by structure (``img.widget-image`` in a ``.jupyter-widgets`` view of a widget
  output), the Play button by its role and name.
- **the live view found by its type, not its name**: the added cell takes the first
  ``LiveBlockView`` in the kernel's globals and gives its widget a CSS class (``add_class``
  reaches every view of a widget, also the one already on the page), so the tests press Play on
  the view the chapter displayed, whatever the chapter calls its variables or says around them.
- **"the picture changes"** compares the image element's pixels before and after (its ``src``
  is a new blob URL on every frame, so it would change even for the same picture).

Screenshots are saved (``$PAGEDLEARN_BROWSER_SHOTS``, else a temp folder) and their paths
printed: look at them when a test fails.
"""

from __future__ import annotations

import re

import pytest

from .lab_driver import (
    BROKEN,
    WIDGET_MIME,
    NotebookPage,
    changed,
    chapter_after_run_all,
    pixels,
    problems,
)

pytestmark = pytest.mark.browser

CHAPTER = "06_live_gpt2_opt"
RUN_ALL_S = 300  # the chapter takes ~50-70 s offline on two cores (SmolLM2 serves its stream)
ANSWER_S = 10  # for the view to answer a click
PLAY_S = 60  # for Play to serve an 8-token request, 0.3 s per step
MARK = "pagedlearn-browser-test"  # the CSS class the added cell gives the live view
FIND_LIVE_VIEW = f"""\
from pagedlearn.viz import LiveBlockView

live = next(v for v in list(globals().values()) if isinstance(v, LiveBlockView))
live.widget.add_class({MARK!r})
"""
ADD_REQUEST = """\
from pagedlearn import SamplingParams

live.engine.add_request("extra", "Once upon a time", SamplingParams(max_tokens=8))
"""


@pytest.fixture(scope="module")
def notebook(lab, browser, shots):
    """Chapter 06 open in JupyterLab, after Run > Run All Cells."""
    final = shots / "chapter06_final.png"
    with chapter_after_run_all(lab, browser, CHAPTER, RUN_ALL_S, final) as nb:
        yield nb


def _shoot(nb: NotebookPage, path) -> None:
    nb.screenshot(path)
    print(f"\nscreenshot: {path}")


def _no_new_errors(nb: NotebookPage, before: int) -> None:
    new = nb.errors[before:]
    assert not new, "the browser console has errors:\n" + "\n".join(new)


def _live_view(nb: NotebookPage):
    """The chapter's live view (marked by the first added cell), scrolled into sight."""
    view = nb.page.locator(f".{MARK}")
    if not view.count():
        cell = nb.add_cell(FIND_LIVE_VIEW)
        assert not problems([cell]), "\n".join(problems([cell]))
        nb.until(view.count, ANSWER_S, "the live view shows the class the added cell gave it")
    view = view.first  # the view the chapter displayed, cells above; not a second display
    view.scroll_into_view_if_needed()
    return view


def _buttons(view):
    # Not exact: a button's accessible name holds its icon font's glyph too.
    return view.get_by_role("button", name="Play"), view.get_by_role("button", name="Pause")


def test_run_all_runs_every_cell_and_shows_every_widget_as_a_picture(notebook, shots):
    cells = notebook.cells()
    print(f"Run All: {notebook.run_all_s:.0f} s")
    _shoot(notebook, shots / "chapter06_after_run_all.png")
    assert not problems(cells), "\n".join(problems(cells))
    views = [o for c in cells for o in c["outputs"] if WIDGET_MIME in o["mimes"]]
    assert len(views) >= 2, f"chapter 06 shows a live and a replay view; found {len(views)}"
    _no_new_errors(notebook, 0)


def test_play_right_after_run_all_answers(notebook, shots):
    """Run All leaves the live view on its last frame. Pressing Play there must show something
    (a message, or the work the chapter left for Play), not nothing."""
    before_errors = len(notebook.errors)
    view = _live_view(notebook)
    play, pause = _buttons(view)
    picture = view.locator("img.widget-image").first
    text, shown = view.text_content(), pixels(picture)
    play.click()
    try:
        notebook.until(
            lambda: view.text_content() != text or changed(shown, pixels(picture)),
            ANSWER_S,
            "the live view changes after Play is pressed with the run finished",
        )
    finally:
        _shoot(notebook, shots / "chapter06_play_after_run_all.png")
    notebook.until(pause.is_disabled, PLAY_S, "playing ends")  # if work was left for Play
    _no_new_errors(notebook, before_errors)


def test_play_animates_a_request_added_in_a_new_cell(notebook, shots):
    from playwright.sync_api import expect  # importable: the `browser` fixture checked it

    before_errors = len(notebook.errors)
    view = _live_view(notebook)
    cell = notebook.add_cell(ADD_REQUEST)
    assert not problems([cell]), "\n".join(problems([cell]))
    play, pause = _buttons(view)
    picture = view.locator("img.widget-image").first
    expect(play).to_be_enabled()
    before = pixels(picture)
    play.click()
    notebook.until(lambda: changed(before, pixels(picture)), PLAY_S, "Play redraws the pool")
    _shoot(notebook, shots / "chapter06_playing.png")
    notebook.until(pause.is_disabled, PLAY_S, "playing ends")
    expect(play).to_be_enabled()
    expect(view).to_contain_text("extra")  # the request list names the added request
    text = view.text_content() or ""
    assert not any(b in text for b in BROKEN), text[-1500:]
    assert changed(before, pixels(picture)), "the picture after Play is the one before"
    notebook.kernel_idle()
    _no_new_errors(notebook, before_errors)


def test_every_block_of_the_inspector_can_be_reached_in_a_normal_window(notebook, shots):
    """The "Inspect a block" grid wraps inside the notebook, at a laptop's window size with the
    file browser open: no block button is cut off on the right (the issue: blocks 13-15 and 29
    were unreachable, with no scrollbar)."""
    page = notebook.page
    size = page.viewport_size
    page.set_viewport_size({"width": 1280, "height": 900})
    try:
        view = _live_view(notebook)
        buttons = view.get_by_role("button", name=re.compile(r"^\d+$"))
        notebook.until(buttons.count, ANSWER_S, "the live view shows its block buttons")
        right = view.bounding_box()["x"] + view.bounding_box()["width"]
        cut = []
        for i in range(buttons.count()):
            box = buttons.nth(i).bounding_box()
            if box is None or box["x"] + box["width"] > right + 1:
                cut.append(buttons.nth(i).inner_text())
        _shoot(notebook, shots / "chapter06_inspector_1280.png")
        # More buttons than one row holds at this width (16), so the grid must wrap: the
        # chapter's pool has 23 blocks (SmolLM2's chats, sized by demo.default_num_blocks).
        assert buttons.count() >= 20 and not cut, f"block buttons cut off on the right: {cut}"
        buttons.last.click()  # the last block answers a click: the inspector names it
        notebook.until(
            lambda: f"block {buttons.count() - 1}" in (view.text_content() or "").lower(),
            ANSWER_S,
            "the inspector shows the last block after a click",
        )
    finally:
        page.set_viewport_size(size)
