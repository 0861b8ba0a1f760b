"""The physical KV cache: the tensors that the block ids of :mod:`kv_cache_manager` point into.

The manager only hands out ids; this module owns the memory. One *slab* per model holds every
layer's keys and values::

    slab: (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
           K/V  layer     physical block  slot in block  head  channel

``slab[0, layer]`` is layer ``layer``'s key cache and ``slab[1, layer]`` its value cache, each a
contiguous ``(num_blocks, block_size, num_kv_heads, head_dim)`` view -- the layout the attention
references and the Triton kernels read. Because block ``b`` sits at the same index in every layer,
one indexing operation copies a block for all layers at once: that is how copy-on-write copies
(``copy_blocks``) and swapping (``swap_out`` / ``swap_in``) are applied.

How much memory is that? Every token stores a key and a value vector per layer and KV head::

    bytes per token = 2 * num_layers * num_kv_heads * head_dim * bytes per element

which is the paper's ``4 * L * H * D`` bytes for fp16 (2 bytes per element, H heads of size D; the
paper writes the hidden size H*D as one number). GPT-2 small in fp16: 2 * 12 * 12 * 64 * 2 =
36,864 bytes, 36 KiB for every token of every sequence.

The swap pool is a second, smaller slab in CPU memory (pinned when a GPU is used, so copies are
asynchronous DMA). The manager's second allocator hands out its block ids.

A model that mixes attention kinds (sliding-window and full layers: kv_cache_groups.py) has
several KV-cache groups, each with its own block tables over one shared pool. A block then holds
the K/V of *one group's* layers, so the slab's second axis is the layers of a group, not of the
model::

    slab: (2, layers_per_block, num_blocks, block_size, num_kv_heads, head_dim)

and layer ``layer_ids[j]`` of a group reads ``slab[:, j]`` through that group's block tables.
With one group (GPT-2, OPT) ``layers_per_block`` is the number of layers and nothing changes.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from pagedlearn.errors import PagedLearnError
from pagedlearn.hybrid.kv_cache_groups import KVCacheGroupSpec, group_layers, layers_per_block


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one model's KV cache per token: what the slab is made of."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # Per layer: None (full attention) or its sliding window. None here: every layer is full.
    layer_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.layer_windows is not None and len(self.layer_windows) != self.num_layers:
            raise PagedLearnError(
                f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers"
            )

    @property
    def groups(self) -> list[KVCacheGroupSpec]:
        """The KV-cache groups (kv_cache_groups.py); one full-attention group for GPT-2 / OPT."""
        return group_layers(self.layer_windows or [None] * self.num_layers)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer slides: then blocks are per group, and a window frees them."""
        return any(w is not None for w in self.layer_windows or ())

    @property
    def layers_per_block(self) -> int:
        """Layers whose K/V one block holds: all of them, or one group's (kv_cache_groups.py)."""
        return layers_per_block(self.groups)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x KV heads x head_dim x element size: what a token costs while
        every layer holds its K/V (a sliding layer drops it once it leaves the window)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block: ``block_size`` tokens x 2 x layers_per_block x KV heads x
        head_dim x element size. With one group, ``block_size * bytes_per_token``."""
        per_layer = 2 * self.num_kv_heads * self.head_dim * self.element_size
        return block_size * self.layers_per_block * per_layer

    def sequence_bytes(self, num_tokens: int, block_size: int) -> int:
        """Bytes one sequence of ``num_tokens`` tokens holds: every group's blocks, where a
        sliding group holds at most ``ceil(W / block_size) + 1`` (kv_cache_groups.py)."""
        blocks = sum(g.blocks_held(num_tokens, block_size) for g in self.groups)
        return blocks * self.block_bytes(block_size)

    def formula(self) -> str:
        """The bytes-per-token formula with this model's numbers, for printing."""
        elem, dtype = self.element_size, str(self.dtype).removeprefix("torch.")
        text = (
            f"2 x {self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim} "
            f"head_dim x {elem} B ({dtype}) = {self.bytes_per_token:,} B per token"
        )
        if self.is_hybrid:
            kinds = ", ".join(f"{g.name}: layers {list(g.layer_ids)}" for g in self.groups)
            text += (
                f" in every layer's window; KV-cache groups ({kinds}) share blocks of "
                f"{self.layers_per_block} layers each"
            )
        return text

    def split_heads(self, n: int) -> KVCacheSpec:
        """One of ``n`` tensor-parallel workers' share: ``num_kv_heads / n`` heads of every
        token (pagedlearn/parallel/); ``n`` must divide the KV heads."""
        if n < 1 or self.num_kv_heads % n:
            raise PagedLearnError(f"{n} workers cannot split {self.num_kv_heads} KV heads evenly")
        return dataclasses.replace(self, num_kv_heads=self.num_kv_heads // n)

    def num_blocks_for(self, memory_bytes: int, block_size: int) -> int:
        """How many whole blocks fit in ``memory_bytes``."""
        return int(memory_bytes) // self.block_bytes(block_size)


class KVCache:
    """The KV slab of one model on ``device``, plus an optional CPU swap slab.

    >>> spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    >>> cache = KVCache(spec, num_blocks=3, block_size=2)
    >>> cache.key_cache(0).shape        # (num_blocks, block_size, num_kv_heads, head_dim)
    torch.Size([3, 2, 1, 4])
    >>> cache.key_cache(1)[0] = 1.0; cache.copy_blocks([(0, 2)]); cache.key_cache(1)[2].sum().item()
    8.0
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        num_cpu_blocks: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise PagedLearnError(f"the KV cache needs at least one block, got {num_blocks}")
        self.spec, self.num_blocks, self.block_size = spec, num_blocks, block_size
        self.device = torch.device(device)
        self.groups = spec.groups
        # layer -> (its group, its index among the slab's layers_per_block layer slots)
        self._where = {
            layer: (g, j) for g, group in enumerate(self.groups)
            for j, layer in enumerate(group.layer_ids)
        }  # fmt: skip
        shape = (2, spec.layers_per_block, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        # Zeros, not empty: a kernel bug that reads an unwritten slot then shows up as a wrong
        # number in a test rather than as whatever the allocator left there.
        self.slab = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        self.cpu_slab = None
        if num_cpu_blocks > 0:
            cpu_shape = (2, spec.layers_per_block, num_cpu_blocks, *shape[3:])
            pin = self.device.type == "cuda"
            self.cpu_slab = torch.zeros(cpu_shape, dtype=spec.dtype, pin_memory=pin)
        # Seconds spent in block copies so far, per kind: what a preemption by swap costs
        # (engine/stats.py). On a GPU the clock waits for the copy (a synchronize), only in a
        # step that copies: the forward after it would wait for the copy anyway.
        self.copy_seconds = {"swap_out": 0.0, "swap_in": 0.0}

    @property
    def num_tokens(self) -> int:
        """Token capacity: num_blocks x block_size."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.slab.numel() * self.slab.element_size()

    def group_of(self, layer: int) -> int:
        """The KV-cache group of ``layer``: whose block tables and slots it reads (0 for all
        layers of a model with one attention kind)."""
        return self._where[layer][0]

    def key_cache(self, layer: int) -> torch.Tensor:
        return self.slab[0, self._where[layer][1]]  # (num_blocks, block_size, kv_heads, head_dim)

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.slab[1, self._where[layer][1]]

    # --- block copies, all layers at once -------------------------------------------------------
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``src`` -> block ``dst`` for every ``(src, dst)``, K and V, every
        layer. Sources are read before any destination is written (one gather, one scatter)."""
        if pairs:
            src, dst = self._index(pairs, self.device)
            self.slab[:, :, dst] = self.slab[:, :, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to the CPU swap pool: ``(device_block, cpu_block)`` pairs."""
        if pairs:
            t0 = time.perf_counter()
            src, dst = self._index(pairs, self.device)
            self._swap_slab()[:, :, dst.cpu()] = self.slab[:, :, src].to("cpu")
            self._timed("swap_out", t0)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks back from the CPU swap pool: ``(cpu_block, device_block)`` pairs."""
        if pairs:
            t0 = time.perf_counter()
            src, dst = self._index(pairs, self.device)
            self.slab[:, :, dst] = self._swap_slab()[:, :, src.cpu()].to(self.device)
            self._timed("swap_in", t0)

    def _timed(self, kind: str, t0: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.copy_seconds[kind] += time.perf_counter() - t0

    def _swap_slab(self) -> torch.Tensor:
        if self.cpu_slab is None:
            raise PagedLearnError("this KV cache has no CPU swap pool (num_cpu_blocks=0)")
        return self.cpu_slab

    @staticmethod
    def _index(pairs, device) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(pairs, dtype=torch.long).T  # (2, num_pairs): sources, destinations
        return idx[0].to(device), idx[1].to(device)
