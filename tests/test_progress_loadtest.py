"""Progress of the long serving runs (pagedlearn.progress): the HTTP load test says on stderr,
phase by phase, how many of its requests ended, while its report on stdout stays as it was; part
3 of bench_serve.py (serve_traffic.memory) reports its counted requests as they are answered."""

import io
import json
import math
import os
import re
from types import SimpleNamespace

import pytest
from helpers import import_benchmark

import pagedlearn.loadtest.http as http
from pagedlearn.loadtest.http_report import JSON_KEYS
from pagedlearn.loadtest.in_process import LoadTestOptionError
from pagedlearn.loadtest.mix import MIN_REQUESTS, PHASES

memory = import_benchmark("serve_traffic").memory  # a script in benchmarks/, not a package


@pytest.fixture(scope="module")
def server():
    from pagedlearn.serve import serve

    with serve("tiny-gpt2", port=0, num_blocks=64, preemption_mode="swap", swap_blocks=16) as srv:
        yield srv


def test_the_http_load_test_prints_progress_on_stderr_and_its_report_on_stdout(
    server, tmp_path, capsys, monkeypatch
):
    calls, reports = [], []
    real_progress, real_run = http.phase_progress, http.run_http_loadtest

    def recorded_progress():  # the command's own progress, its calls recorded on the way
        inner = real_progress()
        return lambda *a: (calls.append(a), inner(*a))

    def recorded_run(*a, **kw):
        reports.append(real_run(*a, **kw))
        return reports[-1]

    monkeypatch.setattr(http, "phase_progress", recorded_progress)
    monkeypatch.setattr(http, "run_http_loadtest", recorded_run)
    path = tmp_path / "r.json"
    args = SimpleNamespace(endpoint=server.url, api_key=None, model=None, num_requests=MIN_REQUESTS,
                           rate=math.inf, seed=0, json=str(path), timeout=30.0)  # fmt: skip
    assert http.cli(args) == 0
    out, err = capsys.readouterr()

    # stdout: exactly what it was before progress existed (the first line, the summary, --json)
    (report,) = reports
    head = f"pagedlearn load test over HTTP: {server.url} ...\n"
    assert out == head + report.summary() + f"\nevery number: {path}\n"
    assert set(json.loads(path.read_text())) == set(JSON_KEYS)

    # the callback: each phase in order, from 0 to all of its requests, one more at a time
    sizes = {p: sum(r["phase"] == p for r in report.requests) for p in PHASES}
    assert [c for c in calls if c[1] == 0] == [(p, 0, sizes[p]) for p in PHASES]
    for p in PHASES:
        assert [c[1] for c in calls if c[0] == p] == list(range(sizes[p] + 1))

    # stderr: a line as each phase starts, and one as it ends, in the phases' order
    lines = err.splitlines()
    for p in PHASES:
        start = lines.index(f"loadtest: the {p} phase starts: {sizes[p]} requests")
        end = rf"^loadtest {p} phase: {sizes[p]}/{sizes[p]} requests, done in \d+ s$"
        assert any(re.match(end, x) for x in lines[start:]), err


def test_phase_progress_estimates_the_time_left_from_the_requests_that_ended():
    file = io.StringIO()
    progress = http.phase_progress(file, every=0)  # a line per request (a pipe: plain lines)
    for done in range(4):
        progress("squeeze", done, 3)
    progress("cold", 0, 2)
    lines = file.getvalue().splitlines()
    assert lines[0] == "loadtest: the squeeze phase starts: 3 requests"
    for done in (1, 2):
        pattern = rf"^loadtest squeeze phase: {done}/3 requests in \d+ s; about \d+ s left at that"
        assert re.match(pattern, lines[done]), lines
    assert re.match(r"^loadtest squeeze phase: 3/3 requests, done in \d+ s$", lines[3]), lines
    assert lines[4:] == ["loadtest: the cold phase starts: 2 requests"]


def test_a_progress_that_is_not_callable_is_refused_before_anything_is_sent():
    with pytest.raises(LoadTestOptionError, match="progress must be None or progress") as e:
        http.run_http_loadtest("http://127.0.0.1:9", progress="stderr")
    assert e.value.option == "progress"


def test_the_memory_part_reports_its_counted_requests(server):
    calls = []
    m = memory(server.url, "tiny-gpt2", os.getpid(), [4, 10], warmup=3, concurrency=2,
               progress=lambda done, total: calls.append((done, total)))  # fmt: skip
    assert m["unexpected"] == 0 and [p["requests"] for p in m["points"]] == [0, 4, 10]
    assert calls[0] == (0, 10)  # after the warm-up, whose 3 requests are not counted
    assert {t for _, t in calls} == {10}
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == 10
    assert set(range(11)) == set(done)  # every answer, and each mark (4, 10) once more
    assert done.count(4) == 2 and done.count(10) == 2


def test_the_in_process_load_test_reports_each_request_that_ended():
    from pagedlearn.loadtest.in_process import phase_progress, run_loadtest

    calls, file = [], io.StringIO()
    lines = phase_progress(file)
    report = run_loadtest("tiny-gpt2", MIN_REQUESTS, math.inf,
                          progress=lambda *a: (calls.append(a), lines(*a)))  # fmt: skip
    assert report.ok
    sizes = {p: report.phases[p]["requests"] for p in PHASES}
    assert [c for c in calls if c[1] == 0] == [(p, 0, sizes[p]) for p in PHASES]
    for p in PHASES:  # finished, cancelled and rejected requests all end, one at a time
        assert [c[1] for c in calls if c[0] == p] == list(range(sizes[p] + 1))
        assert f"loadtest: the {p} phase starts: {sizes[p]} requests" in file.getvalue()
    with pytest.raises(LoadTestOptionError, match="progress must be None"):
        run_loadtest("tiny-gpt2", MIN_REQUESTS, progress=True)
