"""The smallest Triton kernel there is (adds 1 to a vector): ``check-env`` runs it to learn
whether Triton works here, natively on a GPU or in the CPU interpreter (``TRITON_INTERPRET=1``).

Run as ``python -m kernels.probe cpu`` or ``python -m kernels.probe cuda``; it exits 0 on success.
It is a file, not a ``python -c`` string, because ``@triton.jit`` reads the kernel's source file.
"""

import sys

import torch
import triton
import triton.language as tl


@triton.jit
def add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n  # BLOCK is a power of two; mask the tail
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)


def main(device: str) -> None:
    x = torch.arange(5, dtype=torch.float32, device=device)
    add_one_kernel[(1,)](x, 5, BLOCK=8)
    got = x.cpu().tolist()
    if got != [1.0, 2.0, 3.0, 4.0, 5.0]:
        sys.exit(f"Triton probe computed {got}, expected [1, 2, 3, 4, 5]")
    print(f"triton {triton.__version__} ran a kernel on {device}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
