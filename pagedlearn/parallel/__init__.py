"""Tensor parallelism: N worker processes, one scheduler, one block table (paper section 4.6).

``LLM(model, tensor_parallel_size=N)`` (vLLM's name) starts N workers. Each holds 1/N of every
layer's attention heads and MLP columns (sharding.py, with transformers' tensor-parallel styles) and
its own KV slab with 1/N of every token's heads, at the same block ids as the others
(worker.py). The driver keeps the one ``Scheduler`` and ``KVCacheManager`` and sends every worker
the same step (executor.py); copy-on-write and swaps go to every worker by block id
(sharded_kv_cache.py)::

    llm = LLM("tiny-gpt2", tensor_parallel_size=2, num_blocks=64)
    llm.generate(["Hello"], SamplingParams(max_tokens=8))     # the same tokens as with one
    llm.collective_rpc("describe")      # per worker: pid, KV heads held, bytes of KV and weights
    llm.shutdown()                      # or let garbage collection / interpreter exit do it

Models: GPT-2, OPT and the Llama architecture (Llama, Mistral, Qwen2; sharding.py says why
these); N must divide the KV heads, so SmolLM2-135M (3 KV heads) runs on 3 workers, not 2. On
CPUs the workers talk through gloo, on GPUs through NCCL (one GPU per worker).
"""

from __future__ import annotations

from pagedlearn.errors import PagedLearnError
from pagedlearn.parallel.executor import TensorParallelExecutor
from pagedlearn.parallel.sharded_kv_cache import ShardedKVCache
from pagedlearn.parallel.sharding import check_tensor_parallel, shard_model, tensor_parallel_plan
from pagedlearn.parallel.worker import Worker

__all__ = [
    "ShardedKVCache",
    "TensorParallelExecutor",
    "Worker",
    "check_tensor_parallel",
    "collective_rpc",
    "shard_model",
    "start_workers",
    "tensor_parallel_plan",
]


def start_workers(model, size, spec, num_blocks, block_size, swap_blocks, backend, device):
    """Start ``size`` workers for ``model``; returns ``(ShardedKVCache, TensorParallelExecutor)``,
    which the engine uses as its KV cache and its runner."""
    executor = TensorParallelExecutor(
        model, size, spec, num_blocks=num_blocks, block_size=block_size,
        swap_blocks=swap_blocks, backend=backend, device=str(device),
    )  # fmt: skip
    cache = ShardedKVCache(
        executor, spec, spec.split_heads(size), num_blocks, block_size, device, swap_blocks
    )
    return cache, executor


def collective_rpc(engine, method, args: tuple = (), kwargs: dict | None = None) -> list:
    """Run ``method`` on every worker of ``engine`` (see ``LLM.collective_rpc``); results by
    rank. An engine without workers is one in-process worker: the whole model and cache."""
    message = (method, tuple(args), dict(kwargs or {}))
    if isinstance(engine.runner, TensorParallelExecutor):
        return engine.runner.call("rpc", message)
    worker = Worker(0, 1, engine.model, engine.kv_cache, engine.runner)
    try:  # the same error as from worker processes, whatever the function raised
        return [worker.handle("rpc", message)]
    except Exception as e:
        raise PagedLearnError(f"collective_rpc failed on the one in-process worker: {e!r}") from e
