"""How bench_block_manager.py drives its peers: vLLM's v1 KVCacheManager and BlockPool, nano-vllm.

Both peers are optional: ``load_vllm`` and ``load_nanovllm`` return a driver, or raise
:class:`PeerMissing` with one line saying what is missing and how to get it.

- vLLM (tested with 0.33.0, which needs Python >= 3.11; a CPU is enough; ~6 GB of disk):

      python3.11 -m venv ../peer-venv                    # beside the checkout, not inside it
      ../peer-venv/bin/pip install vllm==0.33.0 xxhash   # pulls its own torch
      # pagedlearn without installing its dependencies over vLLM's: a .pth file names the checkout
      site=$(../peer-venv/bin/python -c 'import site; print(site.getsitepackages()[0])')
      echo "$PWD" > "$site/pagedlearn.pth"
      ../peer-venv/bin/python benchmarks/bench_block_manager.py [--nanovllm DIR]

- nano-vllm is not on PyPI. Clone https://github.com/GeeeekExplorer/nano-vllm and pass
  ``--nanovllm <checkout>`` (or its ``nanovllm/engine/``), or pass the folder that holds a
  ``nanovllm_copy/`` package (its block_manager.py and sequence.py, imports made relative). The
  driver follows commit bb823b3's BlockManager (``can_allocate`` returns the cached blocks,
  ``hash_blocks`` runs after a step). Needs ``xxhash`` and ``numpy``.

A driver (pagedlearn's is in bench_block_manager.py) has ``version`` (a line for the report),
``caching_modes`` (the prefix-caching settings it has) and, for one system:

    manager(nblocks, caching) -> m      a block manager with ``nblocks`` usable blocks
    requests(prompts, tag) -> [r]       its per-request objects (built untimed)
    admit(m, r) -> prefix-hit tokens    what its scheduler does to admit a new prompt
    free(m, r)
    state(m, r=None) -> (used blocks, cached blocks[, blocks of r, computed tokens of r])
    decode_loop(m, reqs, steps) -> run  its own decode path, as a timed loop
    pool_alloc_free / pool_take_out     the pool workloads, on its own pool object

Each follows the system's real scheduler: vLLM's ``Scheduler.schedule`` and
``update_from_output``, nano-vllm's ``Scheduler.schedule`` and ``postprocess``.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

BS = 16  # tokens per block for every system (nano-vllm's Config wants multiples of 256, its
# BlockManager works with any size)


class Prepared(NamedTuple):
    run: Callable[[], Any]  # the timed part
    check: Callable[[Any], tuple | None]  # run's result -> the state the system ended in


class PeerMissing(Exception):
    """A peer that cannot run here; the message says why and how to get it."""


# --- vLLM -----------------------------------------------------------------------------------------
def load_vllm() -> VLLMDriver:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_LOGS", "-torch")  # torch's import-time deprecation warnings: off
    try:
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import block_pool, kv_cache_manager, kv_cache_utils
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request, RequestStatus
    except Exception as e:  # not installed, or a vLLM whose modules moved
        raise PeerMissing(
            f"vLLM: the import failed ({type(e).__name__}: {e}); to compare, run this script "
            "with a Python that has vllm==0.33.0 (see benchmarks/block_manager_peers.py)"
        ) from None
    logging.getLogger("vllm").setLevel(logging.ERROR)
    hash_fn = get_hash_fn_by_name("sha256")  # CacheConfig.prefix_caching_hash_algo's default
    kv_cache_utils.init_none_hash(hash_fn)
    spec = FullAttentionSpec(BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    v = types.SimpleNamespace(
        Manager=kv_cache_manager.KVCacheManager,
        BlockPool=block_pool.BlockPool,
        Request=Request,
        RUNNING=RequestStatus.RUNNING,
        hasher=kv_cache_utils.get_request_block_hasher(BS, hash_fn),
        params=SamplingParams(max_tokens=100_000),
        Config=KVCacheConfig,
        group=KVCacheGroupSpec(["layer0"], spec),
    )
    return VLLMDriver(v, f"vLLM {vllm.__version__} (torch {torch.__version__}; sha256 hashes)")


class VLLMDriver:
    caching_modes = (False, True)

    def __init__(self, v: types.SimpleNamespace, version: str) -> None:
        self.v, self.version = v, version

    def manager(self, nblocks: int, caching: bool):
        # +1: vLLM's BlockPool keeps block 0 as its null block; every system gets nblocks usable
        cfg = self.v.Config(
            num_blocks=nblocks + 1, kv_cache_tensors=[], kv_cache_groups=[self.v.group]
        )
        return self.v.Manager(
            cfg, 1 << 20, scheduler_block_size=BS, hash_block_size=BS, enable_caching=caching
        )

    def requests(self, prompts, tag: str) -> list:
        return [
            self.v.Request(f"{tag}{i}", list(p), self.v.params, None) for i, p in enumerate(prompts)
        ]

    def admit(self, m, r) -> int:
        """Hash the prompt's blocks (Request.__init__ does, given a block hasher), look up the
        prefix cache, allocate (and cache) the prompt's blocks, as vLLM 0.33's scheduler does."""
        if m.enable_caching:
            r._block_hasher = self.v.hasher
            r.update_block_hashes()
        blocks, hit, _ = m.get_computed_blocks(r)
        if (
            m.allocate_slots(r, r.num_tokens - hit, hit, blocks, full_sequence_must_fit=True)
            is None
        ):
            raise RuntimeError("vLLM: out of blocks")
        r.num_computed_tokens = r.num_tokens
        r.status = self.v.RUNNING
        return hit

    def free(self, m, r) -> None:
        m.free(r)

    def state(self, m, r=None) -> tuple:
        used = m.block_pool.num_gpu_blocks - 1 - m.block_pool.get_num_free_blocks()
        cached = len(m.block_pool.cached_block_hash_to_block) if m.enable_caching else 0
        if r is None:
            return used, cached
        return used, cached, len(m.get_block_ids(r.request_id)[0]), r.num_computed_tokens

    def decode_loop(self, m, reqs, steps: int) -> Callable[[], None]:
        for r in reqs:
            r.append_output_token_ids(0)  # the token the prefill sampled

        def run():
            alloc = m.allocate_slots
            for step in range(steps):
                m.new_step_starts()
                for r in reqs:  # Scheduler.schedule: one new token per running request
                    if alloc(r, 1) is None:
                        raise RuntimeError("vLLM: out of blocks")
                for r in reqs:  # _update_after_schedule, update_from_output (hashes full blocks)
                    r.num_computed_tokens += 1
                    r.append_output_token_ids(step + 1)

        return run

    def pool_alloc_free(self, nblocks: int, ops: int, to_free: list[int]) -> Prepared:
        pool = self.v.BlockPool(nblocks + 1, enable_caching=True, hash_block_size=BS)
        held = pool.get_new_blocks(nblocks // 2)
        pool.free_blocks([held[i] for i in to_free])

        def run():
            alloc, free = pool.get_new_blocks, pool.free_blocks
            for _ in range(ops):
                free(alloc(1))

        return Prepared(run, lambda _: (nblocks - pool.get_num_free_blocks(),))

    def pool_take_out(self, nblocks: int, picks: list[int]) -> Prepared:
        pool = self.v.BlockPool(nblocks + 1, enable_caching=True, hash_block_size=BS)
        blocks = pool.get_new_blocks(nblocks)
        pool.free_blocks(blocks)
        chosen = [blocks[b] for b in picks]

        def run():  # a prefix hit on a free block: touch takes it out of the free queue
            touch, free = pool.touch, pool.free_blocks
            for block in chosen:
                touch([block])
                free([block])

        return Prepared(run, lambda _: (nblocks - pool.get_num_free_blocks(),))


# --- nano-vllm ------------------------------------------------------------------------------------
def load_nanovllm(folder: str | None) -> NanoVLLMDriver:
    how = "clone https://github.com/GeeeekExplorer/nano-vllm and pass --nanovllm <checkout>"
    if folder is None:
        raise PeerMissing(f"nano-vllm: no --nanovllm DIR given; to compare, {how}")
    root = Path(folder).resolve()
    if root.parts[-2:] == ("nanovllm", "engine"):
        root = root.parent.parent  # given the checkout's nanovllm/engine/ itself
    if (root / "nanovllm_copy" / "block_manager.py").exists():
        name, source = "nanovllm_copy.block_manager", root / "nanovllm_copy"
    elif (root / "nanovllm" / "engine" / "block_manager.py").exists():
        name, source = "nanovllm.engine.block_manager", root / "nanovllm" / "engine"
        # import nanovllm.engine.* without running nanovllm/__init__.py: it loads the LLM class
        # (torch, transformers, flash-attn), which the block manager does not need
        package = types.ModuleType("nanovllm")
        package.__path__ = [str(root / "nanovllm")]
        sys.modules.setdefault("nanovllm", package)
    else:
        raise PeerMissing(f"nano-vllm: no nanovllm_copy/ nor nanovllm/engine/ in {root}; {how}")
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise PeerMissing(
            f"nano-vllm: import from {source} failed ({e}); pip install xxhash numpy"
        ) from None
    if not hasattr(module.BlockManager, "hash_blocks"):
        raise PeerMissing(
            f"nano-vllm in {source}: no BlockManager.hash_blocks; this benchmark "
            "drives commit bb823b3's API"
        )
    module.Sequence.block_size = BS  # a class attribute: nano-vllm's Config sets it per model
    return NanoVLLMDriver(module.BlockManager, module.Sequence, f"nano-vllm from {source} (xxhash)")


class NanoVLLMDriver:
    caching_modes = (True,)  # nano-vllm always caches prefixes: it has no switch

    def __init__(self, manager: type, sequence: type, version: str) -> None:
        self.Manager, self.Sequence, self.version = manager, sequence, version

    def manager(self, nblocks: int, caching: bool):
        return self.Manager(nblocks, BS)

    def requests(self, prompts, tag: str) -> list:
        return [self.Sequence(list(p)) for p in prompts]

    def admit(self, m, q) -> int:
        """Scheduler.schedule's prefill branch, then postprocess's hash_blocks of the prefill."""
        n = m.can_allocate(q)
        if n < 0:
            raise RuntimeError("nano-vllm: out of blocks")
        m.allocate(q, n)
        q.num_scheduled_tokens = q.num_tokens - q.num_cached_tokens
        m.hash_blocks(q)
        q.num_cached_tokens += q.num_scheduled_tokens
        q.num_scheduled_tokens = 0
        return n * BS

    def free(self, m, q) -> None:
        m.deallocate(q)

    def state(self, m, q=None) -> tuple:
        used, cached = len(m.used_block_ids), len(m.hash_to_block_id)
        return (
            (used, cached) if q is None else (used, cached, len(q.block_table), q.num_cached_tokens)
        )

    def decode_loop(self, m, seqs, steps: int) -> Callable[[], None]:
        for q in seqs:
            q.append_token(0)  # the token the prefill sampled

        def run():
            for step in range(steps):
                for q in seqs:  # Scheduler.schedule, decode branch
                    if not m.can_append(q):
                        raise RuntimeError("nano-vllm: out of blocks")
                    q.num_scheduled_tokens = 1
                    q.is_prefill = False
                    m.may_append(q)
                for q in seqs:  # Scheduler.postprocess
                    m.hash_blocks(q)
                    q.num_cached_tokens += q.num_scheduled_tokens
                    q.num_scheduled_tokens = 0
                    q.append_token(step + 1)

        return run

    def pool_alloc_free(self, nblocks: int, ops: int, to_free: list[int]) -> Prepared:
        m = self.Manager(nblocks, BS)
        held = [m._allocate_block() for _ in range(nblocks // 2)]
        for i in to_free:
            m.blocks[held[i]].ref_count -= 1
            m._deallocate_block(held[i])

        def run():  # one block out and back, as allocate() and deallocate() do per block
            alloc, dealloc, blocks = m._allocate_block, m._deallocate_block, m.blocks
            for _ in range(ops):
                b = alloc()
                blocks[b].ref_count -= 1
                if blocks[b].ref_count == 0:
                    dealloc(b)

        return Prepared(run, lambda _: (len(m.used_block_ids),))

    def pool_take_out(self, nblocks: int, picks: list[int]) -> Prepared:
        m = self.Manager(nblocks, BS)
        # one distinct one-block sequence per block, prefilled (hashed) and freed: all cached
        seqs = self.requests([[b, *range(1, BS)] for b in range(nblocks)], "")
        for q in seqs:
            self.admit(m, q)
        for q in seqs:
            m.deallocate(q)
        holder = {m.hash_to_block_id[m.compute_hash(q.block(0))]: q for q in seqs}
        chosen = [holder[b] for b in picks]

        def run():  # a prefix hit: the cached block leaves the free deque (deque.remove: O(n))
            alloc, dealloc = m.allocate, m.deallocate
            for q in chosen:
                alloc(q, 1)
                dealloc(q)

        return Prepared(run, lambda _: (len(m.used_block_ids),))
