"""The grader: run a lab's checks on a submission in a child process, with a time limit per check.

::

    python -m pagedlearn grade LAB SUBMISSION... [--json results.json]
    python -m pagedlearn grade LAB --reference

Why a child process: a student's code may loop forever, exhaust memory, call ``sys.exit`` or
crash the interpreter. The checks run in a worker (worker.py) that reports each verdict as one
line of JSON; this side waits for each line at most the check's time limit (plus a margin for
code stuck where the worker's own ``SIGALRM`` cannot reach). A check that overruns or kills the
worker loses its points with a message that says so; a fresh worker carries on with the next
check. So a broken submission costs points, never the grader.

Exit status: 0 when every check passes, 1 when some fail, 2 when the submission cannot be loaded
(missing file, syntax error, an error while it loads: a one-line message, no traceback).

``--json PATH`` writes Gradescope's autograder ``results.json`` (``score``, ``tests`` with
``name``, ``score``, ``max_score``, ``output``, ``status``), so ``grade`` can be an autograder's
last line unchanged (README, "For instructors").
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedlearn.labs import copies, get
from pagedlearn.labs.lab import Lab
from pagedlearn.labs.runner import ERROR, FAILED, NOT_DONE, PASSED, Outcome
from pagedlearn.labs.submission import SubmissionError

LOAD_TIMEOUT_S = 60.0  # importing torch / triton and the submission
MARGIN_S = 10.0  # past a check's own limit before the worker is killed


@dataclass
class Report:
    lab: Lab
    origin: str
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    load_error: str | None = None

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
) -> Report:
    """Grade ``paths`` (or the package's own code) on lab ``lab_id``; never raises for anything a
    submission does (a load failure is ``report.load_error``). ``time_limit`` caps every
    check's own limit (the tests use it to keep a looping submission quick to grade)."""
    lab = get(lab_id)
    origin = "the reference (the package's own code)" if reference else ", ".join(paths or [])
    report = Report(lab, origin)
    start = time.perf_counter()
    # An exercise whose graded functions the submission imports or copies from the package
    # scores 0 without running (copies.py reads the files; it never runs them).
    copied = {} if reference else copies.find_copies(lab, list(paths or []))
    report.outcomes += [
        Outcome(c.name, c.exercise, FAILED, 0, c.points, copied[c.exercise])
        for c in lab.checks
        if c.exercise in copied
    ]
    remaining = [c.name for c in lab.checks if c.exercise not in copied]
    limits = {c.name: min(c.timeout_s, time_limit or c.timeout_s) for c in lab.checks}
    by_name = {c.name: c for c in lab.checks}
    first = True
    while remaining:
        with _Worker(lab_id, paths or [], reference, remaining, time_limit) as worker:
            loaded = worker.read(LOAD_TIMEOUT_S)
            if loaded is None or "load_error" in loaded:
                why = (
                    loaded["load_error"]
                    if loaded
                    else worker.died_or_timed_out(f"loading it took over {LOAD_TIMEOUT_S:g} s")
                )
                if first:
                    report.outcomes = []
                    report.load_error = why
                    report.seconds = time.perf_counter() - start
                    return report
                raise RuntimeError(f"the grader's worker failed to restart: {why}")
            first = False
            for name in list(remaining):
                line = worker.read(limits[name] + MARGIN_S)
                remaining.remove(name)
                if line is None:  # overran its limit in a way SIGALRM could not stop, or died
                    c = by_name[name]
                    why = worker.died_or_timed_out(f"took longer than {limits[name]:g} s")
                    report.outcomes.append(
                        Outcome(c.name, c.exercise, ERROR, 0, c.points, why, limits[name])
                    )
                    break  # a fresh worker for the rest
                report.outcomes.append(Outcome(**line))
    order = {c.name: i for i, c in enumerate(lab.checks)}
    report.outcomes.sort(key=lambda o: order[o.check])
    report.seconds = time.perf_counter() - start
    return report


class _Worker:
    """A child ``python -m pagedlearn.labs.worker`` and the JSON lines it writes."""

    def __init__(self, lab_id, paths, reference, checks, time_limit) -> None:
        job = json.dumps({"checks": checks, "time_limit": time_limit})
        cmd = [sys.executable, "-m", "pagedlearn.labs.worker", lab_id, job]
        cmd += ["--reference"] if reference else [str(p) for p in paths]
        # What the submission printed, shown when it crashes; closed in __exit__.
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115
        root = str(Path(__file__).resolve().parents[2])
        env = {
            # One thread for torch's CPU ops: the checks run tiny shapes, where more threads only
            # contend (on a busy 2-core machine a forward pass went from 2 ms to 200 ms).
            "OMP_NUM_THREADS": "1",
            # Grading needs no model hub: a lab notebook's setup() need not probe it.
            "PAGEDLEARN_OFFLINE": "1",
            **os.environ,
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.stderr, env=env
        )
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.buf = b""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.stderr.close()

    def read(self, timeout: float) -> dict | None:
        """The next JSON line, or None when the worker is silent for ``timeout`` s or exits."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                self.proc.kill()
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:  # EOF: the worker exited
                self.proc.wait()
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def died_or_timed_out(self, timed_out: str) -> str:
        """Why the worker went silent, for the student."""
        code = self.proc.wait()
        if code not in (-9, None) and code != 0:
            self.stderr.seek(0)
            tail = self.stderr.read().decode(errors="replace").strip().splitlines()[-1:]
            last = f"; its last words: {tail[0][:200]}" if tail else ""
            return f"your code ended the Python process (exit status {code}){last}"
        if code == 0:
            return "your code ended the Python process (sys.exit or os._exit)"
        return timed_out + ": an endless loop, or code stuck where it cannot be interrupted?"


def run(lab_id: str, paths: list[str], reference: bool, json_path: str | None) -> int:
    """``python -m pagedlearn grade``: print the report, write the JSON, return the exit code."""
    if not reference and not paths:
        print(
            "grade: name the submission (.py files or the lab notebook), or --reference",
            file=sys.stderr,
        )
        return 2
    report = grade(lab_id, paths, reference)
    if json_path:
        Path(json_path).write_text(json.dumps(report.gradescope(), indent=2) + "\n")
    if report.load_error is not None:
        print(report.text(), file=sys.stderr)
    else:
        print(report.text())
    return report.exit_code


__all__ = ["Report", "SubmissionError", "grade", "run"]
