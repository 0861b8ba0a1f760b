"""The grader's line to the student's code: checks run here, the student's code runs over there.

A check needs two things a submission must never touch: the reference (to know the right
answer) and the verdict. So the grader runs every check in *its* process, which has the
reference, and the student's code in a sandboxed worker (worker.py, sandbox.py) that has only an
edition of pagedlearn where the lab's graded functions are stubs. They talk over a pipe, one
numbered JSON request and one answer carrying the same number at a time (a line the submission
writes into the pipe itself is an answer out of turn: that check errors, the worker is replaced)::

    grading process (checks, reference, verdicts)        worker (student edition + submission)
    sub.KVCacheManager(num_blocks=8, block_size=4)  ->   calls the student's class
                                                    <-   {"ok": {"h": 1, "type": ...}}  a handle
    kv.fork("a", "b")                               ->   the student's fork on object 1
                                                    <-   {"ok": null}

What comes back is a *value*: numbers, strings, bytes, lists, tuples, dicts, sets and CPU
tensors are copied; any other object stays in the worker and comes back as a :class:`Remote`
handle, whose attributes and calls are requests again. The worker answers what the student's
code returned or raised, nothing else: it cannot see the expected values, and nothing it says is
a verdict. A check may also run a whole *observation* over there, :func:`in_student`, when one
call per step would be slow or when the student's code must run against objects that live there
(an engine, a Triton kernel).

What may cross, and how an exception is rebuilt here as the grader's own class, is wire.py's.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import time
from collections.abc import Callable
from typing import Any

from pagedlearn.labs.wire import (
    Codec,
    WireError,
    cut,
    exception_from_wire,
    exception_to_wire,
    is_tensor,
)

MAX_LINE = 64 << 20  # bytes of one answer from the worker (a flood is cut off, not read)


class WorkerGone(BaseException):
    """The worker ended (exit, crash, kill) or broke the protocol; the message says which. A
    BaseException, so that a check's ``except Exception`` (which turns the student's errors into
    verdicts) lets it through to the runner."""


class WorkerSilent(WorkerGone):
    """The worker said nothing before the deadline (each caller words why for the student)."""


# --- the grader's side ----------------------------------------------------------------------------
class Channel:
    """The grader's end of the pipe to one worker: :meth:`ask` sends a request and returns the
    decoded answer, or raises what the student's code raised."""

    def __init__(self, proc, on_gone: Callable[[], str]) -> None:
        self.proc, self.on_gone = proc, on_gone
        self.sel = selectors.DefaultSelector()
        self.sel.register(proc.stdout, selectors.EVENT_READ)
        self.buf = b""
        self.codec = Codec(remote=lambda h, t: Remote(self, h, t), proxy=Remote)
        self.deadline: float | None = None  # set per check by the grader
        self.busy = False  # a request sent and its answer not read: the worker is mid-task
        self.sent: dict = {}
        self.log: list | None = None  # set to record the conversation (expected.py)
        self.number = 0  # of the last request: its answer must say the same
        self.note = ""  # what the next request means, in a check's words (for the recording)

    def read_line(self, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + timeout if timeout is not None else self.deadline
        while b"\n" not in self.buf:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not self.sel.select(left)):
                raise WorkerSilent("no answer before the deadline")
            if left is None:
                self.sel.select()
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise WorkerGone(self.on_gone())
            self.buf += chunk
            if len(self.buf) > MAX_LINE:
                raise WorkerGone(f"the worker sent over {MAX_LINE >> 20} MiB in one answer")
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            answer = json.loads(line)
        except ValueError:
            raise WorkerGone("the worker broke the protocol (not JSON)") from None
        if not isinstance(answer, dict):
            raise WorkerGone("the worker broke the protocol (not an object)")
        return answer

    def exchange(self, request: dict) -> dict:
        """Send ``request`` (numbered) and read its answer, which must carry the same number: a
        line the submission wrote itself into the pipe cannot pass for an answer unnoticed.
        Returns the answer without its number."""
        self.number += 1
        request = {**request, "n": self.number}
        self.busy = True  # until a valid answer is read: a worker out of step is replaced
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerGone(self.on_gone()) from None
        answer = self.read_line()
        if answer.pop("n", None) != self.number or not ("ok" in answer or "raised" in answer):
            raise WorkerGone("the worker broke the protocol (an answer out of turn)")
        self.busy = False
        return answer

    def ask(self, request: dict):
        answer = self.exchange(request)
        if self.log is not None:
            self.log.append({"q": request, "a": answer, "note": self.note})
        self.note = ""
        if "raised" in answer:
            raise exception_from_wire(answer["raised"])
        try:
            for i, t in answer.get("wb", []):  # tensors the call wrote into, copied back
                arg = request["args"][i] if 0 <= i < len(request.get("args", [])) else None
                target = self.sent.get(id(arg)) if arg is not None else None
                if target is not None:
                    new = self.codec.decode(t)
                    if new.shape == target.shape and new.dtype == target.dtype:
                        target.copy_(new.to(target.device))
            return self.codec.decode(answer["ok"])
        except (WireError, TypeError, ValueError, KeyError) as e:  # whatever it sent, refused
            raise WorkerGone(f"the worker sent what the grader does not accept: {e}") from None

    def ask_raw(self, request: dict) -> dict:
        """Send a request as it is; its answer as it came (expected.py replays recordings)."""
        return self.exchange(request)

    def call(self, op: str, h: int | None = None, *args, **fields):
        """Request ``op`` on handle ``h`` with ``args`` (tensors among them are written back)."""
        self.sent = {}
        enc_args = []
        for a in args:
            e = self.codec.encode(a)
            if isinstance(e, dict) and "t" in e:
                self.sent[id(e)] = a
            enc_args.append(e)
        request = {"op": op, "h": h, "args": enc_args, **fields}
        if "kwargs" in fields:
            request["kwargs"] = {k: self.codec.encode(v) for k, v in fields["kwargs"].items()}
        return self.ask(request)


