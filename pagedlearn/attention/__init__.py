"""Attention over a paged KV cache: the references, their argument checks, the engine's backend, the
KV tensors.

- ``references.py`` -- pure-PyTorch attention, from plain softmax(q kᵀ) v to the block-by-block
  loop a paged kernel runs (read its functions in order). They are importable from here:
  ``from pagedlearn.attention import paged_attention_ref`` (the course-facing name; the Triton
  kernels in ``kernels/`` take the same arguments and are tested against these).
- ``inputs.py`` -- what a paged-attention call accepts: the shape, dtype and device checks that the
  references and the kernels share, so that both refuse the same inputs with the same message.
- ``sdpa.py`` -- the engine's default ``"torch"`` backend: the step planned once, one SDPA call
  per layer.
- ``kv_cache.py`` -- the physical KV slab that the manager's block ids index, and the copies
  (copy-on-write, swap) applied to it.
"""

from pagedlearn.attention.references import (
    contiguous_attention,
    decode_flops_and_bytes,
    gather_kv,
    paged_attention_batched,
    paged_attention_online_softmax_ref,
    paged_attention_prefill_ref,
    paged_attention_ref,
    write_kv_ref,
)

__all__ = [
    "contiguous_attention",
    "decode_flops_and_bytes",
    "gather_kv",
    "paged_attention_batched",
    "paged_attention_online_softmax_ref",
    "paged_attention_prefill_ref",
    "paged_attention_ref",
    "write_kv_ref",
]
