"""benchmarks/bench_tensor_parallel.py keeps working: --quick on tiny-gpt2 runs N = 1 and N = 2 on
the same batch, prints both rows, the breakdown with its formulas, and N = 2's tokens agree with
N = 1's. Structure and arithmetic only: no timing is asserted."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import import_benchmark

ROOT = Path(__file__).resolve().parent.parent
NUM = r"-?\d+\.\d{3}"
SPREAD = rf"{NUM} \[{NUM}-{NUM}\]"  # median [min-max of the rounds' medians], ms


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_tensor_parallel")


def test_quick_run_compares_one_and_two_workers(tmp_path):
    raw = tmp_path / "raw.json"
    cmd = [sys.executable, "benchmarks/bench_tensor_parallel.py", "--quick", "--json", str(raw)]
    # Bounded: two spawned workers start in ~5 s; the run is ~15 s on 2 busy cores.
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    text = out.stdout
    assert out.returncode == 0, text + out.stderr
    assert re.search(r"^torch threads: N=1 runs the model in this process with \d+; N>1: each "
                     r"worker gets T // N \(N=2: \d+\)", text, re.M), text  # fmt: skip
    assert re.search(r"load average [\d.]+$", text.splitlines()[0]), text
    res = json.loads(raw.read_text())
    one, two = res["sizes"]["1"], res["sizes"]["2"]
    for phase, tokens in (("prefill", 64), ("decode", 4)):  # --quick: 4 sequences x 16 tokens
        head = f"\n{phase} step: {tokens} tokens (4 sequences)"
        assert head in text, text
        section = text.split(head)[1].split("\n\n")[0]  # up to the next blank line
        rows = {}
        for n in ("1", "2"):
            m = re.search(rf"^\s+{n}\s+({SPREAD})\s+{SPREAD}\s+{SPREAD}\s+([+-]{NUM})\s+"
                          rf"(\d+\.\d\d)x$", section, re.M)  # fmt: skip
            assert m, f"no {phase} row for N={n}:\n{text}"
            rows[n] = m
        # the row of N=1 is the baseline; N=2's overhead is the JSON's step(2) - step(1)
        assert rows["1"].group(2) == "+0.000" and rows["1"].group(3) == "1.00"
        s1, s2 = one[phase]["step"]["median"], two[phase]["step"]["median"]
        assert abs(float(rows["2"].group(2)) - (s2 - s1) * 1e3) < 1e-3 + 1e-9
        assert rows["2"].group(3) == f"{s2 / s1:.2f}"
        # every breakdown quantity of N=2, each a median with its spread
        assert set(two[phase]) == {"step", "forward", "driver", "send", "arrival", "busy0",
                                   "busy1", "wait0", "wait1", "return"}  # fmt: skip
        assert set(one[phase]) == {"step", "forward", "driver"}
        for stat in two[phase].values():
            assert stat["min"] <= stat["max"]
        # the all-reduce line: one all-reduce of (T, hidden) and its formula 2 x layers x that
        m = re.search(rf"one of \({tokens}, 64\) float32 = {tokens * 256:,} B takes ({NUM}) "
                      rf"\[{NUM}-{NUM}\] ms.*per step = 2 x 2 layers x ({NUM}) = ({NUM}) ms",
                      section)  # fmt: skip
        assert m, section
        ar, again, per_step = map(float, m.groups())
        assert ar == again == round(two["all_reduce"][phase]["median"] * 1e3, 3)
        assert per_step == pytest.approx(4 * ar, abs=0.0021)  # each printed to 0.001
        msg = one["message_bytes"][phase]
        assert msg == two["message_bytes"][phase] > 0  # the same step for every N
        assert (f"len(pickle.dumps(StepInputs)) = {msg:,} B; logits back = S x vocab x 4 B = "
                "4 x 258 x 4 = 4,128 B") in section  # fmt: skip
    assert two["message_bytes"]["prefill"] > two["message_bytes"]["decode"]  # 64 ids against 4
    for size in (one, two):  # 1 timed round of 1 prefill + 4 decode steps, tokens per step right
        assert [s["tokens"] for s in size["rounds"][0]["steps"]] == [64, 4, 4, 4, 4]
    assert two["same_tokens"] == two["sequences"] == 4
    assert "greedy token ids of N=2 identical to N=1's: 4/4 sequences (5 tokens each)" in text
    assert "return = forward - max over ranks (received + busy)" in text


def test_breakdown_of_one_step_follows_the_printed_formulas(bench):
    rec = {"tokens": 8, "step": 0.010, "forward": 0.008, "send": 0.001,
           "received": {0: 0.002, 1: 0.003}, "busy": {0: 0.004, 1: 0.0035},
           "all_reduce": {0: 0.001, 1: 0.0012}}  # fmt: skip
    d = bench.derived(rec)
    assert d["driver"] == pytest.approx(0.002)  # step - forward
    assert d["arrival"] == 0.003  # the latest rank's arrival
    assert (d["busy0"], d["busy1"]) == (0.004, 0.0035)
    assert (d["wait0"], d["wait1"]) == (0.001, 0.0012)  # the all-reduces inside busy
    assert d["return"] == pytest.approx(0.008 - 0.0065)  # forward - max(received + busy)
    assert set(bench.derived({"step": 0.01, "forward": 0.008})) == {"step", "forward", "driver"}


@pytest.mark.parametrize("sizes", ["2", "1,1", "1,x"])
def test_bad_sizes_are_refused_before_any_model_loads(bench, sizes, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--sizes", sizes])
    assert e.value.code == 2
    assert "--sizes" in capsys.readouterr().err


def test_a_size_that_does_not_divide_the_heads_is_refused_before_workers_start(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", "--sizes", "1,3"])  # tiny-gpt2 has 4 heads
    assert "--sizes: tensor_parallel_size=3 must divide" in str(e.value.code)
    assert "prefill step" not in capsys.readouterr().out  # nothing ran
