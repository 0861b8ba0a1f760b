"""Your code runs the model: a KV-cache manager built from a student's own lab answers.

After the ``allocator``, ``cow`` and ``prefix`` labs a student has written the pool, the block
table, fork and copy-on-write, and the prefix cache. :func:`your_kv_cache_manager` assembles them
into one :class:`~pagedlearn.KVCacheManager` subclass, and ``LLM(...,
kv_cache_manager=Manager)`` serves a real model on it::

    Manager = your_kv_cache_manager(allocator=nearby("allocator"), cow=nearby("cow"),
                                    prefix=globals())
    llm = LLM("gpt2", num_blocks=64, kv_cache_manager=Manager)

``nearby`` finds a lab's notebook beside the one running (the handout's folders, or one folder
of notebooks); an answer read from a file is graded first and used only if it passes every
check, so an unfinished lab falls back to the reference instead of breaking the model.

The mechanism is plain subclassing. ``KVCacheManager`` names its parts in class attributes
(``allocator_class``, ``block_table_class``, ``prefix_cache_class``); the subclass sets them to the
student's classes, and takes the student's ``KVCacheManager`` (from the ``cow`` lab) as its base.
Anything not given is the reference's, and the function prints which parts are whose.
"""

from __future__ import annotations

import os
from pathlib import Path

from pagedlearn.core.block_allocator import BlockAllocator
from pagedlearn.core.block_table import BlockTable
from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.core.prefix_cache import PrefixCache
from pagedlearn.labs import get
from pagedlearn.labs.feedback import checks
from pagedlearn.labs.runner import run_check
from pagedlearn.labs.submission import Submission, SubmissionError, load


def _names(lab_id: str, part) -> dict | None:
    """A lab answer as a dict of names: ``part`` is a namespace (``globals()``), a module, a path
    (or list of paths) to the lab notebook / ``.py`` files, or None (the reference).

    An answer read from files is graded first (in this process, a few seconds), and used only
    if it passes every check: a lab not done yet -- a missing file, a stub, a failing check --
    falls back to the package's own, with a line that says so, instead of breaking the model (the
    reference; in a student edition its stubs, which say by name what is not written yet)."""
    if part is None:
        return None
    if isinstance(part, dict):
        return part
    if isinstance(part, Submission):
        return part._ns
    if not isinstance(part, (str, os.PathLike, list, tuple)):
        return vars(part)  # a module
    paths = [part] if isinstance(part, (str, os.PathLike)) else list(part)
    lab = get(lab_id)
    try:
        sub = load(lab, [Path(p) for p in paths])
    except SubmissionError as e:
        print(f"{lab_id}: {e}; using the package's")
        return None
    outcomes = [run_check(c, sub) for c in checks(lab)]  # (replayed in a student edition)
    score = sum(o.score for o in outcomes)
    if score < lab.max_score:
        print(f"{lab_id}: yours scores {score}/{lab.max_score} so far; using the package's")
        return None
    return sub._ns


def nearby(lab_id: str, here: str | os.PathLike = ".") -> Path | None:
    """The notebook of lab ``lab_id`` next to ``here`` (``NN_<lab>.ipynb`` in the same folder,
    or in the handout's ``../NN_<lab>/``), or None."""
    name = f"{get(lab_id).number:02d}_{lab_id}"
    for path in (Path(here) / f"{name}.ipynb", Path(here) / ".." / name / f"{name}.ipynb"):
        if path.exists():
            return path
    return None


def your_kv_cache_manager(allocator=None, cow=None, prefix=None, verbose: bool = True) -> type:
    """A KVCacheManager class made of the student's parts (see the module docstring)."""
    a, c, p = _names("allocator", allocator), _names("cow", cow), _names("prefix", prefix)
    base = c["KVCacheManager"] if c else KVCacheManager
    attrs = {
        "allocator_class": a["BlockAllocator"] if a else BlockAllocator,
        "block_table_class": a["BlockTable"] if a else BlockTable,
        "prefix_cache_class": _prefix_cache_class(p) if p else PrefixCache,
    }
    if verbose:
        whose = {"allocator + block table": a, "fork / copy-on-write": c, "prefix cache": p}
        print(
            "KV-cache manager: "
            + ", ".join(f"{k}: {'yours' if v else 'reference'}" for k, v in whose.items())
        )
    return type("YourKVCacheManager", (base,), attrs)


def _prefix_cache_class(ns: dict) -> type:
    """The student's PrefixCache, hashing with *their* ``hash_block`` (in a notebook, the
    ``hash_block`` method the class inherits would call the reference's module function)."""
    cls, hash_block = ns["PrefixCache"], ns.get("hash_block")
    if hash_block is None:
        return cls

    def method(self, parent_hash, token_ids, extra_keys):
        return hash_block(parent_hash, token_ids, extra_keys)

    return type(cls.__name__, (cls,), {"hash_block": method})
