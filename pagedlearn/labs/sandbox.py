"""Where the student's code runs while the grader (grader.py) checks it: a sandboxed worker.

:class:`Sandbox` makes a temporary folder holding copies of the submitted files and the edition
of pagedlearn the worker imports (student_edition.py: this lab's graded bodies blanked; in a
student edition, the edition itself, with the student's own earlier labs put in place), and
starts workers there (worker.py), each::

    python -I -c BOOT <edition> <lab> <files...>      (remote.py's protocol on stdin/stdout)

with its own session (``setsid``: everything it starts is killed with it), a minimal
environment (none of the grader's variables: a token there would be one raise away from the
feedback), limits on address space, CPU time, file size and core dumps, and -- when the grader is
root, as on Gradescope -- an unprivileged user (``nobody``, or ``$PAGEDLEARN_GRADER_USER``) with
a process limit, if that user can run this Python (else a warning says why it runs as root). On
exit every process of the sandbox is killed: each worker's process group, then anything that
left it with ``setsid`` (this process is their "subreaper": orphans come back to it, and are
killed until none is left), and the folder is removed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOAD_TIMEOUT_S = 60.0  # importing torch / triton and the submission


class _Worker:
    """A running worker: its process, the pipe to it (remote.Channel) and the submission's
    names as the checks see them (remote.RemoteSubmission)."""

    def __init__(self, proc, stderr, origin: str) -> None:
        from pagedlearn.labs.remote import Channel, RemoteSubmission

        self.proc, self.stderr = proc, stderr
        self.ch = Channel(proc, self.why_gone)
        self.sub = RemoteSubmission(self.ch, origin)

    def why_gone(self) -> str:
        """Why the worker went silent, for the student."""
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "the worker stopped answering"
        if code not in (-9, None) and code != 0:
            self.stderr.seek(0)
            tail = self.stderr.read().decode(errors="replace").strip().splitlines()[-1:]
            last = f"; its last words: {tail[0][:200]}" if tail else ""
            return f"your code ended the Python process (exit status {code}){last}"
        if code == 0:
            return "your code ended the Python process (sys.exit or os._exit)"
        return "the process running your code was killed (out of memory or CPU time?)"


class Sandbox:
    """Where the student's code runs: a temporary folder with copies of the submitted files, a
    worker process per :meth:`start`, and everything they started killed on exit."""

    def __init__(self, lab_id: str, paths: list[str], reference: bool) -> None:
        self.lab_id, self.reference, self.warnings = lab_id, reference, []
        self.dir = Path(tempfile.mkdtemp(prefix="pagedlearn-grade-"))
        self.user = None if reference else _sandbox_user(self.warnings)
        self.files: list[str] = []
        self.renames: dict[str, str] = {}  # the copies' paths -> the paths the grader was given
        self.workers: list[_Worker] = []
        _become_subreaper()
        self.ours = _children()  # the grader's own children before the sandbox: never killed
        try:
            self._prepare(paths)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def _prepare(self, paths: list[str]) -> None:
        from pagedlearn.labs.student_edition import edition_for_grading, is_student_edition

        home = self.dir / "home"
        home.mkdir()
        here = Path(__file__).resolve().parents[2]  # the folder holding this pagedlearn
        if self.reference:
            self.root = here
            return
        self.root = self.dir / "edition"
        if is_student_edition():  # all stubs already: these very packages
            for package in ("pagedlearn", "kernels"):
                ignore = shutil.ignore_patterns("__pycache__")
                shutil.copytree(here / package, self.root / package, ignore=ignore)
            _place(paths, self.root)  # the student's own earlier labs, where the package has them
        else:
            shutil.copytree(edition_for_grading(self.lab_id), self.root)
        sub = self.dir / "submission"
        sub.mkdir()
        for p in map(Path, paths):  # a missing file is the worker's one-line load error
            dst = sub / p.name
            if p.is_file() and not dst.exists():
                shutil.copyfile(p, dst)
                self.renames[str(dst)] = str(p)
            self.files.append(str(dst) if p.is_file() else str(p))
        self.dir.chmod(0o755)
        if self.user is not None:
            for path in [self.dir, *self.dir.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            os.chown(home, self.user.pw_uid, self.user.pw_gid)

    def unsandboxed(self, text: str) -> str:
        """``text`` naming the submitted files as the grader was given them, not their copies."""
        for copy, given in self.renames.items():
            text = text.replace(copy, given)
        return text

    def start(self) -> tuple[_Worker | None, str]:
        """A fresh worker with the submission loaded, or ``(None, why not)``."""
        from pagedlearn.labs.remote import WorkerGone, WorkerSilent
        from pagedlearn.labs.worker import BOOT

        args = ["--reference"] if self.reference else self.files
        cmd = [sys.executable, "-I", "-c", BOOT, str(self.root), self.lab_id, *args]
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 -- what the submission printed
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=_environment(self.dir / "home"),
            cwd=self.dir,
            start_new_session=True,  # its own session and process group: killed as one
            preexec_fn=lambda: _limit(self.user),
        )
        worker = _Worker(proc, stderr, "your submission")
        self.workers.append(worker)
        try:
            loaded = worker.ch.read_line(LOAD_TIMEOUT_S)
        except WorkerGone as e:  # died, or took too long
            why = (
                f"loading it took over {LOAD_TIMEOUT_S:g} s"
                if isinstance(e, WorkerSilent)
                else str(e)
            )
            self.stop(worker)
            return None, why
        if "load_error" in loaded:
            self.stop(worker)
            return None, str(loaded["load_error"])[:1000]
        return worker, ""

    def stop(self, worker: _Worker) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait()
        for f in (worker.proc.stdin, worker.proc.stdout, worker.stderr):
            with contextlib.suppress(OSError):  # a request still buffered for a dead process
                f.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        for w in self.workers:
            if not w.stderr.closed:
                self.stop(w)
        _reap(self.ours)
        shutil.rmtree(self.dir, ignore_errors=True)


# --- the sandbox's parts --------------------------------------------------------------------------
def _place(paths: list[str], root: Path) -> None:
    """In a student edition, where every lab's functions are stubs, a cow submission runs on
    the allocator the student wrote in lab 1: each submitted ``.py`` file named like a lab's
    file (``block_allocator.py``) replaces that module of the package copy the worker imports,
    if it compiles (else the loader reports it, in one line)."""
    from pagedlearn.labs import all_labs

    modules = {Path(f).name: f for lab in all_labs() for f in lab.files}
    for p in map(Path, paths):
        if p.name in modules and p.is_file():
            try:
                compile(p.read_text(), str(p), "exec")
            except (SyntaxError, ValueError, OSError, UnicodeDecodeError):
                continue
            shutil.copyfile(p, root / modules[p.name])


MEMORY_LIMIT = 8 << 30  # bytes of address space: torch and triton's interpreter need ~2 GiB
CPU_LIMIT_S = 900  # CPU seconds of one worker (it serves a lab's checks: each has its own limit)


def _environment(home: Path) -> dict:
    """The worker's environment: what Python, torch and triton need, and none of the grader's
    other variables (a token there would be one raise away from the feedback)."""
    keep = ("PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")
    keep += ("PAGEDLEARN_NUM_THREADS",)  # the one override of OMP_NUM_THREADS (cli/threads.py)
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(
        HOME=str(home),
        TMPDIR=str(home),
        MPLCONFIGDIR=str(home),
        TRITON_CACHE_DIR=str(home / "triton"),
        OMP_NUM_THREADS="1",  # the checks run tiny shapes: more threads only contend
        PAGEDLEARN_OFFLINE="1",  # grading needs no model hub
        HF_HUB_OFFLINE="1",
        MPLBACKEND="Agg",
    )
    return env


def _limit(user) -> None:
    """In the worker, before it runs Python: resource limits, then the unprivileged user."""
    import resource

    cuda = os.path.exists("/dev/nvidiactl")  # CUDA reserves far more address space than it uses
    limits = [(resource.RLIMIT_CPU, CPU_LIMIT_S), (resource.RLIMIT_CORE, 0)]
    limits += [(resource.RLIMIT_FSIZE, 256 << 20)]
    limits += [] if cuda else [(resource.RLIMIT_AS, MEMORY_LIMIT)]
    if user is not None:
        limits.append((resource.RLIMIT_NPROC, 256))
    for what, n in limits:
        resource.setrlimit(what, (n, n))
    if user is not None:
        os.setgroups([])
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)


def _sandbox_user(warnings: list[str]):
    """As root: the unprivileged user the worker runs as, if it can run this Python."""
    if os.geteuid() != 0:
        return None
    user, warning = _probe_user(os.environ.get("PAGEDLEARN_GRADER_USER", "nobody"))
    warnings += [warning] if warning else []
    return user


@functools.cache
def _probe_user(name: str):
    """``(the user, "")``, or ``(None, why not)`` (asked once per process: it imports torch)."""
    try:
        user = pwd.getpwnam(name)
    except KeyError:
        return None, f"no user {name!r}: the submission runs as root"
    try:
        probe = subprocess.run(
            [sys.executable, "-I", "-c", "import torch"],
            preexec_fn=lambda: (os.setgroups([]), os.setgid(user.pw_gid), os.setuid(user.pw_uid)),
            capture_output=True,
            cwd="/",
            env={"PATH": os.environ.get("PATH", ""), "HOME": "/"},
        ).returncode
    except OSError:  # it cannot even execute the interpreter
        probe = 126
    if probe != 0:
        return None, (
            f"user {name!r} cannot run {sys.executable} with torch (is it under a private "
            "folder?): the submission runs as root, and can read what root can -- install "
            "Python where every user can read it (README, For instructors)"
        )
    return user, ""


def _become_subreaper() -> None:
    """Orphans of the sandbox (a grandchild that left with setsid) come back to this process."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _children() -> set[int]:
    me, found = os.getpid(), set()
    for d in Path("/proc").glob("[0-9]*"):
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found.add(int(d.name))
    return found


def _reap(ours: set[int]) -> None:
    """Kill every child of this process that is not one of ``ours``, until none is left."""
    for _ in range(100):
        strays = _children() - ours
        if not strays:
            return
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        time.sleep(0.01)  # their own children come back to us: look again
