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


class Twins:
    """The harness of the memory labs: your object and the reference's, driven by the same calls
    and compared after each one. The first difference becomes a :class:`CheckFailed` naming the
    calls so far, what was expected and what yours gave, with both pools drawn side by side.

    A subclass sets ``ref``, ``yours`` and ``setup`` (how the calls' context reads: "in a pool
    of 4 blocks"), and says what is compared (:meth:`snapshot`, in the order differences are
    reported), what the picture shows (:meth:`state`) and which hint goes with a difference."""

    queries: frozenset[str] = frozenset()  # calls that change nothing (left out of "after ...")

    def __init__(self, setup: str, ref, yours) -> None:
        self.setup, self.ref, self.yours, self.ops = setup, ref, yours, []

    def snapshot(self, side: str) -> dict:  # side: "ref" or "yours"
        raise NotImplementedError

    def state(self, obj):  # a PoolState for the picture
        raise NotImplementedError

    def method(self, name: str):
        """The function that makes call ``name`` on yours (your method, by default)."""
        return getattr(self.yours, name)

    def context(self, name: str):
        """What :meth:`result_hint` needs to know from before the call."""

    def result_hint(self, name: str, context, want, got) -> str:
        return ""

    def hint(self, field: str, want, got, name: str) -> str:
        return ""

    def where(self, ops: list[str]) -> str:
        return f"{self.setup}, after {'; '.join(ops)}" if ops else f"{self.setup}, first"

    def fail(self, message: str) -> CheckFailed:
        last = self.ops[-4:] if len(self.ops) <= 4 else ["...", *self.ops[-3:]]
        try:  # the state now: your code is not called again once the check has failed
            yours, ref = self.state(self.yours), self.state(self.ref)
        except Exception:
            return CheckFailed(message)
        from pagedlearn.labs.pictures import side_by_side

        caption = f"yours vs the reference, {self.where(last)}"
        return CheckFailed(message, lambda: side_by_side(yours, ref, caption))

    def call(self, name: str, *args):
        """Make the call on both; raise CheckFailed at the first difference."""
        text = f"{name}({', '.join(map(repr, args))})"
        before, context = list(self.ops), self.context(name)
        self.ops.append(text)
        ref_out = ref_err = out = err = None
        try:
            ref_out = getattr(self.ref, name)(*_fresh(args))
        except PagedLearnError as e:
            ref_err = e
        try:
            out = self.method(name)(*_fresh(args))
        except (CheckFailed, NotImplementedError):
            raise
        except Exception as e:
            if ref_err is None and not isinstance(e, PagedLearnError):
                raise crashed(self.ops, e) from e
            err = e
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
        want = self.snapshot("ref")
        try:
            got = self.snapshot("yours")
        except (CheckFailed, NotImplementedError):
            raise
        except Exception as e:
            raise crashed(self.ops, e) from e
        for field, value in want.items():
            if got[field] == value:
                continue
            verb = "is" if field.startswith("num_") or "queue" in field else "are"
            if raised:
                raise self.fail(
                    f"{self.where(self.ops[:-1])}: {self.ops[-1]} raised, as it should, but "
                    f"changed things -- an error must leave everything as it was (all or "
                    f"nothing): the {field} should still be {value}; yours {verb} {got[field]}"
                )
            raise self.fail(
                f"{self.where(self.ops)} the {field} should be {value}; yours {verb} "
                f"{got[field]}{self.hint(field, value, got[field], name)}"
            )
