"""Graded labs: students write the memory manager and the kernel themselves, piece by piece.

Each lab names functions of this package that a student writes (lab.py), checks that say
precisely what is wrong (one module per lab, below), a handout made from the package's own source
with those bodies blanked (handout.py) and a student edition of the whole package with every
graded body blanked (student_edition.py), a grader that runs the checks in its own process and
the student's code in a sandbox it talks to (grader.py; sandbox.py, worker.py; remote.py,
wire.py), with per-check time limits, copy detection (copies.py) and Gradescope's JSON, instant
feedback in the lab notebooks (feedback.py; in the student edition, a replay of the reference's
recorded answers: expected.py), and a way to run a real model on the student's own allocator
(plug.py). The command line::

    python -m pagedlearn labs list          # one line per lab: <id>  <reference file>  <title>
    python -m pagedlearn labs export DIR    # the student handout
    python -m pagedlearn grade LAB SUBMISSION [--json results.json]
    python -m pagedlearn grade LAB --reference  # grades the package's own code: full marks

The labs, in the order they are taken: ``allocator``, ``cow``, ``prefix``, ``attention``,
``kernel``, ``scheduler``.
"""

from __future__ import annotations

import importlib

from pagedlearn.labs.lab import Check, CheckFailed, Exercise, Lab

LAB_IDS = ("allocator", "cow", "prefix", "attention", "kernel", "scheduler")


def get(lab_id: str) -> Lab:
    """The lab called ``lab_id`` (its module ``pagedlearn.labs.<lab_id>`` defines ``LAB``)."""
    if lab_id not in LAB_IDS:
        raise KeyError(f"no lab {lab_id!r}; the labs are: {', '.join(LAB_IDS)}")
    return importlib.import_module(f"pagedlearn.labs.{lab_id}").LAB


def all_labs() -> list[Lab]:
    return [get(lab_id) for lab_id in LAB_IDS]


__all__ = ["LAB_IDS", "Check", "CheckFailed", "Exercise", "Lab", "all_labs", "get"]
