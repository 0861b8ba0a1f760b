"""The ``scheduler`` lab's checks: the reference gets full marks, the untouched handout none, and
each plausible mistake (a small patch to the reference) loses points with a message naming it."""

from __future__ import annotations

import pytest

from pagedlearn.labs import get
from pagedlearn.labs.handout import lab_files
from pagedlearn.labs.runner import FAILED, NOT_DONE, PASSED, run_check
from pagedlearn.labs.submission import load, reference

LAB = get("scheduler")
FILE = "scheduler.py"


def grade(sub):
    return [run_check(c, sub) for c in LAB.checks]


def write(tmp_path, source: str) -> list:
    path = tmp_path / FILE
    path.write_text(source)
    return [path]


def test_lab_is_well_formed():
    assert LAB.number == 6 and 8 <= len(LAB.checks) <= 15
    assert all(1 <= c.points <= 3 for c in LAB.checks)
    assert [e.id for e in LAB.exercises] == ["admit", "victim", "preempt"]
    assert {c.exercise for c in LAB.checks} == {"admit", "victim", "preempt"}


def test_reference_gets_full_marks():
    outcomes = grade(reference(LAB))
    assert [o.message for o in outcomes if not o.passed] == []
    assert sum(o.score for o in outcomes) == LAB.max_score


def test_handout_gets_nothing(tmp_path):
    sub = load(LAB, write(tmp_path, lab_files(LAB, blank=True)[FILE]))
    outcomes = grade(sub)
    assert sum(o.score for o in outcomes) == 0
    assert {o.status for o in outcomes} == {NOT_DONE}
    assert all(o.message.startswith("not implemented yet -- scheduler: ") for o in outcomes)


# (old text, new text, a phrase some failing message must contain)
MISTAKES = [
    pytest.param(
        "return queue[-1] if queue else req",
        "return queue[0] if queue else req",
        "the most recently arrived not yet handled",
        id="preempts_the_oldest",
    ),
    pytest.param(
        "return queue[-1] if queue else req",
        "return queue[-1] if queue else self.running[0]",
        "itself: everyone else is older",
        id="asker_youngest_preempts_another",
    ),
    pytest.param(
        "return queue[-1] if queue else req",
        "return req",
        "the most recently arrived not yet handled",
        id="always_preempts_the_asker",
    ),
    pytest.param(
        "return blocks + self.watermark <= self.kv.num_free_blocks",
        "return blocks <= self.kv.num_free_blocks",
        "+ watermark 1 > 7 free",
        id="ignores_the_watermark",
    ),
    pytest.param(
        "        if not self.running:\n            return blocks <= self.kv.num_free_blocks\n",
        "",
        "admission never lets them in",
        id="never_admits_alone_deadlock",
    ),
    pytest.param(
        "return blocks + self.watermark <= self.kv.num_free_blocks",
        "return blocks <= self.kv.num_free_blocks + self.watermark",
        "does not even fit",
        id="admits_past_the_free_blocks",
    ),
    pytest.param(
        "            return blocks <= self.kv.num_free_blocks\n",
        "            return True\n",
        "it does not fit",
        id="alone_admits_anything",
    ),
    pytest.param(
        "        for seq_id in req.seq_ids:\n            self.kv.free_sequence(seq_id)\n"
        '        self._count_preemption(req, out, "recompute")',
        "        self.kv.free_sequence(req.seq_ids[0])\n"
        '        self._count_preemption(req, out, "recompute")',
        "still holds blocks",
        id="frees_only_the_first_sequence",
    ),
    pytest.param(
        "        for seq_id in req.seq_ids:\n            self.kv.free_sequence(seq_id)\n"
        '        self._count_preemption(req, out, "recompute")',
        '        self._count_preemption(req, out, "recompute")',
        "still holds blocks",
        id="leaks_blocks",
    ),
    pytest.param(
        "        self._enqueue(self.waiting, req, RequestStatus.WAITING)\n\n    # --- max-length",
        "\n    # --- max-length",
        "they were lost",
        id="request_lost_not_requeued",
    ),
    pytest.param(
        "        self._enqueue(self.waiting, req, RequestStatus.WAITING)\n\n    # --- max-length",
        "        req.status = RequestStatus.WAITING\n        self.waiting.append(req)\n\n"
        "    # --- max-length",
        "at its arrival position",
        id="requeues_at_the_back",
    ),
    pytest.param(
        '        self._count_preemption(req, out, "recompute")\n        self._enqueue(',
        "        self._enqueue(",
        "num_preemptions should be",
        id="preemption_not_counted",
    ),
]


@pytest.mark.parametrize(("old", "new", "phrase"), MISTAKES)
def test_mistake_loses_points(tmp_path, old, new, phrase):
    source = lab_files(LAB, blank=False)[FILE]
    assert source.count(old) == 1, "the patch no longer applies to scheduler.py"
    outcomes = grade(load(LAB, write(tmp_path, source.replace(old, new))))
    lost = [o for o in outcomes if o.status != PASSED]
    assert lost, "this mistake gets full marks"
    assert any(phrase in o.message for o in lost), [o.message for o in lost]


def test_notebook_style_submission_is_graded_method_by_method():
    """A notebook cell subclasses the reference (``class Scheduler(Scheduler)``): a wrong
    victim loses the victim checks only, and the engine runs it without crashing."""
    from pagedlearn.engine.scheduler import Scheduler as Reference
    from pagedlearn.labs.submission import Submission

    class Scheduler(Reference):
        def _choose_victim(self, queue, req):
            return queue[0] if queue else req  # the oldest not yet handled

    outcomes = grade(Submission({"Scheduler": Scheduler}, "a notebook"))
    lost = {o.check for o in outcomes if not o.passed}
    assert lost == {
        "victim_is_the_youngest_not_yet_handled",
        "preemption_on_the_engine",
        "your_scheduler_on_random_workloads",
    }
    assert all(o.status == FAILED for o in outcomes if not o.passed)
