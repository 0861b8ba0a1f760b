"""The lab notebooks (``notebooks/labs/NN_<lab>.py`` + ``.ipynb``) and their exercise cells.

A lab notebook is written by hand -- the prose, the hints, the cells that draw -- except its
*exercise cells*: code cells tagged ``exercise`` whose first line is
``# Exercise '<id>': <title>``. Their code is generated from the package's source
(:func:`pagedlearn.labs.handout.exercise_code`): the reference's bodies in the committed notebook
(so CI runs it with full marks), stubs in the student's handout. ``python -m
pagedlearn.labs.notebooks`` rewrites the committed cells after the reference changed (``make
labs`` runs it and pairs the ``.ipynb``); ``tests/test_labs.py`` fails when one is stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from pagedlearn.cli.chapters import clean
from pagedlearn.labs import LAB_IDS, get
from pagedlearn.labs.handout import EXERCISE_TAG, exercise_code

LAB_NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks" / "labs"
HEADER = re.compile(r"# Exercise '([a-z_]+)'")


def lab_notebook(lab_id: str) -> Path:
    """The ``.py`` source of a lab's notebook, ``notebooks/labs/NN_<lab>.py``."""
    return LAB_NOTEBOOKS / f"{get(lab_id).number:02d}_{lab_id}.py"


def fill_exercises(nb, lab_id: str, blank: bool) -> list[str]:
    """Rewrite ``nb``'s exercise cells (a jupytext/nbformat notebook) in place, with the
    reference's code or with stubs; returns the exercise ids found, in order."""
    lab, found = get(lab_id), []
    for cell in nb.cells:
        if cell.cell_type != "code" or EXERCISE_TAG not in cell.metadata.get("tags", []):
            continue
        match = HEADER.match(cell.source)
        if match is None:
            raise ValueError(
                f"{lab_id}: an exercise cell must start with \"# Exercise '<id>'\", got "
                f"{cell.source.splitlines()[:1]}"
            )
        cell.source = exercise_code(lab, lab.exercise(match.group(1)), blank).rstrip("\n")
        cell.outputs, cell.execution_count = [], None
        found.append(match.group(1))
    return found


def sync(lab_ids=LAB_IDS) -> list[Path]:
    """Regenerate the committed lab notebooks' exercise cells; returns the files changed."""
    import jupytext

    changed = []
    for lab_id in lab_ids:
        py = lab_notebook(lab_id)
        if not py.exists():
            continue
        nb = jupytext.read(py)
        fill_exercises(nb, lab_id, blank=False)
        text = jupytext.writes(nb, fmt="py:percent")
        if text != py.read_text():
            py.write_text(text)
            changed.append(py)
        # The .ipynb twin: the same cells, no outputs (a lab is done, not read), stable cell ids.
        jupytext.write(clean(jupytext.read(py)), py.with_suffix(".ipynb"), fmt="ipynb")
    return changed


if __name__ == "__main__":
    for path in sync(sys.argv[1:] or LAB_IDS):
        print(f"rewrote the exercise cells of {path}")
