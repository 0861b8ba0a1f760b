"""Tensor parallelism (pagedlearn/parallel/): N = 2 workers give what one process gives.

Every scenario runs twice, on a tensor-parallel engine and on a one-process twin built with the
same settings, and compares tokens, logprobs and the KV slabs themselves: the workers' slabs,
put side by side along the head axis, are the twin's slab. The block managers of the two see
the same requests in the same order, so they hand out the same block ids.

Lifecycle: a worker that dies or hangs fails the engine with a WorkerError naming it, within a
bounded wait; shutdown(), garbage collection, interpreter exit and a killed driver leave no
worker process behind. Every wait here is bounded (the executor's timeouts are lowered).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from pagedlearn import LLM, PagedLearnError, SamplingParams
from pagedlearn.engine.sampling_params import BeamSearchParams
from pagedlearn.errors import WorkerError

# Every test of this file on one xdist worker (`make test` runs --dist loadgroup): the engines
# below start worker processes once, not once per pytest worker.
pytestmark = pytest.mark.xdist_group("tensor_parallel")

PROMPTS = ["Hello world, this is", "The paged attention kernel", "abc", "Hello world, this is a"]
GREEDY = SamplingParams(max_tokens=10, temperature=0)


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not reaped yet, is not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def wait_gone(pids, seconds: float = 15.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def build(model="tiny-gpt2", tp=1, **kw):
    # On the CPU (gloo) even where there is a GPU: CI's path, and tp=2 on CUDA needs two GPUs
    # (test_two_gpus below).
    kw = {"num_blocks": 40, "block_size": 4, "verbose": False, "device": "cpu", **kw}
    llm = LLM(model, tensor_parallel_size=tp, **kw)
    if tp > 1:
        llm.engine.runner.step_timeout = 60.0  # a hung worker fails a test, not the suite
    return llm


def slab(llm) -> torch.Tensor:
    """The whole KV slab: the workers' slabs side by side along the head axis."""
    parts = llm.collective_rpc(_slab_of)
    return torch.cat(parts, dim=4)  # (2, layers, blocks, block_size, heads, head_dim)


def _slab_of(worker):
    return worker.kv_cache.slab.clone()


def tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def swap_pair():
    """tiny-gpt2 with a small pool and a swap pool: tensor-parallel and its twin."""
    kw = {"num_blocks": 24, "preemption_mode": "swap", "swap_blocks": 24, "max_num_seqs": 8}
    kw["max_num_batched_tokens"] = 16  # a prompt longer than 16 tokens is prefilled in chunks
    pair = build(**kw), build(tp=2, **kw)
    yield pair
    pair[1].shutdown()


def both(pair, fn):
    one, two = (fn(llm) for llm in pair)
    assert tokens(one) == tokens(two)
    return one, two


def test_greedy_tokens_logprobs_and_slabs_match(swap_pair):
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=3)
    one, two = both(swap_pair, lambda llm: llm.generate(PROMPTS, params, use_tqdm=False))
    for a, b in zip(one, two, strict=True):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            for tok in x:
                assert abs(x[tok].logprob - y[tok].logprob) < 1e-4
    torch.testing.assert_close(slab(swap_pair[1]), slab(swap_pair[0]), atol=1e-5, rtol=1e-5)
    swap_pair[1].engine.add_request("timed", "Hello", GREEDY)
    swap_pair[1].engine.step()  # a step's timings: both ranks, all-reduces inside its busy time
    t = swap_pair[1].engine.runner.last_timings
    assert sorted(t["busy"]) == sorted(t["all_reduce"]) == [0, 1]
    assert all(0 < t["all_reduce"][r] <= t["busy"][r] for r in (0, 1))
    while swap_pair[1].engine.has_unfinished_requests():
        swap_pair[1].engine.step()
    swap_pair[0].generate(["Hello"], GREEDY, use_tqdm=False)  # the twin does the same work


