"""pagedlearn: PagedAttention (Kwon et al., SOSP 2023 -- the idea behind vLLM), small and readable.

Read in this order: ``block_allocator`` (physical blocks, refcounts, free queue), ``block_table``
(logical -> physical, slots), ``prefix_cache`` (hash chain over full blocks), ``kv_cache_manager``
(all of it together: add / append / fork with copy-on-write / free), ``swap`` (preemption by swap:
a request's blocks to a CPU pool and back), ``trace`` (every block event; ``trace_file`` checks
a trace file someone else wrote).

Then ``engine`` (``LLM``, ``SamplingParams``: a model generating from the paged cache) and
``models`` (plugging the cache into Hugging Face GPT-2 / OPT).

The package imports only the standard library at load time; torch, Triton and transformers are
imported by the parts that need them (``LLM`` and friends are looked up on first use).
"""

from pagedlearn.cli import threads as _threads
from pagedlearn.core.block_allocator import BlockAllocator
from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.errors import OutOfBlocksError, PagedLearnError, TraceFileError, WorkerError

# torch's CPU threads: the CPUs this process may use, not one per core (cli/threads.py); here,
# so that it holds for everything that imports pagedlearn and every process started from it
_threads.apply()

__version__ = "0.1.0"

_ENGINE_NAMES = ("LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput")

__all__ = [
    "BlockAllocator",
    "KVCacheManager",
    "OutOfBlocksError",
    "PagedLearnError",
    "TraceFileError",
    "WorkerError",
    *_ENGINE_NAMES,
]


def __getattr__(name: str):
    if name in _ENGINE_NAMES:  # imports torch and transformers, so only when asked for
        import pagedlearn.engine

        return getattr(pagedlearn.engine, name)
    raise AttributeError(f"module 'pagedlearn' has no attribute {name!r}")
