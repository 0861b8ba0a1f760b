"""Helpers shared by the tests (imported as ``from helpers import ...``)."""

import importlib
import sys
from pathlib import Path

from pagedlearn import KVCacheManager
from pagedlearn.labs.handout import lab_files
from pagedlearn.labs.lab import Lab
from pagedlearn.labs.runner import PASSED, Outcome, run_check
from pagedlearn.labs.submission import Submission, load
from pagedlearn.trace.events import PoolReplay


def snapshot(kv: KVCacheManager):
    """Everything an operation could change, to check that a failed one changed nothing."""
    a = kv.allocator
    cache = sorted((h, e) for h, e in kv.prefix_cache.items()) if kv.prefix_cache else []
    return (
        {s: (kv.block_table(s), kv.token_ids(s)) for s in kv.sequences()},
        [a.refcount(b) for b in range(a.num_blocks)],
        a.free_queue(),
        [b for b in range(a.num_blocks) if a.is_cached(b)],
        cache,
        list(kv._copies),
        a.num_evictions,
        a.num_shared_blocks,
    )


def replay_matches(kv: KVCacheManager, state: PoolReplay) -> bool:
    """Whether a pool rebuilt from events equals the manager's real pool."""
    a = kv.allocator
    cached = {b: kv.prefix_cache.hash_of(b).hex() for b in range(a.num_blocks) if a.is_cached(b)}
    return (
        state.refcounts == [a.refcount(b) for b in range(a.num_blocks)]
        and state.tables == {s: kv.block_table(s) for s in kv.sequences()}
        and state.cached == cached
    )


# --- the labs -------------------------------------------------------------------------------------
def grade_lab(lab: Lab, sub: Submission, exercise: str | None = None) -> list[Outcome]:
    """Run ``lab``'s checks (all, or one exercise's) on ``sub``, in-process."""
    return [run_check(c, sub) for c in lab.checks_of(exercise)]


def submit(lab: Lab, tmp_path: Path, files: dict[str, str]) -> Submission:
    """Write each ``{filename: text}`` into ``tmp_path``; load them as a submission to ``lab``."""
    paths = []
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        paths.append(tmp_path / name)
    return load(lab, paths)


def patched(lab: Lab, filename: str, old: str, new: str) -> dict[str, str]:
    """``lab``'s reference files with ``old`` replaced by ``new`` in ``filename``: a plausible
    student mistake. ``old`` must occur exactly once, so a patch that no longer applies fails."""
    files = lab_files(lab, blank=False)
    assert files[filename].count(old) == 1, f"the patch no longer applies to {filename}"
    files[filename] = files[filename].replace(old, new)
    return files


def lost_points(outcomes: list[Outcome], phrase: str) -> list[Outcome]:
    """The outcomes that lost points, asserting that there are some (the mistake does not get
    full marks) and that some message names the mistake (contains ``phrase``)."""
    lost = [o for o in outcomes if o.status != PASSED]
    assert lost, "this mistake gets full marks"
    assert any(phrase in o.message for o in lost), [o.message for o in lost]
    return lost


def import_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (a script there may import its neighbours)."""
    folder = str(Path(__file__).resolve().parent.parent / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)