def test_sampling_forks_beams_prefix_hits_and_chunked_prefill_match(swap_pair):
    # n=3 forks share the prompt's blocks and copy on write; a seed makes both draw the same.
    sampled = SamplingParams(n=3, max_tokens=8, temperature=0.8, seed=7)
    both(swap_pair, lambda llm: llm.generate(["Once upon a time"], sampled, use_tqdm=False))
    beams = BeamSearchParams(beam_width=3, max_tokens=6)
    both(swap_pair, lambda llm: llm.beam_search(["The kernel"], beams, use_tqdm=False))
    long = "a prompt prefilled in chunks of 16 tokens"  # 41 tokens: 11 blocks
    hits = []
    for llm in swap_pair:  # the second time, the prompt's full blocks come from the cache
        outs = [llm.generate([long], GREEDY, use_tqdm=False)[0] for _ in range(2)]
        hits.append(outs[1].num_cached_tokens)
    assert hits[0] == hits[1] > 0
    torch.testing.assert_close(slab(swap_pair[1]), slab(swap_pair[0]), atol=1e-5, rtol=1e-5)


def test_swap_preemption_moves_every_workers_heads(swap_pair):
    # Eight prompts of 30 tokens in a 24-block pool of 4 tokens: the scheduler swaps out.
    prompts = [f"{i} the quick brown fox jumps over" for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0)
    both(swap_pair, lambda llm: llm.generate(prompts, params, use_tqdm=False))
    swaps = [llm.engine.scheduler.num_preemptions["swap"] for llm in swap_pair]
    assert swaps[0] == swaps[1] > 0
    assert swap_pair[1].engine.kv_cache.copy_seconds["swap_out"] > 0
    torch.testing.assert_close(slab(swap_pair[1]), slab(swap_pair[0]), atol=1e-5, rtol=1e-5)


