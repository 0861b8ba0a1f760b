"""Chapter 12 in a real browser: tensor parallelism's live view, as a student opens it.

What only a browser shows: after Run All, the chapter's live view renders as a widget with *two*
pictures loaded -- the pool, and under it each worker's KV slab beside the driver's one block
table -- and the worker processes started from a JupyterLab kernel ran every cell (they are
started from a fork server: the kernel's main module is not a script). See
``test_chapter06_in_jupyterlab.py`` for how the tier is built; this file reuses its fixtures.
"""

from __future__ import annotations

import pytest

from .lab_driver import WIDGET_MIME, chapter_after_run_all, problems

pytestmark = pytest.mark.browser

CHAPTER = "12_tensor_parallelism"
RUN_ALL_S = 150  # the chapter takes ~12 s offline on two idle cores; workers start once


def test_run_all_shows_the_pool_and_every_workers_slab(lab, browser, shots):
    final = shots / "chapter12_after_run_all.png"
    with chapter_after_run_all(lab, browser, CHAPTER, RUN_ALL_S, final) as nb:
        print(f"Run All: {nb.run_all_s:.0f} s")
        pictures = nb.page.locator(".jupyter-widgets img.widget-image")
        if pictures.count():  # the last display's workers picture, on screen for the shot
            pictures.last.scroll_into_view_if_needed()
            nb.page.wait_for_timeout(1000)  # JupyterLab draws the cells scrolled to
        cells = nb.cells()
        assert not problems(cells), "\n".join(problems(cells))
        views = [o for c in cells for o in c["outputs"] if WIDGET_MIME in o["mimes"]]
        assert views, "chapter 12 displays its live view"
        # Each display of the live view: the pool picture, then the workers' slabs under it.
        shown = [[i for i in o["images"] if i["loaded"] and i["width"] > 0] for o in views]
        assert all(len(images) >= 2 for images in shown), shown
        assert not nb.errors, "the browser console has errors:\n" + "\n".join(nb.errors)
