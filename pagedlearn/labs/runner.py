"""Run one check against a submission, in this process, and turn what happens into a verdict.

Four things can happen, and each gets a message a student can act on:

- the check returns: **passed**, full points;
- it raises :class:`CheckFailed`: **failed**, with the check's own message (the operations, the
  expected and the actual result);
- the student's code raises ``NotImplementedError``: **not implemented yet**, quoting the stub's
  task ("allocator: take n free blocks, all or nothing");
- anything else (their code crashed, or loops past the time limit): **error**, naming the
  exception and the line of their code that raised.

The time limit uses ``SIGALRM``, so it interrupts a Python loop (in the notebook) or the wait
for the student's process (in the grader, where their code runs in a worker it can kill:
grader.py); a worker that ends or overruns its deadline mid-check is an error of that check.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from pagedlearn.labs.lab import Check, CheckFailed, student_line
from pagedlearn.labs.remote import WorkerGone, WorkerSilent

PASSED, FAILED, NOT_DONE, ERROR = "passed", "failed", "not implemented", "error"
MARK = {PASSED: "PASS", FAILED: "FAIL", NOT_DONE: "TODO", ERROR: "FAIL"}  # how a line starts


@dataclass
class Outcome:
    check: str
    exercise: str
    status: str  # PASSED, FAILED, NOT_DONE or ERROR
    score: int
    max_score: int
    message: str = ""
    seconds: float = 0.0
    picture: Any = None  # CheckFailed.picture, for the notebook; never sent across processes

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def lines(self, exercise: bool = False) -> list[str]:
        """How a report shows it: ``[FAIL] 0/2  <check>``, then the message, indented."""
        where = f"{self.exercise}: " if exercise else ""
        head = f"[{MARK[self.status]}] {self.score}/{self.max_score}  {where}{self.title}"
        return [head, *("       " + line for line in self.message.splitlines())]

    @property
    def title(self) -> str:
        return self.check.replace("_", " ")

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "picture"}


class CheckTimeout(BaseException):
    """A check's time is up. A BaseException, so that a check's ``except Exception`` (which
    turns the student's errors into verdicts) lets it through to :func:`run_check`."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`CheckTimeout` in this thread after ``seconds`` (in the main thread of a
    Unix process; elsewhere it does nothing, and the grader's process-level limit still
    applies)."""
    main = threading.current_thread() is threading.main_thread()
    if not main or seconds <= 0 or not hasattr(signal, "setitimer"):  # setitimer: not on Windows
        yield
        return

    def expire(signum, frame):
        raise CheckTimeout

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


MAX_BUSY_FACTOR = 8.0  # past that, a machine is too busy to grade on: the limit stops growing


def busy_factor() -> float:
    """How many times its idle-machine time limit a check gets here: the 1-minute load average
    per CPU (:func:`pagedlearn.cli.threads.load_per_cpu`, the thread count's reading of the
    load), at least 1 and at most :data:`MAX_BUSY_FACTOR`. On a machine that other jobs share
    (a course's server grading a class at once), a correct answer waits for a core, and a fixed
    wall-clock limit would call it an endless loop; an endless loop is still stopped, a few
    times later.

    >>> 1.0 <= busy_factor() <= MAX_BUSY_FACTOR
    True
    """
    from pagedlearn.cli.threads import load_per_cpu, usable_cpus

    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # (no load average on this system)
        return 1.0
    usable = usable_cpus()
    per_cpu = load_per_cpu(load, os.cpu_count() or usable, usable)
    return min(MAX_BUSY_FACTOR, max(1.0, per_cpu))


def run_check(check: Check, sub: Any, timeout_s: float | None = None) -> Outcome:
    """Run ``check`` on ``sub`` with its time limit; never raises (except KeyboardInterrupt)."""
    limit = check.timeout_s if timeout_s is None else timeout_s
    start = time.perf_counter()
    status, message, picture = PASSED, "", None
    try:
        with time_limit(limit):
            check.func(sub)
    except CheckFailed as e:
        status, message, picture = FAILED, e.message, e.picture
        if isinstance(e.__cause__, NotImplementedError):
            status, message = NOT_DONE, f"not implemented yet -- {e.__cause__}"
    except NotImplementedError as e:
        status, message = NOT_DONE, f"not implemented yet -- {e}"
    except WorkerSilent:  # the process running their code overran the deadline
        status = ERROR
        message = (
            f"took longer than {limit:g} s and was stopped: an endless loop, or code stuck "
            "where it cannot be interrupted?"
        )
    except WorkerGone as e:  # ... or ended, or broke the protocol
        status, message = ERROR, str(e)
    except CheckTimeout:
        status = ERROR
        message = (
            f"took longer than {limit:g} s and was stopped: an endless loop? (a correct "
            "answer takes well under a second here)"
        )
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # their code crashed outside any operation the check named
        status = ERROR
        message = f"your code raised {type(e).__name__}: {e}{student_line(e)}"
    seconds = time.perf_counter() - start
    score = check.points if status == PASSED else 0
    return Outcome(
        check.name, check.exercise, status, score, check.points, message, seconds, picture
    )
