"""Compile every kernel for an NVIDIA GPU, on a machine that has none.

Triton's compiler does not need a GPU: given a target architecture it lowers a kernel to PTX and
runs ``ptxas`` (shipped with Triton) to get the machine code a GPU would load. So CI, which has no
GPU, can still catch the errors that only the GPU path hits -- the interpreter never compiles
anything. It also answers a question worth asking of any kernel: how many registers does it use,
and does it spill to local memory? (That is what ``MAX_HEAD_DIM`` guards against.)

    python -m kernels.gpu_compile                  # sm_80 (A100) and sm_90 (H100/H200)
    python -m kernels.gpu_compile --arch 90 --quick

Each kernel is compiled with the ``tl.constexpr`` values its wrapper would pass (the wrappers'
``launch_constants``), for a few model shapes and dtypes. Exit status 1 if any compile fails.
Run it without ``TRITON_INTERPRET=1``: the interpreter replaces compiled kernels.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import decode_attention, prefix_prefill, reshape_and_cache
from kernels.backend import is_interpreted
from pagedlearn.attention.inputs import CacheShape

# (label, num_heads, num_kv_heads, head_dim, block_size)
SHAPES = [
    ("GPT-2/OPT 12x64", 12, 12, 64, 16),
    ("GQA 32/8x128", 32, 8, 128, 16),
    ("bs 1, hd 80", 8, 2, 80, 1),
    ("bs 256, hd 256", 4, 4, 256, 256),
]
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
INDEX_POINTERS = {  # integer tensors, as the tests and the engine pass them
    "block_tables_ptr": "*i32",
    "context_lens_ptr": "*i32",
    "cu_seqlens_q_ptr": "*i32",
    "slot_mapping_ptr": "*i64",
}


def signature(kernel, dtype: str) -> dict:
    """Triton's type string for every argument, read off the kernel's own parameter names."""
    types = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            types[name] = "constexpr"
        elif name in INDEX_POINTERS:
            types[name] = INDEX_POINTERS[name]
        elif name.startswith("part_"):
            types[name] = "*fp32"  # flash-decoding partial results are always float32
        elif name.endswith("_ptr"):
            types[name] = f"*{dtype}"
        else:
            types[name] = "fp32" if name == "scale" else "i32"  # strides
    return types


def resources(cubin: bytes) -> tuple[str, str]:
    """(registers, stack bytes per thread) from ``cuobjdump`` (Triton ships it), or ("-", "-").

    Registers are capped at 255 per thread; what does not fit is spilled to a per-thread stack
    in (slow) local memory, so a non-zero stack means spills.
    """
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return "-", "-"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        command = [tool, "--dump-resource-usage", f.name]
        out = subprocess.run(command, capture_output=True, text=True)
    fields = dict(kv.split(":", 1) for kv in out.stdout.split() if kv.count(":") == 1)
    return fields.get("REG", "-"), fields.get("STACK", "-")


def cases(quick: bool):
    """(kernel name, jit function, constexprs, dtype) for every compile to try."""
    shapes = SHAPES[:1] if quick else SHAPES
    for label, heads, kv_heads, head_dim, block_size in shapes:
        shape = CacheShape(1, block_size, kv_heads, head_dim, heads, 1.0)
        for dtype, name in DTYPES.items():
            if quick and dtype != torch.float16 and label != SHAPES[0][0]:
                continue
            tag = f"{label} {name}"
            for splits in (1, 4):
                consts = decode_attention.launch_constants(shape, dtype, False, splits)
                kernel = decode_attention._paged_decode_kernel
                yield f"decode splits={splits}", tag, kernel, consts["decode"], name
            merge = decode_attention.launch_constants(shape, dtype, False, 4)["merge"]
            yield "merge splits=4", tag, decode_attention._merge_splits_kernel, merge, name
            consts = prefix_prefill.launch_constants(shape, dtype, False)
            yield "prefill", tag, prefix_prefill._paged_prefill_kernel, consts, name
            consts = reshape_and_cache.launch_constants(shape)
            yield "write_kv", tag, reshape_and_cache._write_kv_kernel, consts, name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", help="e.g. 80, 90 (repeatable)")
    parser.add_argument("--quick", action="store_true", help="one shape, fewer dtypes")
    args = parser.parse_args(argv)
    if is_interpreted(decode_attention._paged_decode_kernel):
        print("TRITON_INTERPRET=1 is set: unset it, the interpreter compiles nothing.")
        return 2
    failures, start = 0, time.perf_counter()
    print(f"triton {triton.__version__}")
    print(f"{'kernel':<18} {'shape and dtype':<22} {'arch':>5} {'regs':>5} {'stack B':>8} result")
    for arch in args.arch or [80, 90]:
        target = GPUTarget("cuda", arch, 32)
        for kernel_name, tag, kernel, consts, dtype in cases(args.quick):
            consts = dict(consts)
            options = {"num_warps": consts.pop("num_warps", 4)}
            source = ASTSource(fn=kernel, signature=signature(kernel, dtype), constexprs=consts)
            try:
                compiled = triton.compile(source, target=target, options=options)
            except Exception as e:  # report every failure, then exit 1
                failures += 1
                reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                print(f"{kernel_name:<18} {tag:<22} sm_{arch:<3} {'':>5} {'':>8} FAILED: {reason}")
                continue
            regs, spill = resources(compiled.asm["cubin"])
            print(f"{kernel_name:<18} {tag:<22} sm_{arch:<3} {regs:>5} {spill:>8} ok")
    print(f"{failures} failed, in {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
