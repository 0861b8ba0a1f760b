"""The KV write in Triton: put each new token's key and value into its slot of the paged cache.

vLLM calls this ``reshape_and_cache``. Before attention runs, the K/V of every token computed in
this step must be in the cache, at the slot the KV-cache manager chose for it:
``slot = block_id * block_size + offset`` (``BlockTable.slot_mapping``). One slot mapping drives the
whole write, for prefill and decode tokens alike. A negative slot means "skip": padding tokens
carry ``-1`` and are not written. Checked against :func:`pagedlearn.attention.write_kv_ref`.

One program copies one token: ``num_kv_heads * head_dim`` values for K and the same for V.
"""

import torch
import triton
import triton.language as tl

from kernels.backend import check_launchable
from pagedlearn.attention import write_kv_ref as reference
from pagedlearn.attention.inputs import CacheShape, check_write_kv


@triton.jit
def _write_kv_kernel(
    key_ptr,  # (num_tokens, num_kv_heads, head_dim)
    value_ptr,  # (num_tokens, num_kv_heads, head_dim)
    k_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim), contiguous
    v_cache_ptr,  # same
    slot_mapping_ptr,  # (num_tokens,) int32/int64; negative = skip
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,  # ROW rounded up to a power of two
):
    token = tl.program_id(0).to(tl.int64)

    # 1. Where this token goes. int64 before dividing and multiplying: slot * stride can pass 2**31.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    if slot >= 0:  # a negative slot (padding) writes nothing
        # 2. The token's row of K/V, flattened over (head, dim).
        offs = tl.arange(0, ROW_PAD)
        head = (offs // HEAD_DIM).to(tl.int64)
        dim = offs % HEAD_DIM
        mask = offs < ROW
        src_k = key_ptr + token * stride_key_tok + head * stride_key_head + dim
        src_v = value_ptr + token * stride_value_tok + head * stride_value_head + dim
        k = tl.load(src_k, mask=mask)
        v = tl.load(src_v, mask=mask)

        # 3. Store it at (block_id, offset) of the cache.
        dst = block_id * stride_cache_block + offset * stride_cache_slot
        dst += head * stride_cache_head + dim
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def launch_constants(shape: CacheShape) -> dict:
    """The kernel's ``tl.constexpr`` arguments for these sizes (``kernels.gpu_compile`` too)."""
    row = shape.num_kv_heads * shape.head_dim
    return {
        "BLOCK_SIZE": shape.block_size,
        "HEAD_DIM": shape.head_dim,
        "ROW": row,
        "ROW_PAD": triton.next_power_of_2(row),
    }


def write_kv(key, value, key_cache, value_cache, slot_mapping, *, check_values=True):
    """Write ``key[i]`` and ``value[i]`` into slot ``slot_mapping[i]`` of the caches, in place.

    key, value: ``(num_tokens, num_kv_heads, head_dim)``, the dtype of the caches;
    key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``, contiguous;
    slot_mapping: int ``(num_tokens,)``; slot ``s`` is offset ``s % block_size`` of physical block
    ``s // block_size``; negative slots are skipped. On the CPU, slots past the cache or used twice
    are refused (on a GPU that check would cost a sync, and is left to the caller), unless
    ``check_values=False`` (the engine, whose slots come from a KVCacheManager).
    """
    on_cpu = key.device.type == "cpu" if isinstance(key, torch.Tensor) else True
    check = on_cpu and check_values
    shape = check_write_kv(key, value, key_cache, value_cache, slot_mapping, check)
    caches = [("key_cache", key_cache), ("value_cache", value_cache)]
    check_launchable(_write_kv_kernel, "write_kv", "write_kv_ref", key, caches)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    # The kernel walks head_dim with stride 1 and slot_mapping densely; copy rare views.
    key = key.contiguous() if key.stride(-1) != 1 else key
    slot_mapping = slot_mapping.contiguous()
    value = value.contiguous() if value.stride(-1) != 1 else value
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        **launch_constants(shape),
    )


__all__ = ["launch_constants", "reference", "write_kv"]