def test_recompute_preemption_ctrl_c_and_shutdown_with_tiny_opt(monkeypatch):
    from pagedlearn.parallel import executor

    kw = {"num_blocks": 20, "preemption_mode": "recompute"}
    pair = build("tiny-opt", **kw), build("tiny-opt", tp=2, **kw)
    llm, pids = pair[1], list(pair[1].engine.runner.pids)
    real, calls = executor.wait, []

    def interrupted_once(*args, **kwargs):  # Ctrl-C lands while the driver waits
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    try:
        monkeypatch.setattr(executor, "wait", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        monkeypatch.setattr(executor, "wait", real)
        assert llm.engine.runner._outstanding  # the answers it did not read: read first next
        assert not llm.engine.requests  # generate aborted its requests
        prompts = [f"{i} the quick brown fox jumps over" for i in range(6)]
        params = SamplingParams(max_tokens=12, temperature=0)
        both(pair, lambda x: x.generate(prompts, params, use_tqdm=False))
        n = [x.engine.scheduler.num_preemptions["recompute"] for x in pair]
        assert n[0] > 0 and n[1] > 0
        described = llm.collective_rpc("describe")
        assert [d["kv_heads"] for d in described] == [[0, 1], [2, 3]]
        assert described[0]["kv_bytes"] * 2 == pair[0].engine.kv_cache.nbytes
    finally:
        llm.shutdown()
    llm.shutdown()  # idempotent
    assert wait_gone(pids) == []
    with pytest.raises(PagedLearnError, match="shut down"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def test_triton_backend_matches_torch():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on a CPU needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    pytest.importorskip("triton")
    one = build(num_blocks=16)
    two = build(tp=2, num_blocks=16, attention_backend="triton")
    try:
        params = SamplingParams(max_tokens=2, temperature=0)
        both((one, two), lambda llm: llm.generate(PROMPTS[:2], params, use_tqdm=False))
    finally:
        two.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (one per worker)")
def test_two_gpus_nccl_and_triton_match_one():
    one = build(device="cuda", num_blocks=32)
    two = build(tp=2, device="cuda", num_blocks=32, attention_backend="triton")
    try:
        assert [d["device"] for d in two.collective_rpc("describe")] == ["cuda:0", "cuda:1"]
        both((one, two), lambda llm: llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    finally:
        two.shutdown()


# --- what is refused --------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, -1, True, 2.0, "2"])
def test_bad_sizes_are_refused(size):
    with pytest.raises(PagedLearnError, match="tensor_parallel_size must be a positive int"):
        build(tp=size)


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_process_starts():
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(PagedLearnError, match=r"must divide the model's attention heads \(4\)"):
        build(tp=3)
    with pytest.raises(PagedLearnError, match=r"supports the model types \('gpt2', 'opt', 'llama'"):
        build("tiny-gemma3", tp=2)  # q/k norms: a plan with another style (sharding.py)
    assert set(multiprocessing.active_children()) == before


def test_the_driver_has_no_slab_to_read(swap_pair):
    with pytest.raises(PagedLearnError, match="collective_rpc"):
        swap_pair[1].engine.kv_cache.key_cache(0)


def test_a_failing_rpc_raises_and_leaves_the_engine_usable(swap_pair):
    with pytest.raises(PagedLearnError, match="ZeroDivisionError"):
        swap_pair[1].collective_rpc(_divide_by_zero)
    both(swap_pair, lambda llm: llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))


def _divide_by_zero(worker):
    return 1 / 0


def test_an_unpicklable_or_unimportable_rpc_is_refused_and_the_engine_goes_on(swap_pair):
    import types

    llm = swap_pair[1]
    with pytest.raises(PagedLearnError, match="must be importable by name"):
        llm.collective_rpc(lambda worker: worker.rank)
    only_here = types.ModuleType("only_in_the_driver")  # the workers cannot import it
    exec("def rank(worker):\n    return worker.rank", only_here.__dict__)
    sys.modules["only_in_the_driver"] = only_here
    try:
        unimportable = r"(?s)collective_rpc failed on .*only_in_the_driver"
        with pytest.raises(PagedLearnError, match=unimportable):
            llm.collective_rpc(only_here.rank)
    finally:
        del sys.modules["only_in_the_driver"]
    with pytest.raises(PagedLearnError, match="collective_rpc failed"):
        llm.collective_rpc(_unpicklable_result)
    both(swap_pair, lambda x: x.generate(PROMPTS[:1], GREEDY, use_tqdm=False))


def _unpicklable_result(worker):
    import threading

    return threading.Lock()


def test_a_ctrl_c_between_two_workers_messages_waits_for_both(swap_pair):
    """A real SIGINT after the first worker's message: the second still gets it."""
    conn = swap_pair[1].engine.runner.conns[0]
    real = conn.send_bytes

    def send_then_interrupt(message):
        real(message)
        os.kill(os.getpid(), signal.SIGINT)

    conn.send_bytes = send_then_interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            swap_pair[1].collective_rpc("describe")
    finally:
        del conn.send_bytes
    assert [d["rank"] for d in swap_pair[1].collective_rpc("describe")] == [0, 1]
    both(swap_pair, lambda x: x.generate(PROMPTS[:2], GREEDY, use_tqdm=False))


def test_two_threads_at_once_are_told_to_use_one(swap_pair):
    import threading

    llm = swap_pair[1]
    slow = threading.Thread(target=llm.collective_rpc, args=(_sleep, (1.0,)))
    slow.start()
    deadline = time.monotonic() + 10
    while not llm.engine.runner._busy.locked() and time.monotonic() < deadline:
        time.sleep(0.01)  # until the other thread is inside its call
    try:
        with pytest.raises(PagedLearnError, match="two threads used the tensor-parallel workers"):
            llm.collective_rpc("describe")
    finally:
        slow.join(30)
    assert len(llm.collective_rpc("describe")) == 2


@pytest.mark.parametrize("device", ["meta", "cuda:1"])
def test_devices_other_than_cpu_and_cuda_are_refused(device):
    with pytest.raises(PagedLearnError, match=r"device=.cpu. .* or device=.cuda."):
        build(tp=2, device=device)


def test_workers_start_fresh_when_their_environment_changed(monkeypatch):
    from pagedlearn.parallel import executor

    monkeypatch.setattr(executor, "_fork_server_env", None)
    assert executor._context().get_start_method() == "forkserver"
    monkeypatch.setenv("TRITON_INTERPRET", "changed")
    assert executor._context().get_start_method() == "spawn"


# --- lifecycle: nothing hangs, nothing is left behind -----------------------------------------
def test_a_worker_that_dies_fails_the_engine_with_its_name():
    llm = build(tp=2)
    pids = list(llm.engine.runner.pids)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(
        WorkerError, match=rf"worker 1 \(pid {pids[1]}\) died \(killed by SIGKILL\)"
    ):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert "tensor-parallel workers are stopped" in llm.engine.broken
    assert not llm.engine.requests  # every request it held failed
    with pytest.raises(PagedLearnError, match="takes no more requests"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert wait_gone(pids) == []
    llm.shutdown()  # idempotent after a failure


def test_a_worker_that_hangs_fails_the_engine_after_the_timeout():
    llm = build(tp=2)
    llm.engine.runner.step_timeout = 2.0
    pids = list(llm.engine.runner.pids)
    with pytest.raises(WorkerError, match=r"did not answer 'rpc' within 2 s"):
        llm.collective_rpc(_sleep, (60,))
    assert wait_gone(pids) == []
    with pytest.raises(WorkerError, match="workers are stopped"):
        llm.engine.runner.call("rpc", ("describe", (), {}))


def _sleep(worker, seconds):
    time.sleep(seconds)


def test_a_worker_that_raises_in_a_step_fails_the_requests():
    llm = build(tp=2)
    llm.collective_rpc(_break_forward)
    llm.engine.add_request("r", "Hello", GREEDY)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"(?s)worker 1 .* raised .*RuntimeError: injected"):
        llm.engine.step()
    assert time.monotonic() - t0 < 10  # not the step timeout: rank 0 is stopped at once
    out = llm.engine.step()  # the failed request's output, then the engine refuses to step
    assert [o.outputs[0].finish_reason for o in out] == ["error"]
    with pytest.raises(PagedLearnError, match="cannot step"):
        llm.engine.step()


def _break_forward(worker):
    def run(inputs):
        raise RuntimeError("injected")

    if worker.rank == 1:  # rank 0 then waits in the first all-reduce: the driver must not
        worker.runner.run = run


def test_garbage_collection_stops_the_workers():
    llm = build(tp=2)
    pids = list(llm.engine.runner.pids)
    del llm
    gc.collect()
    assert wait_gone(pids) == []


SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pagedlearn import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM("tiny-gpt2", tensor_parallel_size=2, num_blocks=16, verbose=False)
        llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
        from multiprocessing import forkserver
        print(*llm.engine.runner.pids, forkserver._forkserver._forkserver_pid, flush=True)
        if sys.argv[1] == "hang":
            time.sleep(120)  # until the test kills this driver
    """
)


@pytest.mark.parametrize("end", ["exit", "hang"])
def test_interpreter_exit_and_a_killed_driver_leave_no_worker(tmp_path, end):
    script = tmp_path / "driver.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), end], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]  # two workers, the fork server
        assert len(pids) == 3
        if end == "hang":  # no atexit, no finalizer: the workers see their pipe close
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert wait_gone(pids) == []


def test_a_script_without_the_main_guard_gets_told_why(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from pagedlearn import LLM\n"
        "LLM('tiny-gpt2', tensor_parallel_size=2, num_blocks=16, verbose=False)\n"
    )
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert run.returncode != 0
    assert "WorkerError" in run.stderr
    assert "if __name__ == '__main__':" in run.stderr.splitlines()[-1]


def test_the_demo_takes_tensor_parallel_size():
    run = subprocess.run(
        [sys.executable, "-m", "pagedlearn", "demo", "--model", "tiny-gpt2", "-tp", "2"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "tensor parallel: 2 workers" in run.stdout


def test_a_server_built_with_workers_stops_them():
    httpx = pytest.importorskip("httpx")
    from pagedlearn.serve import serve

    srv = serve("tiny-gpt2", port=0, tensor_parallel_size=2, num_blocks=32, verbose=False)
    pids = list(srv.engine.runner.pids)
    try:
        body = {"model": srv.model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{srv.base_url}/completions", json=body, timeout=60).json()
        twin = build(num_blocks=32).generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
        assert reply["choices"][0]["text"] == twin[0].outputs[0].text
    finally:
        srv.stop()
    assert wait_gone(pids) == []
