"""The student's process: load the submission, then answer the grader's requests, one per line.

``python -I -c BOOT ROOT LAB (--reference | PATH...)`` (grader.py starts it; ``BOOT`` makes
``import pagedlearn`` find ``ROOT``'s -- the lab's edition with its graded bodies blanked, or the
package itself for ``--reference`` -- so the reference cannot be imported by name here).

The first line says whether the submission loaded (``{"loaded": true}`` or ``{"load_error":
"..."}``); then each request on stdin gets one answer on stdout (remote.py's protocol: what the
student's code returned or raised). This process decides nothing: the checks and their verdicts
run in the grader. What the submission prints goes to stderr, so a stray ``print`` cannot corrupt
an answer.
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
    lab_id, rest = argv[0], argv[1:]
    requests = os.fdopen(os.dup(0), "rb")  # the protocol's own copies of stdin and stdout
    answers = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the submission reads nothing of the protocol from stdin
    os.dup2(2, 1)  # from here on, anything printed (by Python or C code) goes to stderr
    sys.stdout = sys.stderr

    def say(obj: dict) -> None:
        answers.write((json.dumps(obj) + "\n").encode())

    if lab_id == "kernel":
        use_triton_interpreter_without_gpu()
    os.environ.setdefault("MPLBACKEND", "Agg")  # pictures are never drawn here; never a window
    from pagedlearn.labs import get
    from pagedlearn.labs.remote import Host
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
    host = Host(sub)
    for line in requests:
        try:
            request = json.loads(line)
        except ValueError:
            return 2
        say(host.answer(request))
    return 0


# Run first, as `python -I -c BOOT ROOT ...`: `import pagedlearn` and `import kernels` find ROOT's
# (a finder ahead of every other; their submodules follow the packages' own paths), whatever else
# is installed -- torch and the rest still come from site-packages, where the full package may be.
BOOT = """\
import importlib.machinery, sys
root = sys.argv[1]
class EditionFirst:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in ("pagedlearn", "kernels"):
            return importlib.machinery.PathFinder.find_spec(name, [root])
        return None
sys.meta_path.insert(0, EditionFirst)
del sys.argv[1]
from pagedlearn.labs.worker import main
sys.exit(main(sys.argv[1:]))
"""
