"""Triton kernels for paged attention (decode, prefill over a paged cache, KV write).

Each kernel file holds the kernel, its Python wrapper with argument checks, and the pure-PyTorch
reference (``pagedlearn.attention``) it is tested against. This package must import on a machine
without Triton; calling a kernel there raises an error that points to the reference backend.

The kernels arrive with the issue "Paged attention: pure-PyTorch references and Triton
online-softmax kernels"; until then this package is empty on purpose.
"""

__all__: list[str] = []
