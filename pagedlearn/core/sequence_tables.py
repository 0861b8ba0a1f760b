"""The sequences a KV-cache manager holds: each one's block table, and whether it is on the GPU.

A sequence id names one block table (block_table.py). The table sits in one of two places:

- ``gpu``: a running sequence; its block ids name blocks of the GPU pool. Only these can grow
  (``append_token``), be forked or be read (``block_table``, ``slot_mapping``).
- ``cpu``: a sequence swapped out (swap.py); its block ids name blocks of the CPU swap pool.

Beside each table the manager keeps the sequence's *extra keys* (model, adapter, cache salt: what
the prefix cache must never share across, see prefix_cache.py), in ``extra_keys``.

This file also checks what a caller hands the manager -- a sequence id, a list of ids, token ids --
so that a mistake is named in words at the boundary, and not as a ``KeyError`` three calls deeper.

>>> from pagedlearn.core.block_table import BlockTable
>>> seqs = SequenceTables()
>>> seqs.add("a", BlockTable(4, [0], [1, 2]), extra_keys=())
>>> seqs.to_cpu("a"); seqs.is_swapped("a"), list(seqs.cpu)
(True, ['a'])
>>> seqs.on_gpu("a")
Traceback (most recent call last):
...
pagedlearn.errors.PagedLearnError: sequence 'a' is swapped out to the CPU: swap_in(['a']) first
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Hashable, Iterable

from pagedlearn.core.block_table import BlockTable
from pagedlearn.errors import PagedLearnError


class SequenceTables:
    """Sequence id -> block table, on the GPU (``gpu``) or swapped out (``cpu``); no id in both."""

    def __init__(self) -> None:
        self.gpu: dict[Hashable, BlockTable] = {}  # resident sequences: ids name GPU blocks
        self.cpu: dict[Hashable, BlockTable] = {}  # swapped out: ids name CPU blocks
        self.extra_keys: dict[Hashable, tuple] = {}  # per sequence: model, adapter, salt

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.gpu or seq_id in self.cpu

    # --- finding a table -----------------------------------------------------------------------
    def on_gpu(self, seq_id: Hashable) -> BlockTable:
        """The table of a sequence on the GPU (the only kind that can grow, fork or be read)."""
        try:
            return self.gpu[seq_id]  # the common case first: one dict lookup
        except (KeyError, TypeError):
            pass
        self.is_swapped(seq_id)  # not on the GPU: this raises if the id names no sequence at all
        raise PagedLearnError(
            f"sequence {seq_id!r} is swapped out to the CPU: swap_in([{seq_id!r}]) first"
        )

    def table(self, seq_id: Hashable) -> BlockTable:
        """The table of a sequence wherever it is (token counts and ids are kept while out)."""
        return self.cpu[seq_id] if self.is_swapped(seq_id) else self.gpu[seq_id]

    def is_swapped(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` is swapped out; raises for an id that names no sequence."""
        try:
            if seq_id in self.gpu:
                return False
            if seq_id in self.cpu:
                return True
        except TypeError:  # unhashable: it cannot name a sequence
            pass
        raise PagedLearnError(f"unknown sequence id {seq_id!r}")

    def all(self) -> dict[Hashable, BlockTable]:
        """Every table, the GPU ones first."""
        return {**self.gpu, **self.cpu}

    # --- changing which tables exist -----------------------------------------------------------
    def check_new(self, seq_id: Hashable) -> None:
        """Raise unless ``seq_id`` could name a new sequence (hashable, not in use)."""
        try:
            exists = seq_id in self  # on the GPU or swapped out
        except TypeError:
            raise PagedLearnError(f"sequence id {seq_id!r} is not hashable") from None
        if exists:
            raise PagedLearnError(f"sequence id {seq_id!r} already exists")

    def add(self, seq_id: Hashable, table: BlockTable, extra_keys: tuple) -> None:
        """A new sequence on the GPU (call ``check_new`` first)."""
        self.gpu[seq_id] = table
        self.extra_keys[seq_id] = extra_keys

    def remove(self, seq_id: Hashable) -> None:
        """Forget a sequence, wherever its table is."""
        del (self.cpu if self.is_swapped(seq_id) else self.gpu)[seq_id]
        del self.extra_keys[seq_id]

    def to_cpu(self, seq_id: Hashable) -> None:
        """Move a table from the GPU side to the swapped-out side (its ids must now name CPU
        blocks: swap.py rewrites them)."""
        self.cpu[seq_id] = self.gpu.pop(seq_id)

    def to_gpu(self, seq_id: Hashable) -> None:
        """Move a swapped-out table back to the GPU side."""
        self.gpu[seq_id] = self.cpu.pop(seq_id)


# --- what a caller hands the manager -------------------------------------------------------------
def id_list(seq_ids: Iterable[Hashable], what: str) -> list[Hashable]:
    """A list of sequence ids from an iterable; refuses a bare string or a non-iterable."""
    # A bare string is iterable too: "req-1" would become five one-letter ids.
    if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Iterable):
        raise PagedLearnError(f"{what} takes a list of sequence ids, got {seq_ids!r}")
    return list(seq_ids)


def check_tokens(token_ids: Iterable[int]) -> list[int]:
    """Token ids as a new list of ints >= 0 (numpy / torch ints welcome); names a bad one.

    The check runs at C speed, not as a Python loop over thousands of tokens: ``array("Q",
    tokens)`` refuses anything that is not an integer (``__index__``) in ``0 .. 2**64 - 1``;
    only then are the tokens walked one at a time, to name the wrong position. A list whose
    first and last ids are plain ints (what the engine and a tokenizer hand in) is copied as it
    is -- a numpy int in its middle stays one, and equals, packs and hashes like the int; any
    other input (a tensor, a range, a list of numpy ints or bools) is converted to plain ints.

    >>> check_tokens(range(3))
    [0, 1, 2]
    >>> check_tokens([5, -1])
    Traceback (most recent call last):
    ...
    pagedlearn.errors.PagedLearnError: token ids must be >= 0: position 1 is -1
    """
    if isinstance(token_ids, (str, bytes)):
        raise PagedLearnError("token ids must be ints, got a string: tokenize it first")
    if type(token_ids) is not list:
        try:
            token_ids = list(token_ids)  # once: a generator cannot be read twice
        except TypeError:
            raise PagedLearnError(f"token ids must be ints, got {token_ids!r}") from None
        convert = True
    else:
        convert = bool(token_ids) and not (type(token_ids[0]) is type(token_ids[-1]) is int)
    try:
        values = array("Q", token_ids)  # C speed: each an integer in 0 .. 2**64 - 1
    except (TypeError, OverflowError):
        return _each_token(token_ids)  # names the first bad position
    if not token_ids:
        raise PagedLearnError("a sequence needs at least one token")
    return values.tolist() if convert else list(token_ids)


def _each_token(token_ids: list) -> list[int]:
    """The tokens one at a time, as ints: raises naming the first one that is not an int >= 0
    (only an int of 2**64 or more passes here, where ``array("Q")`` refused it)."""
    tokens = list(token_ids)
    for i, t in enumerate(tokens):
        try:
            tokens[i] = operator.index(t)
        except TypeError:
            raise PagedLearnError(f"token ids must be ints: position {i} is {t!r}") from None
        if tokens[i] < 0:
            raise PagedLearnError(f"token ids must be >= 0: position {i} is {t!r}")
    return tokens


def check_token(token_id: int) -> int:
    """One token id, as :func:`check_tokens` checks it (the fast path of ``append_token``)."""
    if type(token_id) is int and token_id >= 0:
        return token_id
    return check_tokens([token_id])[0]