class Remote:
    """An object of the student's, living in the worker; every use of it is a request."""

    __slots__ = ("_ch", "_h", "_type")

    def __init__(self, ch: Channel, h: int, type_name: str) -> None:
        object.__setattr__(self, "_ch", ch)
        object.__setattr__(self, "_h", h)
        object.__setattr__(self, "_type", type_name)

    def _do(self, op, *args, **fields):
        return object.__getattribute__(self, "_ch").call(
            op, object.__getattribute__(self, "_h"), *args, **fields
        )

    def __getattr__(self, name: str):
        return self._do("getattr", name=name)

    def __setattr__(self, name: str, value) -> None:
        self._do("setattr", value, name=name)

    def __call__(self, *args, **kwargs):
        return self._do("call", *args, kwargs=kwargs)

    def __repr__(self) -> str:
        return cut(str(self._do("dunder", name="__repr__")))

    def __str__(self) -> str:
        return cut(str(self._do("dunder", name="__str__")))

    def __iter__(self):
        return iter(self._do("iterate"))

    def __len__(self) -> int:
        return int(self._do("dunder", name="__len__"))

    def __bool__(self) -> bool:
        return bool(self._do("truth"))

    def __contains__(self, item) -> bool:
        return bool(self._do("dunder", item, name="__contains__"))

    def __getitem__(self, key):
        return self._do("dunder", key, name="__getitem__")

    def __eq__(self, other) -> bool:
        if isinstance(other, Remote):
            return object.__getattribute__(self, "_h") == object.__getattribute__(other, "_h")
        return NotImplemented

    def __hash__(self) -> int:  # the handle number: equal handles, equal hashes
        return object.__getattribute__(self, "_h")


class RemoteSubmission:
    """The submission as the checks see it in the grader: ``sub.BlockAllocator`` is the
    student's class, over in the worker."""

    def __init__(self, ch: Channel, origin: str) -> None:
        self._ch, self._origin = ch, origin

    def __getattr__(self, name: str):
        from pagedlearn.labs.lab import CheckFailed

        if name.startswith("__"):
            raise AttributeError(name)
        if not self._ch.call("has", None, name=name):
            raise CheckFailed(f"{self._origin} does not define {name!r}")
        return self._ch.call("name", None, name=name)

    def __contains__(self, name: str) -> bool:
        return bool(self._ch.call("has", None, name=name))

    def __repr__(self) -> str:
        return f"Submission({self._origin})"


