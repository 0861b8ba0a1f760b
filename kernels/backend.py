"""Where a Triton kernel runs, and the launch settings every kernel wrapper shares.

Triton compiles ``@triton.jit`` functions for a GPU. Without one, Triton can *interpret* the same
kernel on the CPU, one program at a time with NumPy, if ``TRITON_INTERPRET=1`` is in the
environment before Triton is imported: Triton decides at ``@triton.jit`` time, and its own
library (``tl.cdiv``, the reductions behind ``tl.sum``/``tl.max``) is jitted when ``triton`` is
imported. That is slow, but it runs the very code a GPU would, which is how the tests check the
kernels on a laptop:

    TRITON_INTERPRET=1 python -c "import kernels; ..."      # or, first thing in a notebook:
    import os; os.environ["TRITON_INTERPRET"] = "1"         # before importing kernels or triton

This module imports Triton, so only the kernel files import it; ``kernels/__init__.py`` does not.
"""

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedlearn.errors import AttentionInputError, KernelUnavailableError

MAX_HEAD_DIM = 256  # the (rows, head_dim) float32 accumulator lives in registers; more spills


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` was built for Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel, name: str, reference: str, tensor, caches) -> bool:
    """Refuse what the kernel cannot run on; return whether it runs in the interpreter.

    ``tensor`` is any input (for its device); ``caches`` are the paged caches, which the kernels
    index with their own strides but require to be contiguous (one slab, as the engine allocates).
    """
    interpreted = is_interpreted(kernel)
    how = (
        "set TRITON_INTERPRET=1 before triton is imported (e.g. `TRITON_INTERPRET=1 jupyter lab`, "
        "or os.environ['TRITON_INTERPRET'] = '1' at the top of a notebook, then restart it)"
    )
    if tensor.device.type == "cpu" and not interpreted:
        raise KernelUnavailableError(
            f"{name} got CPU tensors, but Triton compiles kernels for GPUs. To run it on the CPU, "
            f"{how}, or use the PyTorch reference pagedlearn.attention.{reference}."
        )
    if interpreted and not is_interpreted(tl.cdiv):
        raise KernelUnavailableError(
            f"{name}: TRITON_INTERPRET=1 was set after triton was imported, so the kernels are "
            f"interpreted but Triton's own library is not, and they cannot run. {how[0].upper()}"
            f"{how[1:]}."
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise AttentionInputError(f"{name} runs on CUDA or CPU tensors, got {tensor.device}")
    for cache_name, cache in caches:
        if not cache.is_contiguous():
            raise AttentionInputError(
                f"{cache_name} must be contiguous (one slab of shape {tuple(cache.shape)}); "
                "got a strided view. Allocate the cache with torch.empty/zeros, or .contiguous()"
            )
        if cache.shape[-1] > MAX_HEAD_DIM:
            raise AttentionInputError(
                f"{cache_name} has head_dim {cache.shape[-1]}; this kernel supports up to "
                f"{MAX_HEAD_DIM}"
            )
    return interpreted


def dot_settings(dtype, interpreted: bool) -> tuple[bool, str]:
    """``(upcast, input_precision)`` for the kernels' ``tl.dot`` calls.

    - float32 uses ``input_precision="ieee"``: a GPU would otherwise round the operands to TF32
      (10-bit mantissa), and fp32 results would no longer match the CPU reference to ~1e-5.
    - bfloat16 cannot be ``tl.dot``-ed by the interpreter (it multiplies the raw bits), so there
      the kernels upcast loaded tiles to float32 first. On a GPU bf16 runs natively.
    - float16 dots accumulate in float32 on every backend; the precision flag does not apply.
    """
    upcast = interpreted and dtype == torch.bfloat16
    return upcast, ("ieee" if dtype == torch.float32 or upcast else "tf32")


def tile_tokens(head_dim_pad: int, dtype) -> int:
    """How many tokens of K/V a kernel streams per loop iteration: 64, fewer for wide rows.

    The loop walks a sequence's logical blocks a tile at a time, and every token in the tile
    looks up its own block in the table, so the tile does not depend on the block size: with
    block size 16 a 64-token tile covers 4 blocks, with 1 it covers 64, with 256 a quarter of
    one. Why not one block per iteration? Decode is bound by memory bandwidth, and a GPU needs
    many loads in flight to reach it: 16 tokens per step is too little. Too many, and the tile
    no longer fits in registers: so 64 tokens of up to 128 fp16/bf16 values each, halved for
    head_dim 256 and again for float32. (``tl.dot`` needs at least 16 rows, ``tl.arange`` a
    power of two.) ``python -m kernels.gpu_compile`` shows the resulting registers and spills.
    """
    width = max(head_dim_pad, 128) * (2 if dtype == torch.float32 else 1)
    return 64 * 128 // width


def num_warps(head_dim_pad: int, dtype) -> int:
    """Warps per program: 4 (128 threads), or 8 when one tile would not fit 4 warps' registers.

    A thread has at most 255 registers; past that the compiler spills to slow local memory.
    With this rule and :func:`tile_tokens`, ``python -m kernels.gpu_compile`` shows no spills
    for head_dim 64 to 256 in fp16 and bf16, and a few dozen bytes at most in float32.
    """
    return 8 if head_dim_pad >= 128 or dtype == torch.float32 else 4


def next_power_of_2(n: int, at_least: int = 16) -> int:
    """``tl.arange`` sizes must be powers of two, and ``tl.dot`` dims at least 16: pad up."""
    return max(triton.next_power_of_2(n), at_least)
