"""The grader: run a lab's checks here, and the student's code in a sandbox, with a time limit each.

::

    python -m pagedlearn grade LAB SUBMISSION... [--json results.json]
    python -m pagedlearn grade LAB --reference

Who decides what. Every check runs in *this* process, which has the reference: it computes the
expected answer, compares, writes the message and the score. The submission runs in a worker
(worker.py) that has only the *student edition* of pagedlearn on its path -- every function any
lab grades is a stub there -- and answers the checks' requests with what the student's code
returned or raised (remote.py). So importing the package, exec-ing its files or subclassing the
names a notebook starts with gets the stubs, and nothing the worker writes can be a verdict: a
score is the sum of the checks this process saw pass, never more than their points.

The sandbox (sandbox.py): the worker runs in its own session, with limits, a minimal environment,
copies of the submitted files and (as root) an unprivileged user; after the last check every
process it started is killed, and only then is ``--json`` written.

Copies. Before anything runs, copies.py reads the submitted files: an exercise whose graded
functions the submission imports or copies from the package scores 0, and the report says why.

A check that overruns its limit, or whose request kills the worker, loses its points with a
message that says so; a fresh worker carries on with the next check.

Exit status: 0 when every check passes, 1 when some fail, 2 when the submission cannot be loaded
(missing file, syntax error, an error while it loads: a one-line message, no traceback).

``--json PATH`` writes Gradescope's autograder ``results.json`` (``score``, ``tests`` with
``name``, ``score``, ``max_score``, ``output``, ``status``), so ``grade`` can be an autograder's
last line unchanged (README, "For instructors").
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedlearn.labs import copies, get
from pagedlearn.labs.lab import Lab
from pagedlearn.labs.runner import ERROR, NOT_DONE, PASSED, Outcome
from pagedlearn.labs.sandbox import Sandbox
from pagedlearn.labs.submission import SubmissionError

MARGIN_S = 10.0  # past a check's own limit before the worker is killed


@dataclass
class Report:
    lab: Lab
    origin: str
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    load_error: str | None = None
    warnings: list[str] = field(default_factory=list)  # for the instructor (stderr), not students

    @property
    def score(self) -> int:
        return sum(o.score for o in self.outcomes)

    @property
    def max_score(self) -> int:
        return self.lab.max_score

    @property
    def exit_code(self) -> int:
        if self.load_error is not None:
            return 2
        return 0 if all(o.status == PASSED for o in self.outcomes) else 1

    def text(self) -> str:
        lines = [f"pagedlearn grade {self.lab.id}: {self.origin}"]
        if self.load_error is not None:
            return f"cannot load {self.origin}: {self.load_error}"
        seen = set()
        for o in self.outcomes:
            if o.message in seen and o.status == NOT_DONE:  # one stub fails several checks
                lines += [o.lines(exercise=True)[0], "       not implemented yet (as above)"]
            else:
                lines += o.lines(exercise=True)
            seen.add(o.message)
        passed = sum(o.status == PASSED for o in self.outcomes)
        lines.append(
            f"score {self.score}/{self.max_score} ({passed} of {len(self.outcomes)} checks "
            f"passed) in {self.seconds:.1f} s"
        )
        return "\n".join(lines)

    def gradescope(self) -> dict:
        """Gradescope's autograder results schema."""
        if self.load_error is not None:
            return {
                "score": 0,
                "output": f"cannot load the submission: {self.load_error}",
                "tests": [],
            }
        tests = [
            {
                "name": f"{o.exercise}: {o.title}",
                "score": o.score,
                "max_score": o.max_score,
                "status": "passed" if o.status == PASSED else "failed",
                "output": o.message or "passed",
            }
            for o in self.outcomes
        ]
        return {
            "score": self.score,
            "execution_time": round(self.seconds, 1),
            "output": f"{self.lab.id}: {self.score}/{self.max_score}",
            "tests": tests,
        }


def grade(
    lab_id: str,
    paths: list[str] | None = None,
    reference: bool = False,
    time_limit: float | None = None,
    log: dict | None = None,
) -> Report:
    """Grade ``paths`` (or the package's own code) on lab ``lab_id``; never raises for anything a
    submission does (a load failure is ``report.load_error``). ``time_limit`` caps every
    check's own limit (the tests use it to keep a looping submission quick to grade). ``log``:
    a dict that gets each check's conversation with the worker (expected.py records the
    reference's)."""
    from pagedlearn.labs.feedback import checks
    from pagedlearn.labs.remote import WorkerGone, WorkerSilent, cut
    from pagedlearn.labs.runner import FAILED, busy_factor, run_check
    from pagedlearn.labs.student_edition import is_student_edition

    lab = get(lab_id)
    origin = "the reference (the package's own code)" if reference else ", ".join(paths or [])
    report = Report(lab, origin)
    start = time.perf_counter()
    if reference and is_student_edition():
        report.load_error = "the student edition has no reference to grade"
        return report
    copied = {} if reference else copies.find_copies(lab, [Path(p) for p in paths or []])
    with Sandbox(lab_id, paths or [], reference) as box:
        report.warnings = box.warnings
        worker = None
        for c in checks(lab):  # in a student edition: replays of the reference's answers
            if c.exercise in copied:
                report.outcomes.append(
                    Outcome(c.name, c.exercise, FAILED, 0, c.points, copied[c.exercise])
                )
                continue
            if worker is None:
                worker, why = box.start()
                if worker is None:
                    if not report.outcomes or all(o.exercise in copied for o in report.outcomes):
                        report.load_error = box.unsandboxed(why)
                        break
                    raise RuntimeError(f"the grader's worker failed to restart: {why}")
            stretched = round(c.timeout_s * busy_factor(), 1)  # a shared machine: runner.py
            limit = min(stretched, time_limit or stretched)
            worker.ch.deadline = time.monotonic() + limit + MARGIN_S
            worker.ch.log = None
            try:
                worker.ch.call("reset")  # each check numbers the student's objects from 1
            except WorkerGone as e:  # it wrote lines of its own into the pipe, or died
                why = "the worker stopped answering" if isinstance(e, WorkerSilent) else str(e)
                outcome = Outcome(c.name, c.exercise, ERROR, 0, c.points, why)
            else:
                worker.ch.log = None if log is None else log.setdefault(c.name, [])
                outcome = run_check(c, worker.sub, limit)
            outcome.message = cut(box.unsandboxed(outcome.message), MAX_MESSAGE)
            outcome.score = min(outcome.score, c.points)  # by construction; said once more
            report.outcomes.append(outcome)
            if worker.ch.busy or worker.proc.poll() is not None:  # stopped mid-answer: a new one
                box.stop(worker)
                worker = None
    report.seconds = time.perf_counter() - start
    return report


MAX_MESSAGE = 3000  # characters of one check's message (the grader's text, the student's values)


def run(lab_id: str, paths: list[str], reference: bool, json_path: str | None) -> int:
    """``python -m pagedlearn grade``: print the report, write the JSON, return the exit code."""
    if not reference and not paths:
        print(
            "grade: name the submission (.py files or the lab notebook), or --reference",
            file=sys.stderr,
        )
        return 2
    report = grade(lab_id, paths, reference)
    for warning in report.warnings:
        print(f"grade: warning: {warning}", file=sys.stderr)
    if json_path:
        Path(json_path).write_text(json.dumps(report.gradescope(), indent=2) + "\n")
    if report.load_error is not None:
        print(report.text(), file=sys.stderr)
    else:
        print(report.text())
    return report.exit_code


__all__ = ["Report", "SubmissionError", "grade", "run"]
