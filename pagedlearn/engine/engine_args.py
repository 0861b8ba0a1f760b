"""``EngineArgs``: ``LLM``'s arguments, checked, and the engine built from them.

vLLM's ``LLM.__init__`` packs its keyword arguments into an ``EngineArgs`` and builds its engine
from that; pagedlearn does the same, so that :mod:`pagedlearn.engine.llm` reads as the front door
(``generate``, ``beam_search``) and this file holds the set-up, called from ``LLM.__init__`` only:

1. check every argument that needs no model (``__post_init__``): a bad one fails before a
   model loads or a worker starts;
2. load the model, read its KV-cache spec, and size the pool (:meth:`EngineArgs.sizes`): how many
   blocks fit the memory budget, the swap pool, the step's token budget;
3. build the block manager (one :class:`~pagedlearn.KVCacheManager`, or a
   :class:`~pagedlearn.hybrid.kv_cache_coordinator.KVCacheCoordinator` over the KV-cache groups
   of a model with sliding-window layers), the KV tensors and the model runner (here, or in
   ``tensor_parallel_size`` worker processes), and the :class:`LLMEngine` over them.

The fields are ``LLM``'s keyword arguments, documented in :class:`~pagedlearn.LLM`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedlearn.attention.kv_cache import KVCache
from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.engine.llm_engine import LLMEngine
from pagedlearn.engine.scheduler import KV_RESERVATIONS, PREEMPTION_MODES, Scheduler
from pagedlearn.errors import KernelUnavailableError, PagedLearnError
from pagedlearn.hybrid.kv_cache_coordinator import KVCacheCoordinator
from pagedlearn.models.runner import ModelRunner, kv_cache_spec, max_model_len

CPU_DEFAULT_BYTES = 256 * 2**20
GPU_DEFAULT_FRACTION = 0.4
ATTENTION_BACKENDS = ("auto", "triton", "torch", "reference")


@dataclass(kw_only=True)
class EngineArgs:
    """Everything ``LLM(...)`` was given; :meth:`create_engine` builds the engine from it. No
    field has a default: ``LLM``'s signature is the one place the defaults are written."""

    model: object
    tokenizer: object
    block_size: int
    num_blocks: int | None
    kv_cache_memory: int | None
    enable_prefix_caching: bool
    preemption_mode: str
    swap_blocks: int | None
    attention_backend: str
    device: str
    dtype: object
    max_num_seqs: int
    max_num_batched_tokens: int | None
    enable_chunked_prefill: bool
    kv_reservation: str
    kv_cache_manager: object
    verbose: bool
    model_version: object
    tensor_parallel_size: int

    def __post_init__(self) -> None:
        _check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _check_choice("kv_reservation", self.kv_reservation, KV_RESERVATIONS)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_positive("block_size", self.block_size)
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.kv_cache_manager is not None and not callable(self.kv_cache_manager):
            raise PagedLearnError(
                "kv_cache_manager must be a KVCacheManager class (or a callable taking its "
                f"arguments), got {self.kv_cache_manager!r}"
            )
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise PagedLearnError("give num_blocks or kv_cache_memory, not both")

    def create_engine(self):
        """Load the model and build the engine: returns ``(engine, loaded model, device,
        attention backend)``, the last two resolved from "auto"."""
        from pagedlearn.models import LoadedModel, load

        tp, device = self.tensor_parallel_size, self.device
        dev = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        )
        backend = _pick_backend(self.attention_backend, dev)
        model = self.model
        loaded = (
            model if isinstance(model, LoadedModel) else load(model, self.tokenizer, self.dtype)
        )
        # With tensor parallelism the driver keeps the whole model on the CPU: each worker puts
        # its own share on its device (pagedlearn/parallel/).
        hf_model = loaded.model.to(dev) if tp == 1 else loaded.model
        spec = kv_cache_spec(hf_model)
        max_len = max_model_len(hf_model)
        if tp > 1:
            from pagedlearn.parallel import check_tensor_parallel

            check_tensor_parallel(hf_model, tp)  # before a process starts
        num_blocks, swap_blocks, max_batched = self.sizes(spec, max_len, dev)

        block_size = self.block_size
        if spec.is_hybrid:  # sliding-window layers: one manager per KV-cache group
            if self.kv_cache_manager is not None:
                raise PagedLearnError(
                    f"kv_cache_manager= runs full-attention models only; {loaded.name} has "
                    "sliding-window layers, whose KV-cache groups pagedlearn's own "
                    "KVCacheCoordinator manages"
                )
            kv = KVCacheCoordinator(
                spec.groups,
                num_blocks,
                block_size,
                self.enable_prefix_caching,
                model_id=loaded.name,
                num_cpu_blocks=swap_blocks,
            )
        else:
            kv = (self.kv_cache_manager or KVCacheManager)(
                num_blocks,
                block_size,
                self.enable_prefix_caching,
                model_id=loaded.name,
                num_cpu_blocks=swap_blocks,
            )
        if tp == 1:
            cache = KVCache(spec, num_blocks, block_size, dev, swap_blocks)
            runner = ModelRunner(hf_model, cache, backend)
        else:  # tp worker processes, each with 1/tp of the model and of every block
            from pagedlearn.parallel import start_workers

            cache, runner = start_workers(
                hf_model, tp, spec, num_blocks, block_size, swap_blocks, backend, dev
            )
        scheduler = Scheduler(
            kv,
            self.max_num_seqs,
            max_batched,
            self.preemption_mode,
            self.enable_chunked_prefill,
            self.kv_reservation,
            max_len,
        )
        engine = LLMEngine(hf_model, loaded.tokenizer, cache, runner, scheduler, max_len)
        if self.model_version is not None:
            engine.model_version = self.model_version  # the manager's model_id: (name, version)
        if self.verbose:
            print(
                f"pagedlearn: {loaded.name} on {dev} ({spec.dtype}), attention: {backend}\n"
                f"  KV cache: {spec.formula()}\n"
                f"  {num_blocks} blocks x {block_size} tokens = {cache.num_tokens:,} tokens "
                f"({cache.nbytes / 2**20:.1f} MiB)"
                + (f"; swap pool {swap_blocks} blocks" if swap_blocks else "")
                + ("; max-length reservation" if self.kv_reservation == "max" else "")
                + (_tp_line(cache, runner) if tp > 1 else "")
            )
        return engine, loaded, dev, backend

    def sizes(self, spec, max_len: int, dev: torch.device) -> tuple[int, int, int]:
        """``(num_blocks, swap_blocks, max_num_batched_tokens)`` for a model whose KV cache
        ``spec`` describes and whose sequences reach ``max_len`` tokens: what was given, or
        the defaults ``LLM``'s docstring states, checked."""
        block_size, max_num_seqs = self.block_size, self.max_num_seqs
        num_blocks, kv_cache_memory = self.num_blocks, self.kv_cache_memory
        # The memory budget is per device, and each of the tp workers holds 1/tp of every
        # block: the same budget holds tp times the blocks.
        worker_spec = spec.split_heads(self.tensor_parallel_size)
        if num_blocks is None:
            if kv_cache_memory is None:
                kv_cache_memory = _default_budget(dev)
                # Enough for max_num_seqs sequences of the model's full length, in every group.
                cap = len(spec.groups) * -(-max_num_seqs * max_len // block_size)
                num_blocks = min(worker_spec.num_blocks_for(kv_cache_memory, block_size), cap)
            else:
                num_blocks = worker_spec.num_blocks_for(kv_cache_memory, block_size)
        _check_positive("num_blocks", num_blocks, hint=f"{spec.formula()}; the budget holds none")
        swap_blocks = self.swap_blocks
        if swap_blocks is None:
            swap_blocks = num_blocks if self.preemption_mode == "swap" else 0
        if self.preemption_mode == "swap" and swap_blocks == 0:
            raise PagedLearnError(
                "preemption_mode='swap' needs a CPU swap pool, but swap_blocks=0: give it some "
                "blocks (or leave it None: as many as the GPU pool), or use 'recompute'"
            )
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = max(2048, max_len)
        if max_batched < max_num_seqs:
            raise PagedLearnError(
                f"max_num_batched_tokens ({max_batched}) must be at least max_num_seqs "
                f"({max_num_seqs}): every running sequence decodes one token per step"
            )
        return num_blocks, swap_blocks, max_batched


def _tp_line(cache, executor) -> str:
    each = cache.worker_nbytes / 2**20
    return (
        f"\n  tensor parallel: {executor.size} workers (pids {executor.pids}), each holding "
        f"{cache.worker_spec.num_kv_heads} of {cache.spec.num_kv_heads} KV heads of every block "
        f"({each:.1f} MiB each)"
    )


def _pick_backend(choice: str, dev: torch.device) -> str:
    if choice == "auto":
        from kernels import triton_available

        return "triton" if dev.type == "cuda" and triton_available() else "torch"
    if choice == "triton" and dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise KernelUnavailableError(
            "attention_backend='triton' on a CPU needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 before triton is imported (e.g. `TRITON_INTERPRET=1 python ...`), "
            "or use attention_backend='torch'"
        )
    return choice


def _default_budget(dev: torch.device) -> int:
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free * GPU_DEFAULT_FRACTION)
    return CPU_DEFAULT_BYTES


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise PagedLearnError(f"{name} must be one of {choices}, got {value!r}")


def _check_positive(name: str, value, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PagedLearnError(
            f"{name} must be a positive int, got {value!r}" + (f" ({hint})" if hint else "")
        )
