"""Triton kernels for paged attention: decode, prefill over a paged cache, and the KV write.

    from kernels import paged_attention_decode, paged_attention_prefill, write_kv

=======================  ====================  ========================================
kernel                   file                  PyTorch reference (pagedlearn.attention)
=======================  ====================  ========================================
paged_attention_decode   decode_attention.py   paged_attention_ref
paged_attention_prefill  prefix_prefill.py     paged_attention_prefill_ref
write_kv                 reshape_and_cache.py  write_kv_ref
=======================  ====================  ========================================

Each file holds the kernel, its Python wrapper (argument checks, launch) and names the reference
it is tested against. ``backend.py`` says where kernels run: on a GPU, or on the CPU in Triton's
interpreter when ``TRITON_INTERPRET=1`` is set before the kernels are imported. The attention
kernels take ``sliding_window=W`` like their references (keys ``p - W < key_pos <= p``) and never
load a block that lies before the window; ``count_loads.py`` proves it in the interpreter by
recording which blocks a decode call reads.

This package imports on a machine without Triton (macOS, Windows): importing a kernel there gives
a stand-in with the same signature that raises
:class:`~pagedlearn.errors.KernelUnavailableError`, pointing to the PyTorch reference. Triton
itself is imported only when a kernel is first looked up.
"""

import functools
import importlib

from pagedlearn.errors import KernelUnavailableError

# kernel name -> (module that defines it, name of its reference in pagedlearn.attention)
_KERNELS = {
    "paged_attention_decode": ("kernels.decode_attention", "paged_attention_ref"),
    "paged_attention_prefill": ("kernels.prefix_prefill", "paged_attention_prefill_ref"),
    "write_kv": ("kernels.reshape_and_cache", "write_kv_ref"),
}

__all__ = ["KernelUnavailableError", "triton_available", *_KERNELS]


def triton_available() -> bool:
    """Whether Triton can be imported (it is not installed on macOS or Windows)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _unavailable(name: str, reference: str):
    """A stand-in for a kernel that cannot be imported: same signature, raises when called."""
    from pagedlearn import attention

    @functools.wraps(getattr(attention, reference))
    def kernel(*args, **kwargs):
        raise KernelUnavailableError(
            f"kernels.{name} needs Triton, which is not installed here (Triton ships for Linux). "
            f"Use the PyTorch reference pagedlearn.attention.{reference} instead, or the engine's "
            "attention_backend='torch'."
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def __getattr__(name: str):
    # Called only for names not yet defined here, so each kernel's module is imported once.
    if name not in _KERNELS:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    module_name, reference = _KERNELS[name]
    kernel = (
        getattr(importlib.import_module(module_name), name)
        if triton_available()
        else _unavailable(name, reference)
    )
    globals()[name] = kernel
    return kernel
