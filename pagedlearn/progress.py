"""Progress lines for the long commands (``paper``, ``figures``, the serving and hybrid benchmarks).

A long run should say what it is doing, how long it has taken, and how long it will still take,
computed from the work it has measured: ``estimate`` assumes the rest of the work costs what the
work done so far cost per unit (a simulated token, a timed call, a generated token), and every
line says how much work that was and how long it took, so that a reader can judge it. No duration
is ever assumed.

Lines go to stderr, flushed, so that a command's results on stdout stay parseable and a run piped
into ``tee`` shows its progress as it goes. On a terminal the same numbers are a tqdm bar (redrawn
in place); elsewhere (a pipe, a log, CI) they are plain lines, at most one per ``every`` seconds.
"""

from __future__ import annotations

import sys
import time


def estimate(elapsed: float, done: float, total: float) -> float | None:
    """Seconds left if the ``total - done`` units left cost what the ``done`` ones did.
    None before any unit is done (nothing measured yet).

    >>> estimate(40.0, 2, 6)  # 2 units took 40 s: 4 more take about 80 s
    80.0
    >>> estimate(3.0, 0, 6) is None
    True
    """
    if done <= 0:
        return None
    return elapsed / done * max(total - done, 0)


def seconds(s: float) -> str:
    """A duration as a reader says it.

    >>> seconds(8.2), seconds(135)
    ('8 s', '2 min 15 s')
    """
    s = round(s)
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s"


def write(text: str, file=None) -> None:
    """Print ``text`` (to stdout, flushed) without breaking a bar drawn on the terminal: tqdm
    clears the bars, prints, and draws them again below. The commands' results go this way."""
    from tqdm import tqdm

    file = file if file is not None else sys.stdout
    tqdm.write(text, file=file)
    file.flush()


class Stopwatch:
    """The time since a command started, said as :func:`seconds` says it (``f"{watch}"``), for
    the lines that say what starts next: ``watch.note(text)`` prints ``text, 12 s so far`` on
    stderr.

    >>> watch = Stopwatch(clock=iter([0.0, 75.0]).__next__)
    >>> f"done in {watch}"
    'done in 1 min 15 s'
    """

    def __init__(self, clock=time.monotonic) -> None:
        self.clock, self.start = clock, clock()

    def __str__(self) -> str:
        return seconds(self.clock() - self.start)

    def note(self, text: str, file=None) -> None:
        """``text, <time> so far`` on ``file`` (stderr), above a bar on a terminal."""
        write(f"{text}, {self} so far", file if file is not None else sys.stderr)


class Progress:
    """``total`` units of work called ``unit`` (plural), labelled ``label``; ``update(n, what)``
    after each piece of work. ``note(text)`` prints a line of its own (what starts next).

    ``file``: where the lines go (stderr); ``every``: the fewest seconds between two plain lines
    (0: a line per update; the last unit always gets its line); ``clock``: for tests.
    """

    def __init__(self, label, total, unit, file=None, every=0.0, clock=time.monotonic, bar=None):
        self.label, self.total, self.unit, self.every, self.clock = label, total, unit, every, clock
        self.file = file if file is not None else sys.stderr
        self.done, self.start = 0, clock()
        self.printed = self.start  # the first plain line after ``every`` s of work
        self.bar = None
        tty = getattr(self.file, "isatty", lambda: False)() if bar is None else bar
        if tty:  # a bar redrawn in place; plain lines would scroll the screen away
            from tqdm import tqdm

            fmt = "{desc}: {n_fmt}/{total_fmt} {unit} |{bar}| {elapsed} so far, {remaining} left"
            self.bar = tqdm(total=total, desc=label, unit=unit, file=self.file, smoothing=0,
                            bar_format=fmt + " (at the {rate_fmt} measured so far)")  # fmt: skip

    def line(self, what: str = "") -> str:
        """What a plain line says now: the work done, the time, the estimate and its basis.

        >>> p = Progress("sweep", 6, "runs", clock=iter([0.0, 40.0]).__next__)
        >>> p.done = 2
        >>> p.line("rate 10 done")
        'sweep, rate 10 done: 2/6 runs in 40 s; about 1 min 20 s left at that rate'
        """
        elapsed = self.clock() - self.start
        left = estimate(elapsed, self.done, self.total)
        head = f"{self.label}, {what}" if what else self.label
        head += f": {self.done:,}/{self.total:,} {self.unit}"
        if left is None:
            return f"{head}, {seconds(elapsed)} so far"
        if self.done >= self.total:
            return f"{head}, done in {seconds(elapsed)}"
        return f"{head} in {seconds(elapsed)}; about {seconds(left)} left at that rate"

    def update(self, n: float = 1, what: str = "") -> None:
        """``n`` more units done; ``what``: the piece of work just done."""
        self.set(self.done + n, what=what)

    def set(self, done: float, total: float | None = None, what: str = "") -> None:
        """``done`` units done so far, of ``total`` (when the plan changed, e.g. a sweep that
        stops early: the estimate then covers what is really left). ``set(0, total)`` says the
        work starts now: the clock restarts, so that set-up (loading a model, a warm-up) is not
        counted as the first units' cost."""
        step, self.done = done - self.done, done
        if step == 0 and total in (None, self.total) and done:
            return  # nothing new to say
        self.total = self.total if total is None else total
        if done == 0:
            self.start = self.printed = self.clock()
            if self.bar is not None:
                self.bar.reset(total=self.total)  # its clock too
            return
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.set_description_str(f"{self.label}, {what}" if what else self.label, False)
            self.bar.update(step)
            return
        now = self.clock()
        if now - self.printed >= self.every or self.done >= self.total:
            self.printed = now
            print(self.line(what), file=self.file, flush=True)

    def note(self, text: str) -> None:
        """A line of its own (what starts next), above the bar on a terminal."""
        write(text, self.file)

    def close(self) -> None:
        """Leave the bar as it ended (a terminal); plain lines need nothing."""
        if self.bar is not None:
            self.bar.close()
