"""The grader's child process: load the submission, run the named checks, one JSON line each.

``python -m pagedlearn.labs.worker LAB JOB (--reference | PATH...)``, where ``JOB`` is
``{"checks": [names...], "time_limit": seconds or null}`` in JSON.

The first line says whether the submission loaded (``{"loaded": true}`` or ``{"load_error":
"..."}``), then one line per check, in order, as :class:`~pagedlearn.labs.runner.Outcome`'s
fields. Only this protocol goes to the real stdout: what the submission prints goes to stderr,
so a stray ``print`` cannot corrupt a verdict.
"""

from __future__ import annotations

import json
import os
import sys


def use_triton_interpreter_without_gpu() -> None:
    """Triton runs on a CPU only in its interpreter, chosen before triton is first imported."""
    if os.environ.get("TRITON_INTERPRET") is None:
        try:
            import torch

            if not torch.cuda.is_available():
                os.environ["TRITON_INTERPRET"] = "1"
        except ImportError:
            pass


def main(argv: list[str]) -> int:
    lab_id, job, rest = argv[0], json.loads(argv[1]), argv[2:]
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own copy of stdout
    os.dup2(2, 1)  # from here on, anything printed (by Python or C code) goes to stderr
    sys.stdout = sys.stderr

    def say(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    if lab_id == "kernel":
        use_triton_interpreter_without_gpu()
    os.environ.setdefault("MPLBACKEND", "Agg")  # pictures are never drawn here; never a window
    from pagedlearn.labs import get
    from pagedlearn.labs.runner import run_check
    from pagedlearn.labs.submission import SubmissionError, load, reference

    lab = get(lab_id)
    try:
        sub = reference(lab) if rest == ["--reference"] else load(lab, rest)
    except SubmissionError as e:
        say({"load_error": str(e)})
        return 0
    except NotImplementedError as e:
        say({"load_error": f"a stub ran while the submission loaded: {e}"})
        return 0
    say({"loaded": True})
    by_name = {c.name: c for c in lab.checks}
    for name in job["checks"]:
        check = by_name[name]
        limit = min(check.timeout_s, job["time_limit"] or check.timeout_s)
        say(run_check(check, sub, limit).as_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
