"""Helpers shared by the tests (imported as ``from helpers import ...``)."""

import contextlib
import importlib
import sys
import time
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


# A correct answer to lab 1 written from the handout's tasks, not copied from the package (the
# copy check must not flag it; the grader must give it full marks): ``{qualname: body}``.
HONEST_ALLOCATOR = {
    "BlockAllocator.allocate": """
        if not _is_int(n) or n < 0:
            raise PagedLearnError(f"allocate needs a whole number n >= 0, not {n!r}")
        available = len(self._free_empty) + len(self._free_cached)
        if n > available:
            raise OutOfBlocksError(n, available, self._num_blocks)
        taken = []
        while len(taken) < n and self._free_empty:
            taken.append(self._free_empty.popleft())
        while len(taken) < n:
            victim = next(iter(self._free_cached))
            del self._free_cached[victim]
            self._cached.discard(victim)
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(victim)
            taken.append(victim)
        for block in taken:
            self._refcounts[block] = 1
        return taken
""",
    "BlockAllocator.incref": """
        ids = list(ids)
        self._check_ids(ids)
        for b in ids:
            if self._refcounts[b] == 0 and b not in self._cached:
                raise PagedLearnError(f"cannot share block {b}: it is free and caches nothing")
        for b in ids:
            if self._refcounts[b] == 0:
                self._free_cached.pop(b)
            self._refcounts[b] += 1
            if self._refcounts[b] == 2:
                self._num_shared += 1
""",
    "BlockAllocator.free": """
        ids = list(ids)
        self._check_ids(ids)
        for b, k in Counter(ids).items():
            if k > self._refcounts[b]:
                raise PagedLearnError(f"double free: block {b} freed {k}x, refcount too low")
        for b in ids:
            self._refcounts[b] -= 1
            if self._refcounts[b] == 1:
                self._num_shared -= 1
            elif self._refcounts[b] == 0:
                if b in self._cached:
                    self._free_cached[b] = None
                else:
                    self._free_empty.append(b)
""",
    "BlockTable.blocks_needed": """
        return (num_tokens + self.block_size - 1) // self.block_size
""",
    "BlockTable.slot": """
        if i < 0 or i >= len(self.token_ids):
            raise IndexError(f"position {i} is not in 0..{len(self.token_ids) - 1}")
        block, offset = divmod(i, self.block_size)
        return self.block_ids[block] * self.block_size + offset
""",
    "BlockTable.slot_mapping": """
        if start < 0:
            raise IndexError(f"start {start} is negative")
        out = []
        for i in range(start, self.num_tokens):
            block = self.block_ids[i // self.block_size]
            offset = i % self.block_size
            out.append(NULL_BLOCK if block == NULL_BLOCK else block * self.block_size + offset)
        return out
""",
}


def filled(lab: Lab, bodies: dict[str, str]) -> dict[str, str]:
    """``lab``'s handout files (``{filename: text}``) with each ``{qualname: body}`` in place of
    that target's one-line stub (``body`` indented for its place)."""
    import ast

    from pagedlearn.labs.handout import _find

    files = lab_files(lab, blank=True)
    for name, source in files.items():
        tree, lines = ast.parse(source), source.splitlines(keepends=True)
        stubs = {}
        for qualname, body in bodies.items():
            try:
                stubs[_find(tree, qualname).body[-1].lineno] = body.strip("\n") + "\n"
            except LookupError:
                continue
        for lineno in sorted(stubs, reverse=True):  # each stub is one line: the body replaces it
            lines[lineno - 1] = stubs[lineno]
        files[name] = "".join(lines)
    return files


@contextlib.contextmanager
def serve_command(args: list[str], env: dict, **popen):
    """``python -m pagedlearn serve ARGS`` in a subprocess, yielded once it says where it listens
    (within 60 s), as ``(proc, lines)``: ``lines`` keeps growing with what it prints (stdout
    and stderr). Stopped on exit (SIGTERM, then SIGKILL), and ``lines`` holds all it printed."""
    import subprocess
    import threading
    import time

    command = [sys.executable, "-m", "pagedlearn", "serve", *args]
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any(" at http" in x for x in lines):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            time.sleep(0.05)
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        reader.join(10)


def assert_error(r, status: int, param=..., says: str = "", inside: bool = False) -> dict:
    """``r`` is OpenAI's error shape with this status, naming ``param`` (with ``inside``, the
    field or a path inside it: ``messages`` matches ``messages.1.name``), with ``says`` in its
    message; returns the error object."""
    assert r.status_code == status, r.text[:2000]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["type"].endswith("Error") and err["message"]
    if status == 400:
        assert err["type"] == "BadRequestError", err
    if param is not ...:
        named = err["param"] == param
        assert named or (inside and str(err["param"]).startswith(f"{param}.")), err
    assert says.lower() in err["message"].lower(), err
    return err


def assert_serves(http, max_tokens: int = 4) -> None:
    """The server still answers a plain completion with ``max_tokens`` tokens."""
    body = {"prompt": "Hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def wait_until(predicate, what: str = "the condition", timeout: float = 20.0):
    """Poll ``predicate()`` until it returns something truthy, and return that; fail naming
    ``what`` after ``timeout`` seconds (threads and sockets answer in their own time)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
    return value
