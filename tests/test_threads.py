"""torch's CPU threads (pagedlearn/cli/threads.py): the rule on made-up machines (affinity,
cgroup quotas, load, environment), and, in one subprocess, that ``import pagedlearn`` gives
torch the chosen count, in its threads and in a process started from it."""

import json
import os
import subprocess
import sys

import pytest

from pagedlearn.cli import threads
from pagedlearn.cli.threads import CAP, ENV, choose, rule, usable_cpus
from pagedlearn.errors import PagedLearnError


def test_the_rule_gives_one_thread_on_a_busy_two_core_machine_and_the_cap_on_an_idle_big_one():
    assert rule(2, 3.4, 2) == 1 and rule(2, 7.0, 2) == 1  # issue 33's machine, others' jobs
    assert rule(2, 1.0, 2) == 1  # one busy process: the other core is ours
    assert rule(2, 0.2, 2) == 2  # the same machine idle
    assert rule(16, 0.3, 16) == CAP == 4 and rule(16, 13.0, 16) == 3
    assert rule(2, 40.0, 64) == 1 and rule(2, 10.0, 64) == 2  # a container's share of the host
    assert rule(1, 0.0, 1) == 1 and rule(8, None, 8) == CAP  # no load average: the usable CPUs


def test_usable_cpus_are_the_affinity_under_the_cgroup_quota():
    assert usable_cpus(affinity=16, quota=1.5) == 2  # --cpus=1.5 keeps two CPUs partly busy
    assert usable_cpus(affinity=2, quota=8.0) == 2 and usable_cpus(affinity=4, quota=0.1) == 1


def test_the_cgroup_quota_is_read_from_v2_and_v1_files_and_the_smallest_on_the_path_wins(tmp_path):
    own = tmp_path / "self_cgroup"
    (tmp_path / "job" / "step").mkdir(parents=True)
    own.write_text("0::/job/step\n")
    assert threads.cgroup_cpu_quota(str(tmp_path), str(own)) is None  # no files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "job" / "step" / "cpu.max").write_text("300000 100000\n")
    assert threads.cgroup_cpu_quota(str(tmp_path), str(own)) == 3.0
    (tmp_path / "job" / "cpu.max").write_text("150000 100000\n")  # the parent's limits it too
    assert threads.cgroup_cpu_quota(str(tmp_path), str(own)) == 1.5

    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct").mkdir(parents=True)
    own.write_text("4:memory:/x\n2:cpu,cpuacct:/\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_cpu_quota(str(v1), str(own)) is None  # -1: no quota
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("50000\n")
    assert threads.cgroup_cpu_quota(str(v1), str(own)) == 0.5
    assert threads.cgroup_cpu_quota(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_the_override_then_omp_num_threads_then_a_lower_torch_count_then_the_rule():
    machine = dict(usable=2, load=3.4, machine_cpus=2)  # the rule says 1

    def chose(environ, torch_threads=None, **machine):
        c = choose(environ, torch_threads=torch_threads, **machine)
        return c.count, c.source

    assert chose({ENV: "2", "OMP_NUM_THREADS": "1"}, **machine) == (2, ENV)
    assert chose({"OMP_NUM_THREADS": "2"}, **machine) == (2, "OMP_NUM_THREADS")
    assert chose({}, 2, **machine) == (1, "rule")  # torch's 2 (its default?) lowered
    idle = dict(usable=16, load=0.0, machine_cpus=16)  # the rule says 4
    assert chose({}, 2, **idle) == (2, "torch.set_num_threads")  # never raised
    assert chose({"OMP_NUM_THREADS": "two"}, **idle) == (CAP, "rule")  # not a count: ignored
    for bad in ("0", "-1", "two", "", "2000"):
        with pytest.raises(PagedLearnError, match=rf"{ENV} must be a whole number .* got '{bad}'"):
            choose({ENV: bad}, torch_threads=None, **idle)
    line = threads.describe(choose({}, torch_threads=None, **machine))
    assert (
        line.startswith("torch threads: ") and "2 CPUs usable, load 3.40: pagedlearn's rule" in line
    )


def test_the_graders_sandbox_passes_the_override_through(monkeypatch, tmp_path):
    from pagedlearn.labs.sandbox import _environment

    monkeypatch.setenv(ENV, "3")
    env = _environment(tmp_path)
    assert env[ENV] == "3" and env["OMP_NUM_THREADS"] == "1"  # the override wins in the worker
    monkeypatch.delenv(ENV)
    assert ENV not in _environment(tmp_path)


CHILD = """
import json, os, threading
import pagedlearn, torch
from pagedlearn.cli import threads
seen = []  # a server's engine thread, say
t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
t.start(); t.join()
print(json.dumps(dict(chosen=threads.chosen.count, source=threads.chosen.source, thread=seen[0],
                      torch=torch.get_num_threads(), omp=os.environ["OMP_NUM_THREADS"])))
"""


def test_import_pagedlearn_gives_torch_the_count_in_its_threads_and_the_processes_it_starts():
    # OMP_NUM_THREADS is what a process started from this one reads (torch reads it at import;
    # the tensor-parallel executor splits it between its workers).
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", ENV)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    n = got["chosen"]
    assert got["source"] == "rule" and 1 <= n <= CAP, got
    assert got["torch"] == got["thread"] == n and got["omp"] == str(n), got
