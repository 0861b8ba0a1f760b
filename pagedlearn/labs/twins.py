"""The harness of the memory labs: your object and the reference's, driven by the same calls.

A check of the ``allocator``, ``cow`` (and ``prefix``) labs makes each call -- ``allocate(2)``,
``fork('a', 'b')`` -- on the student's object and on the reference's, and compares them after
each one: what the call returned, or the kind of error it raised (an error the reference raises
on bad input is part of the contract, and must leave everything as it was), then every field of
a *snapshot* (refcounts, the free queue, block tables, pending copies...). The first difference
becomes a :class:`~pagedlearn.labs.lab.CheckFailed` in one shape::

    in a pool of 4 blocks, after allocate(3); free([1]) the free queue (next allocation first)
    should be [3, 1]; yours is [1, 3] (the same blocks in another order: ...)

with a picture of both pools side by side (pictures.py). Random call sequences go through
:func:`~pagedlearn.labs.lab.explore`, which shrinks a failing one to the shortest.
"""

from __future__ import annotations

from pagedlearn.errors import OutOfBlocksError, PagedLearnError
from pagedlearn.labs.lab import CheckFailed, crashed


class Once:
    """Ids handed over as an iterator (walked once, like a generator); each pool gets its own."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __repr__(self) -> str:
        return f"iter({self.ids})"


def _fresh(args: tuple) -> tuple:
    return tuple(iter(a.ids) if isinstance(a, Once) else a for a in args)


class Held:
    """The student's side of a :class:`Twins`, living where their code runs (the grader's
    worker, or the notebook): their object, and what its snapshot needs (the ids its eviction
    callback got, its trace log...). ``look(held)`` is the lab's snapshot function."""

    def __init__(self, obj, look, **extra) -> None:
        self.obj, self.look, self.extra = obj, look, extra
        self.before = None  # what the last call's snapshot needs from before it (see cow.py)


def step(sub, held: Held, name: str, args: list) -> dict:
    """Make one call on the student's object and snapshot it, where their code runs; returns
    plain data: ``out``, ``err`` (an exception, as remote.py sends one) or ``None``, ``snap``
    (or ``snap_err``). Their NotImplementedError and a CheckFailed pass through."""
    from pagedlearn.labs.wire import exception_to_wire

    held.before = held.look(held, before=True)
    out = err = None
    try:
        out = getattr(held.obj, name)(*args)
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as e:
        err = exception_to_wire(e)
    try:
        return {"out": out, "err": err, "snap": held.look(held)}
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as e:
        return {"out": out, "err": err, "snap_err": exception_to_wire(e)}


def ask(sub, held: Held, name: str, args: list):
    """A query on the student's object (``cached_prefix_tokens``), where their code runs."""
    return getattr(held.obj, name)(*args)


