"""Errors raised by pagedlearn.

Every error the package raises on purpose is a :class:`PagedLearnError`, so a lab can catch them all
with one ``except``. Running out of physical blocks is the one failure a serving engine expects and
handles (by waiting, preempting or rejecting), so it has its own class.

Messages say what was asked for and what was available, e.g. ``need 3 blocks, 1 free of 64``.
Whenever one of these is raised, the state it was raised from is unchanged: nothing half-allocated.
"""


class PagedLearnError(Exception):
    """Base class: a request the memory manager cannot carry out (bad id, double free, ...)."""


class OutOfBlocksError(PagedLearnError):
    """The pool has fewer free blocks than an operation needs.

    Attributes ``needed``, ``free`` and ``total`` let a scheduler decide what to do next.
    """

    def __init__(self, needed: int, free: int, total: int, what: str = "") -> None:
        self.needed, self.free, self.total = needed, free, total
        msg = f"need {needed} block{'s' if needed != 1 else ''}, {free} free of {total}"
        super().__init__(f"{what}: {msg}" if what else msg)
