"""The ``scheduler`` lab's checks: each plausible mistake (a small patch to the reference) loses
points with a message naming it. (The reference's full marks and the untouched handout's 0 are
tested for every lab in ``test_labs.py``.)"""

from __future__ import annotations

import pytest
from helpers import grade_lab, lost_points, patched, submit

from pagedlearn.labs import get
from pagedlearn.labs.runner import FAILED

LAB = get("scheduler")
FILE = "scheduler.py"


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
    sub = submit(LAB, tmp_path, patched(LAB, FILE, old, new))
    lost_points(grade_lab(LAB, sub), phrase)


def test_notebook_style_submission_is_graded_method_by_method():
    """A notebook cell subclasses the reference (``class Scheduler(Scheduler)``): a wrong
    victim loses the victim checks only, and the engine runs it without crashing."""
    from pagedlearn.engine.scheduler import Scheduler as Reference
    from pagedlearn.labs.submission import Submission

    class Scheduler(Reference):
        def _choose_victim(self, queue, req):
            return queue[0] if queue else req  # the oldest not yet handled

    outcomes = grade_lab(LAB, Submission({"Scheduler": Scheduler}, "a notebook"))
    lost = {o.check for o in outcomes if not o.passed}
    assert lost == {
        "victim_is_the_youngest_not_yet_handled",
        "preemption_on_the_engine",
        "your_scheduler_on_random_workloads",
    }
    assert all(o.status == FAILED for o in outcomes if not o.passed)
