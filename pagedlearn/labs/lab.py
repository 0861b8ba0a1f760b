"""What a lab is: the functions a student writes, and the checks that grade them.

A :class:`Lab` names its *reference files* (files of this package) and, per :class:`Exercise`, the
functions or methods in them that the student writes (``"BlockAllocator.allocate"``, a qualified
name). The handout is made from those very files (handout.py blanks the named bodies), so the
package's own code is a full-mark submission and the handout cannot drift from it.

A *check* is a function ``check(sub)`` registered on the lab with ``@LAB.check(exercise, points)``.
``sub`` is the student's submission: an object whose attributes are the names their code defines
(``sub.BlockAllocator``). A check runs the student's code, compares it with the reference, and
raises :class:`CheckFailed` with a message a student can act on -- the operations that led
there, what was expected, what their code gave -- and, for the memory labs, a picture of their
pool beside the reference's. Anything else their code raises is reported by the runner
(runner.py), which also enforces the check's time limit.

Property-based checks go through :func:`explore`: hypothesis draws operation sequences, and when
one fails it *shrinks* it to the smallest failing sequence before the verdict is raised, so the
student reads three operations instead of forty.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class CheckFailed(AssertionError):
    """A check's verdict on a wrong answer: ``message`` (what to fix), and optionally a
    ``picture``: a callable returning a matplotlib Figure (their state beside the reference's),
    drawn only where someone can see it (the notebook), never by the grader."""

    def __init__(self, message: str, picture: Callable[[], Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.picture = picture


@dataclass(frozen=True)
class Exercise:
    """One step of a lab: ``targets`` maps each qualified name the student writes
    (``"func"`` or ``"Class.method"``) to the one-line task its stub raises."""

    id: str
    title: str
    targets: dict[str, str]


@dataclass(frozen=True)
class Check:
    name: str  # snake_case, says what is checked: "allocate_is_all_or_nothing"
    exercise: str
    points: int
    func: Callable[[Any], None]
    timeout_s: float

    @property
    def title(self) -> str:
        return self.name.replace("_", " ")


@dataclass
class Lab:
    """A graded lab (see the module docstring); its checks are added with :meth:`check`."""

    id: str
    number: int  # the order labs are taken in: 1 = allocator
    title: str
    chapter: str  # the chapter it practises, e.g. "02_block_tables_and_the_allocator"
    files: tuple[str, ...]  # reference files, relative to the repository root
    exercises: tuple[Exercise, ...]
    checks: list[Check] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """Top-level names a submission must define (a class for ``"Class.method"``)."""
        out: list[str] = []
        for ex in self.exercises:
            for target in ex.targets:
                top = target.split(".")[0]
                if top not in out:
                    out.append(top)
        return out

    @property
    def max_score(self) -> int:
        return sum(c.points for c in self.checks)

    def exercise(self, exercise_id: str) -> Exercise:
        for ex in self.exercises:
            if ex.id == exercise_id:
                return ex
        known = ", ".join(e.id for e in self.exercises)
        raise KeyError(f"lab {self.id!r} has no exercise {exercise_id!r}; it has {known}")

    def check(self, exercise: str, points: int = 1, timeout_s: float = 10.0):
        """Decorator: register ``func(sub)`` as a check of ``exercise`` worth ``points``."""
        self.exercise(exercise)  # raises for a typo

        def register(func: Callable[[Any], None]) -> Callable[[Any], None]:
            self.checks.append(Check(func.__name__, exercise, points, func, timeout_s))
            return func

        return register

    def checks_of(self, exercise: str | None = None) -> list[Check]:
        return [c for c in self.checks if exercise is None or c.exercise == exercise]


# --- helpers for writing checks ------------------------------------------------------------------
def explore(strategy, run: Callable[[Any], None], max_examples: int = 150) -> None:
    """Call ``run(example)`` on examples hypothesis draws from ``strategy``; if one fails, the
    failure of the *smallest* failing example (after shrinking) is raised. Deterministic: the same
    submission always gets the same verdict (``derandomize``), and nothing is stored on disk."""
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        print_blob=False,
    )
    @given(strategy)
    def prop(example):
        run(example)

    try:
        prop()
    except BaseException as e:  # the shrunk example's own exception; drop hypothesis' notes
        if hasattr(e, "__notes__"):
            e.__notes__ = [n for n in e.__notes__ if not n.startswith(("Falsifying", "You can"))]
        raise


def crashed(ops: list[str], exc: BaseException) -> CheckFailed:
    """A student's exception while running ``ops``, as a verdict naming the operations and the
    line of their code that raised (a check wraps each call to student code with this)."""
    where = student_line(exc)
    steps = "; ".join(ops) if ops else "(setup)"
    return CheckFailed(f"after {steps}: your code raised {type(exc).__name__}: {exc}{where}")


# Filenames of the student's code, set by the loader (submission.py), so that an error can point
# at their line rather than at the check's.
STUDENT_FILES: set[str] = set()


def student_line(exc: BaseException) -> str:
    """`` (at <file>, line N: <code>)`` for the last frame of the student's code in ``exc``'s
    traceback, or ``""`` (an exception rebuilt from the worker's answer carries it)."""
    found = getattr(exc, "student_where", "")
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename in STUDENT_FILES:
            code = f": {frame.line.strip()}" if frame.line else ""
            found = f" (at {frame.filename}, line {frame.lineno}{code})"
    return found