def say(sub, text: str) -> None:
    """What the next request to the student's code means (``"in a pool of 4 blocks, after
    allocate(3): free([1])"``): kept with it when the conversation is recorded."""
    if isinstance(sub, RemoteSubmission):
        sub._ch.note = text


def in_student(sub, func, *args):
    """``func(sub, *args)``, run where the student's code is: in this process for a local
    submission (the notebook), in the worker for a :class:`RemoteSubmission` (the grader).
    ``func`` is a module-level function of a ``pagedlearn.labs`` module. Over there, what it
    returns comes back as a value, or as a :class:`Remote` handle for an object (which a later
    ``in_student`` call can take as an argument)."""
    name = f"{func.__module__}:{func.__qualname__}"
    if not func.__module__.startswith("pagedlearn.labs.") or "." in func.__qualname__:
        raise ValueError(f"in_student runs module-level functions of pagedlearn.labs, not {name}")
    if isinstance(sub, RemoteSubmission):
        return sub._ch.call("observe", None, *args, func=name)
    return func(sub, *args)


# --- the worker's side ----------------------------------------------------------------------------
class Host:
    """The worker's end: holds the student's objects by handle and answers requests on them."""

    def __init__(self, sub) -> None:
        self.sub = sub
        self.objects: dict[int, Any] = {}
        self.numbers: dict[int, int] = {}  # id(obj) -> handle: the same object, the same handle
        self.codec = Codec(handle=self._handle, resolve=self._resolve)

    def reset(self) -> None:
        """Forget every handle: a new check numbers its objects from 1 (so a recording of one
        check replays on its own)."""
        self.objects.clear()
        self.numbers.clear()

    def _handle(self, obj) -> int:
        h = self.numbers.get(id(obj))
        if h is None:
            h = self.numbers[id(obj)] = len(self.objects) + 1
            self.objects[h] = obj  # kept alive, so that id() is never reused
        return h

    def _resolve(self, h):
        if h not in self.objects:
            raise ValueError(f"no object {h}")
        return self.objects[h]

    def answer(self, request: dict) -> dict:
        """The answer to ``request``, carrying its number (``n``) when it has one."""
        out = self._answer(request)
        if "n" in request:
            out["n"] = request["n"]
        return out

    def _answer(self, request: dict) -> dict:
        try:
            args = [self.codec.decode(a) for a in request.get("args", [])]
            kwargs = {k: self.codec.decode(v) for k, v in request.get("kwargs", {}).items()}
            value = self._do(request, args, kwargs)
            out = {"ok": self.codec.encode(value)}
            if request["op"] in ("call", "observe"):  # what the call wrote into, sent back
                wb = [[i, self.codec.encode(a)] for i, a in enumerate(args) if is_tensor(a)]
                if wb:
                    out["wb"] = wb
            return out
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit too: a submission must not end the worker
            return {"raised": exception_to_wire(e)}

    def _do(self, request: dict, args: list, kwargs: dict):
        op, name = request.get("op"), request.get("name")
        target = self._resolve(request["h"]) if request.get("h") is not None else None
        if op == "reset":
            return self.reset()
        if op == "has":
            return name in self.sub
        if op == "name":
            return getattr(self.sub, name)
        if op == "getattr":
            return getattr(target, name)
        if op == "setattr":
            return setattr(target, name, args[0])
        if op == "call":
            return target(*args, **kwargs)
        if op == "iterate":
            return list(target)
        if op == "truth":
            return bool(target)
        if op == "dunder" and name in ("__repr__", "__str__"):
            return (repr if name == "__repr__" else str)(target)
        if op == "dunder" and name in ("__len__", "__contains__", "__getitem__"):
            return getattr(target, name)(*args)
        if op == "observe":
            module, _, func = str(request.get("func")).partition(":")
            if not module.startswith("pagedlearn.labs.") or "." in func:
                raise ValueError(f"not an observation: {request.get('func')!r}")
            fn = getattr(importlib.import_module(module), func)
            return fn(self.sub, *args)
        raise ValueError(f"unknown request {op!r}")
