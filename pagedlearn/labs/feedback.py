"""Instant feedback in a lab notebook: ``check("pool")`` at the end of each exercise cell.

The first code cell of a lab notebook is::

    from pagedlearn.labs.feedback import start
    check = start("allocator", globals())

``start`` puts the reference module's names into the notebook (the given helpers, and the
classes the exercise cells extend) and returns ``check``. ``check(exercise)`` runs that
exercise's checks on what the notebook defines *now*, in this process, each under its time
limit, and prints one line per check; under a failure, its message (the smallest operation
sequence that goes wrong, the expected and the actual result) and, for the memory labs, the
picture of the student's pool beside the reference's.

In the student edition (no reference to compare with) each check replays the reference's
recorded answers instead (expected.py): the same questions, the first different answer.

A stub still in place stops "Run all" there, with the stub's task as the whole message (no
traceback): the cells below build on this one. While a notebook is being graded
(``PAGEDLEARN_GRADING=1``, see submission.py) ``check`` does nothing.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from pagedlearn.labs import get
from pagedlearn.labs.runner import NOT_DONE, Outcome, run_check
from pagedlearn.labs.submission import GRADING_ENV, Submission, reference


class NotDoneYet(NotImplementedError):
    """Raised by ``check`` while an exercise is still a stub; Jupyter shows its message alone."""

    def _render_traceback_(self) -> list[str]:  # IPython's hook: no traceback, just the task
        return [f"NotImplementedError: {self}"]


def given(lab_id: str) -> dict:
    """The reference modules' names, as a notebook starts with them."""
    return {k: v for k, v in reference(get(lab_id))._ns.items() if not k.startswith("__")}


def start(lab_id: str, namespace: dict):
    """Prepare a lab notebook's ``namespace`` (its ``globals()``); returns its ``check``."""
    from pagedlearn.cli.notebook import _show_figures_inline

    lab = get(lab_id)
    namespace.update(given(lab_id))
    _show_figures_inline()  # a failure's picture is a Figure: shown only with the inline hook

    def check(exercise: str) -> list[Outcome] | None:
        if os.environ.get(GRADING_ENV) == "1":
            return None
        lab.exercise(exercise)  # a typo raises, naming the exercises
        sub = Submission(namespace, "your notebook")
        outcomes = [run_check(c, sub) for c in checks(lab, exercise)]
        report(outcomes, sys.stdout)
        todo = [o for o in outcomes if o.status == NOT_DONE]
        if todo:
            raise NotDoneYet(todo[0].message.removeprefix("not implemented yet -- "))
        return None

    return check


def checks(lab, exercise: str | None = None) -> list:
    """``lab``'s checks (of ``exercise``): as they are, or -- in a student edition, which has no
    reference to compare with -- each replaying the reference's recorded answers (expected.py)."""
    from pagedlearn.labs.student_edition import is_student_edition

    if not is_student_edition():
        return lab.checks_of(exercise)
    from pagedlearn.labs import expected

    recorded = expected.load(lab.id)
    return [
        dataclasses.replace(c, func=expected.replay_check(recorded.get(c.name, [])))
        for c in lab.checks_of(exercise)
    ]


def report(outcomes: list[Outcome], out) -> None:
    """One line per check; a failure's message below it; the first failure's picture."""
    shown = False
    for o in outcomes:
        # A stub's task is the message NotDoneYet stops on: no need to print it twice.
        print("\n".join(o.lines()[: 1 if o.status == NOT_DONE else None]), file=out)
        if o.picture is not None and not shown:
            shown = _show(o.picture)
    total = sum(o.score for o in outcomes)
    print(f"{total}/{sum(o.max_score for o in outcomes)} points", file=out)


def _show(picture) -> bool:
    try:
        from IPython.display import display

        display(picture())
    except Exception as e:  # a picture is a bonus: never hide the verdict behind its failure
        print(f"       (the picture could not be drawn: {type(e).__name__}: {e})")
        return False
    return True