class Twins:
    """The harness of the memory labs: your object and the reference's, driven by the same calls
    and compared after each one. The first difference becomes a :class:`CheckFailed` naming the
    calls so far, what was expected and what yours gave, with both pools drawn side by side
    (in the notebook; the grader draws nothing).

    Your object lives where your code runs: ``make(sub, *config)`` (a module-level function of
    the lab) builds it there and returns a :class:`Held`; each call is one :func:`step` there,
    which returns what the call returned or raised and the snapshot. The reference's object
    lives here, in the process that decides. A subclass says what is compared
    (``snapshot(side="ref")`` and the Held's ``look``, the same fields in the order differences
    are reported), what the picture shows (:meth:`state`) and which hint goes with a
    difference."""

    queries: frozenset[str] = frozenset()  # calls that change nothing (left out of "after ...")

    def __init__(self, setup: str, ref, sub, make, *config) -> None:
        from pagedlearn.labs.remote import in_student

        self.setup, self.ref, self.sub, self.ops = setup, ref, sub, []
        self.yours = in_student(sub, make, *config)  # a Held (a handle to one, in the grader)
        self.last: dict = {}  # your side of the last call: out, err, snap

    def snapshot(self, side: str) -> dict:  # side: "ref"
        raise NotImplementedError

    def state(self, obj):  # a PoolState for the picture
        raise NotImplementedError

    def context(self, name: str):
        """What :meth:`result_hint` needs to know from before the call."""

    def result_hint(self, name: str, context, want, got) -> str:
        return ""

    def hint(self, field: str, want, got, name: str) -> str:
        return ""

    def where(self, ops: list[str]) -> str:
        return f"{self.setup}, after {'; '.join(ops)}" if ops else f"{self.setup}, first"

    def fail(self, message: str) -> CheckFailed:
        if not isinstance(self.yours, Held):  # in the grader: no pictures, only the verdict
            return CheckFailed(message)
        last = self.ops[-4:] if len(self.ops) <= 4 else ["...", *self.ops[-3:]]
        try:  # the state now: your code is not called again once the check has failed
            yours, ref = self.state(self.yours.obj), self.state(self.ref)
        except Exception:
            return CheckFailed(message)
        from pagedlearn.labs.pictures import side_by_side

        caption = f"yours vs the reference, {self.where(last)}"
        return CheckFailed(message, lambda: side_by_side(yours, ref, caption))

    def call(self, name: str, *args):
        """Make the call on both; raise CheckFailed at the first difference."""
        from pagedlearn.labs.remote import in_student, say
        from pagedlearn.labs.wire import exception_from_wire

        text = f"{name}({', '.join(map(repr, args))})"
        before, context = list(self.ops), self.context(name)
        self.ops.append(text)
        ref_out = ref_err = err = None
        try:
            ref_out = getattr(self.ref, name)(*_fresh(args))
        except PagedLearnError as e:
            ref_err = e
        say(self.sub, f"{self.where(before)}: {text}")
        self.last = r = in_student(self.sub, step, self.yours, name, list(_fresh(args)))
        out = r["out"]
        if r["err"] is not None:
            err = exception_from_wire(r["err"])
            if ref_err is None and not isinstance(err, PagedLearnError):
                raise crashed(self.ops, err)
        head = f"{self.where(before)}: {text}"
        if ref_err is not None:
            kind = OutOfBlocksError if isinstance(ref_err, OutOfBlocksError) else PagedLearnError
            if not isinstance(err, kind):
                got = f"returned {out!r}" if err is None else f"raised {type(err).__name__}: {err}"
                raise self.fail(f"{head} should raise {kind.__name__} ({ref_err}); yours {got}")
        elif err is not None:
            raise self.fail(
                f"{head} should return {ref_out!r}; yours raised {type(err).__name__}: {err}"
            )
        elif out != ref_out:
            hint = self.result_hint(name, context, ref_out, out)
            raise self.fail(f"{head} should return {ref_out!r}; yours returned {out!r}{hint}")
        self.compare(name, raised=ref_err is not None)
        if name in self.queries:  # it changed nothing: later messages need not list it
            self.ops.pop()
        return ref_out

    def compare(self, name: str, raised: bool = False) -> None:
        from pagedlearn.labs.wire import exception_from_wire

        want = self.snapshot("ref")
        if "snap_err" in self.last:
            raise crashed(self.ops, exception_from_wire(self.last["snap_err"]))
        got = self.last["snap"]
        for field, value in want.items():
            if field.startswith("_") or got.get(field) == value:
                continue
            verb = "is" if field.startswith("num_") or "queue" in field else "are"
            if raised:
                raise self.fail(
                    f"{self.where(self.ops[:-1])}: {self.ops[-1]} raised, as it should, but "
                    f"changed things -- an error must leave everything as it was (all or "
                    f"nothing): the {field} should still be {value}; yours {verb} {got.get(field)}"
                )
            raise self.fail(
                f"{self.where(self.ops)} the {field} should be {value}; yours {verb} "
                f"{got.get(field)}{self.hint(field, value, got.get(field), name)}"
            )
