"""Feedback without the reference: what the reference answered, recorded, and replayed.

The student edition has no reference code, so its ``check()`` and ``grade`` cannot compute an
expected answer. What they can do is ask the student's code the *same questions* the grader asks
and compare with what the reference answered. The grader's conversation with its worker
(remote.py) is exactly that: every request a check sends to the student's code -- "build
``KVCacheManager(num_blocks=8, block_size=4)``", "on object 1, ``fork('a', 'b')``, then the
snapshot" -- and the answer. :func:`record` grades the reference through the same sandbox and
keeps each check's conversation; ``labs export`` writes it into the student edition
(``pagedlearn/labs/expected/<lab>.json.gz``). :func:`replay` sends the recorded requests to the
student's code, in order, and stops at the first answer that differs from the reference's::

    with KVCacheManager(num_blocks=8, block_size=4), after add_sequence('a', [1, 2, 3, 4, 5]);
    fork('a', 'b'): append_token('b', 9): the refcounts of blocks 0..7 should be [2, 1, 1, 0, 0,
    0, 0, 0]; yours are [2, 2, 1, 0, 0, 0, 0, 0]

What a recording holds: operation sequences and the reference's results, never code (a request
names a lab's own harness function, which the edition has; the reference's functions are stubs
there). What it cannot do, that the grader does: shrink a random case to the shortest (the
replay shows the first recorded case that fails, as it was drawn), and explain a tensor
mismatch by the known mistakes (it says where the numbers differ). Floats and tensors are
compared with the labs' tolerance (``attention_cases.ATOL``, ``RTOL``), NaN equal to NaN.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

from pagedlearn.labs.lab import CheckFailed
from pagedlearn.labs.remote import Host
from pagedlearn.labs.wire import Codec, cut

FOLDER = Path(__file__).resolve().parent / "expected"  # in a student edition only
MAX_STEPS = 2000  # requests kept per check: a random check's first cases, not all 300


def record(lab_id: str) -> dict[str, list[dict]]:
    """``{check: [{"q": request, "a": the reference's answer, "note": ...}, ...]}``: the
    reference graded through the sandbox, each check's conversation kept."""
    from pagedlearn.labs.grader import grade

    log: dict[str, list[dict]] = {}
    report = grade(lab_id, reference=True, log=log)
    wrong = [o.check for o in report.outcomes if not o.passed]
    if report.load_error or wrong:
        raise RuntimeError(f"the reference fails lab {lab_id!r} ({report.load_error or wrong})")
    return {name: entries[:MAX_STEPS] for name, entries in log.items()}


def write(folder: Path, lab_id: str) -> Path:
    path = folder / f"{lab_id}.json.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps(record(lab_id)).encode(), mtime=0))
    return path


def load(lab_id: str) -> dict[str, list[dict]]:
    path = FOLDER / f"{lab_id}.json.gz"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no recorded answers for lab {lab_id!r} (a student edition made by "
            "`python -m pagedlearn labs export` has them)"
        )
    return json.loads(gzip.decompress(path.read_bytes()))


def replay_check(entries: list[dict]):
    """A check function (``check(sub)``) that replays ``entries`` on a submission: in this
    process for a local one, through the worker for a remote one (the student edition's own
    ``grade``)."""

    def check(sub) -> None:
        from pagedlearn.labs.remote import RemoteSubmission

        if isinstance(sub, RemoteSubmission):
            ask = sub._ch.ask_raw
            ask({"op": "reset", "h": None, "args": []})
        else:
            ask = Host(sub).answer
        replay(entries, ask)

    return check


def replay(entries: list[dict], ask) -> None:
    """Send each recorded request to ``ask`` (request -> raw answer); CheckFailed at the first
    answer unlike the reference's, NotImplementedError where the student's code hit a stub."""
    from pagedlearn.labs.wire import exception_from_wire

    for e in entries:
        got, want = ask(e["q"]), e["a"]
        if "raised" in got and "raised" not in want:
            exc = exception_from_wire(got["raised"])
            if isinstance(exc, (NotImplementedError, CheckFailed)):
                raise exc
        problem = _differ(want, got)
        if problem:
            raise CheckFailed(_message(e, problem))


def _family(raised: dict) -> str:
    """The class a check tells apart: the first PagedLearnError kind or builtin in the MRO."""
    from pagedlearn.labs.wire import exception_from_wire

    return type(exception_from_wire(raised)).__name__


def _show(raw) -> str:
    """A wire value as a person reads it (handles as ``<object>``, tensors by shape)."""
    codec = Codec(remote=lambda h, t: _Placeholder(t), resolve=None)
    try:
        return cut(repr(codec.decode(raw)), 300)
    except Exception:
        return cut(repr(raw), 300)


class _Placeholder:
    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<a {self.type_name}>"


def _differ(want: dict, got: dict) -> str:
    """How ``got`` differs from ``want`` (two raw answers), in words; "" when alike."""
    if "raised" in want:
        if "raised" not in got:
            return f"should raise {_family(want['raised'])}; yours returned {_show(got.get('ok'))}"
        if _family(want["raised"]) != _family(got["raised"]):
            g = got["raised"]
            return (
                f"should raise {_family(want['raised'])}; yours raised {g.get('type')}: "
                f"{cut(str(g.get('message', '')), 200)}"
            )
        return ""
    if "raised" in got:
        g = got["raised"]
        where = cut(str(g.get("where", "")), 200)
        return f"your code raised {g.get('type')}: {cut(str(g.get('message', '')), 200)}{where}"
    w, g = want.get("ok"), got.get("ok")
    if _snap(w) is not None and _snap(g) is not None:  # a Twins step: out, err, snapshot
        problem = _differ_step(w, g)
        if problem:
            return problem
    elif not _same(w, g):
        return f"should return {_show(w)}; yours returned {_show(g)}"
    for (i, wt), (_, gt) in zip(want.get("wb", []), got.get("wb", []), strict=False):
        if not _same(wt, gt):
            return f"should leave argument {i} as {_show(wt)}; yours left {_show(gt)}"
    return ""


def _snap(raw):
    """The fields of a Twins step's answer (``{"out", "err", "snap"}``), or None."""
    if isinstance(raw, dict) and "d" in raw:
        keys = [k for k, _ in raw["d"]]
        if keys[:2] == ["out", "err"]:
            return dict(raw["d"])
    return None


def _differ_step(w, g) -> str:
    ws, gs = _snap(w), _snap(g)
    if (ws["err"] is None) != (gs["err"] is None):
        if gs["err"] is not None:
            return f"should return {_show(ws['out'])}; yours raised {gs['err'].get('type')}"
        return f"should raise {_family(ws['err'])}; yours returned {_show(gs['out'])}"
    if ws["err"] is not None and _family(ws["err"]) != _family(gs["err"]):
        return f"should raise {_family(ws['err'])}; yours raised {gs['err'].get('type')}"
    if not _same(ws["out"], gs["out"]):
        return f"should return {_show(ws['out'])}; yours returned {_show(gs['out'])}"
    if "snap" not in gs:
        return "your code raised while its state was read"
    wfields, gfields = dict(ws["snap"]["d"]), dict(gs["snap"]["d"])
    for field, value in wfields.items():
        if not field.startswith("_") and not _same(value, gfields.get(field)):
            verb = "is" if field.startswith("num_") or "queue" in field else "are"
            return f"the {field} should be {_show(value)}; yours {verb} {_show(gfields.get(field))}"
    return ""


def _same(a, b) -> bool:
    """Two raw values alike: tensors and floats within the labs' tolerance, handles by number."""
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=2e-5)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        if "t" in a and "t" in b:
            return _same_tensor(a, b)
        if "h" in a and "h" in b:
            return a["h"] == b["h"]
        if "f" in a and "f" in b:  # nan, inf
            return a["f"] == b["f"]
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _same_tensor(a: dict, b: dict) -> bool:
    import torch

    from pagedlearn.labs.attention_cases import ATOL, RTOL  # (imports torch: here, not above)

    codec = Codec()
    x, y = codec.decode(a), codec.decode(b)
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if not x.is_floating_point():
        return bool(torch.equal(x, y))
    return bool(torch.allclose(x, y, atol=ATOL, rtol=RTOL, equal_nan=True))


def _message(entry: dict, problem: str) -> str:
    """The recorded note (a check's own words for the request), else the request described."""
    note = entry.get("note") or _describe(entry["q"])
    return f"{note}: {problem}"


def _describe(q: dict) -> str:
    op, name = q.get("op"), q.get("name")
    args = ", ".join(_show(a) for a in q.get("args", []))
    if op == "observe":
        return f"{str(q.get('func', '')).split(':')[-1]}({args})"
    if op == "call":
        return f"a call ({args})"
    return f"{op} {name or ''}".strip()
