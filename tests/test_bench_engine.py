"""benchmarks/bench_engine.py keeps working: --quick on tiny-gpt2 prints its three sections (fixed
length with the step breakdown, decode step at batch 1/4/16, the chat mix) with numbers; and the
mix it builds has the load test's shape (chat_mix.py)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("pagedlearn LLM.generate", "transformers generate", "transformers generate_batch")
# a section-1 row: system, wall s, generated tokens, tokens/s, ratio to pagedlearn
ROW = r"^{name}\s+\d+\.\d+\s+(\d+)\s+\d+\.\d\s+(\d+\.\d\d)x$"
NUM = r"-?\d+\.\d+"  # a decode step of a system with a large fixed cost per call may be < 0
SPREAD = rf"{NUM} \({NUM}\.\.{NUM}\)"  # median (min..max)
# a section-2 row: batch, system, step ms (spread), tokens/s, ratio, same tokens / prompts
DECODE = rf"^\s+{{b}} {{name}}\s+{SPREAD}\s+{NUM}\s+({NUM})x  (\d+)/(\d+)$"
# a section-3 row: system, tokens, wall s (spread), tokens/s, ratio, same outputs / requests
MIX = rf"^mix  {{name}}\s+(\d+)\s+{SPREAD}\s+{NUM}\s+({NUM})x  (\d+)/(\d+)$"


def run_bench() -> subprocess.CompletedProcess:
    # One thread: on a small shared machine, two busy processes with two threads each slow the
    # engine's many small ops by 10x or more; this is a smoke test of the script, not of speed.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "benchmarks/bench_engine.py", "--quick", "--model", "tiny-gpt2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_engine_benchmark_prints_the_three_sections_formulas_and_breakdown():
    out = run_bench()
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert re.search(r"^machine: .*torch threads 1, load average \d+\.\d\d$",
                     text, re.M), text  # fmt: skip
    cb_ran = not re.search(r"^transformers generate_batch: unavailable here: \S.*$", text, re.M)
    systems = SYSTEMS if cb_ran else SYSTEMS[:2]
    # 1. --quick: 4 prompts x 8 new tokens; every row counts what its system returned
    paged = re.search(ROW.format(name="pagedlearn LLM.generate"), text, re.M)
    assert paged and paged.groups() == ("32", "1.00"), text
    padded = re.search(ROW.format(name="transformers generate"), text, re.M)
    assert padded and padded.group(1) == "32", text
    if cb_ran:
        cb = re.search(ROW.format(name=re.escape("transformers generate_batch")), text, re.M)
        assert cb and cb.group(1) == "32", text
    assert "tokens/s = generated tokens / wall seconds" in text
    assert re.search(r"identical to transformers generate's: \d/4 prompts", text), text
    assert re.search(
        r"^  bookkeeping / step time = sum\(bookkeeping_time\) / sum\(step_time\) = \d+\.\d%$",
        text,
        re.M,
    ), text
    # 2. a row per batch size and system; --quick: 1 timed run, so B prompts compared
    for b in (1, 4, 16):
        for name in systems:
            row = re.search(DECODE.format(b=b, name=re.escape(name)), text, re.M)
            assert row, (b, name, text)
            assert int(row.group(3)) == b and int(row.group(2)) <= b, row.group(0)
            if name == SYSTEMS[0]:
                assert row.group(1) == "1.00" and row.group(2) == str(b), row.group(0)
    assert "step = (wall(max_tokens=2) - wall(max_tokens=1)) / (2 - 1)" in text, text
    # 3. the mix: a row per system, every request counted, pagedlearn's tokens as the reference
    asked = re.search(r"^3\. request mix: (\d+) requests from the load test's first 6 ", text, re.M)
    assert asked, text
    rows = {n: re.search(MIX.format(name=re.escape(n)), text, re.M) for n in systems}
    assert all(rows.values()), text
    for row in rows.values():
        assert row.group(4) == asked.group(1) and int(row.group(3)) <= int(asked.group(1))
    assert rows[SYSTEMS[0]].group(2) == "1.00" and rows[SYSTEMS[0]].group(3) == asked.group(1)
    assert "tokens = each request's output up to its EOS and max_tokens" in text
    # the goals: each baseline, each section
    for name in systems[1:]:
        goal = re.search(rf"^  pagedlearn / {name} tokens/s: goal: >= 1.0x; measured: (.*)$",
                         text, re.M)  # fmt: skip
        assert goal, text
        for what in ("1. fixed length", "batch 1", "batch 4", "batch 16", "the mix"):
            assert re.search(rf"{NUM}x \({what}\)", goal.group(1)), goal.group(0)
    assert re.search(r"goal: < 10%; measured: \d+\.\d%$", text, re.M), text
    # pagedlearn's pool is the largest padded cache of the three sections, less a partial block
    kv = re.search(r"^KV memory: generate's padded cache = 4 prompts x \((\d+) longest prompt "
                   r"\+ 8 new\) tokens x (\d+) bytes per token = [\d.]+ MiB; decode section "
                   r"(\d+) tokens, mix section (\d+) tokens; pagedlearn gets the largest of the "
                   r"three$", text, re.M)  # fmt: skip
    ours = re.search(r"^pagedlearn: .* (\d+) blocks = (\d+) tokens = ", text, re.M)
    assert kv and ours, text
    largest = max(4 * (int(kv.group(1)) + 8), int(kv.group(3)), int(kv.group(4)))
    assert int(kv.group(3)) == 16 * (64 + 2)  # the largest batch x (prompt + N)
    assert int(ours.group(2)) == int(ours.group(1)) * 16  # block_size 16
    assert largest - 16 < int(ours.group(2)) <= largest, text


def test_chat_mix_has_the_load_tests_shape():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from chat_mix import build_chat_mix
        from engine_systems import cut
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from pagedlearn.loadtest.mix import SYSTEM_BLOCKS, TEMPLATES
    from pagedlearn.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()  # the offline models' tokenizer; no chat template: the plain one
    mix = build_chat_mix(tok, len(TEMPLATES), seed=0, block_size=16, max_model_len=512)
    assert len(mix) == sum(n for _, _, n in TEMPLATES)  # an entry with n samples: n requests
    assert build_chat_mix(tok, len(TEMPLATES), 0, 16, 512) == mix  # seeded
    assert [q.kind for q in mix[3:6]] == ["shared-prefix/length"] * 3 and mix[3] == mix[5]
    shared = [q.prompt for q in mix if q.kind.startswith("shared-prefix")]
    common = [  # tokens in common with the first one
        next(i for i, (a, b) in enumerate(zip(p, shared[0], strict=False)) if a != b)
        for p in shared
        if p != shared[0]
    ]
    assert max(common) >= SYSTEM_BLOCKS * 16  # whole blocks shared with the first one
    assert all(q.max_tokens <= 12 for q in mix if q.kind.endswith("cancel"))
    assert all(len(q.prompt) + q.max_tokens <= 512 for q in mix)
    assert max(len(q.prompt) for q in mix if q.kind.startswith("near-limit")) > 256
    assert cut([5, 2, 7, 2], 3, eos=2) == [5, 2] and cut([5, 2, 7], 2, eos=None) == [5, 2]
