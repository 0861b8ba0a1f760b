"""Bad input to a kernel is refused before anything runs, with an error that names the problem."""

import re
import subprocess
import sys

import pytest
import torch
from paged_cases import DEVICE, make_case, make_queries

import kernels
from kernels import paged_attention_decode, paged_attention_prefill, write_kv
from pagedlearn.errors import AttentionInputError


def decode_args():
    case = make_case([5, 9], 4, 2, 16)
    return [make_queries(2, 4, 16), case.key_cache, case.value_cache, case.block_tables,
            case.context_lens]  # fmt: skip


@pytest.mark.parametrize(
    ("position", "make_bad", "message"),
    [
        (0, lambda a: a[0][0], "q must have 3 dimensions"),
        (0, lambda a: a[0].double(), "q must be one of"),
        (0, lambda a: a[0][:, :3], "not a multiple of the cache's 2 KV heads"),
        (1, lambda a: a[1].half(), "share one dtype"),
        (1, lambda a: a[1][:, ::2], "value_cache has shape"),
        (2, lambda a: a[2].transpose(1, 2).contiguous().transpose(1, 2), "must be contiguous"),
        (3, lambda a: a[3].float(), "block_tables must be one of int32, int64"),
        (4, lambda a: a[4][:1], "context_lens 1 entries"),
    ],
)
def test_decode_refuses_bad_tensors(position, make_bad, message):
    args = decode_args()
    args[position] = make_bad(args)
    with pytest.raises(AttentionInputError, match=re.escape(message)):
        paged_attention_decode(*args)


def test_decode_refuses_bad_values_on_the_cpu():
    args = decode_args()
    if DEVICE != "cpu":
        pytest.skip("block ids and lengths are checked on CPU tensors only")
    args[3] = args[3].clone()
    args[3][1, 2] = 99
    with pytest.raises(AttentionInputError, match="block_tables\\[1\\] uses block 99"):
        paged_attention_decode(*args)


@pytest.mark.parametrize("num_splits", [0, 65, 2.0, True])
def test_decode_refuses_bad_num_splits(num_splits):
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_decode(*decode_args(), num_splits=num_splits)


def test_decode_refuses_a_head_dim_it_cannot_hold():
    case = make_case([3], 4, 1, 512)
    with pytest.raises(AttentionInputError, match="supports up to 256"):
        paged_attention_decode(make_queries(1, 1, 512), case.key_cache, case.value_cache,
                               case.block_tables, case.context_lens)  # fmt: skip


def test_prefill_refuses_a_max_query_len_that_is_too_short():
    case = make_case([5, 9], 4, 2, 16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
    args = (make_queries(6, 4, 16), case.key_cache, case.value_cache, case.block_tables, cu,
            case.context_lens)  # fmt: skip
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="max_query_len is 3 but a sequence has 4"):
            paged_attention_prefill(*args, max_query_len=3)
    with pytest.raises(AttentionInputError, match="cu_seqlens_q must be one of"):
        paged_attention_prefill(*args[:4], cu.float(), args[5])


def test_write_kv_refuses_bad_input_and_writes_nothing():
    key_cache = torch.zeros(2, 4, 1, 8, device=DEVICE)
    value_cache = torch.zeros(2, 4, 1, 8, device=DEVICE)
    key = torch.randn(2, 1, 8, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(AttentionInputError, match="must share one dtype"):
        write_kv(key.half(), key.half(), key_cache, value_cache, slots)
    with pytest.raises(AttentionInputError, match="slot_mapping has 1 slots for 2 tokens"):
        write_kv(key, key, key_cache, value_cache, slots[:1])
    if DEVICE == "cpu":
        with pytest.raises(AttentionInputError, match="same slot"):
            write_kv(key, key, key_cache, value_cache, torch.tensor([3, 3]))
    assert not key_cache.any() and not value_cache.any()


def _run(code: str, **env) -> subprocess.CompletedProcess:
    import os

    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120
    )


def test_cpu_tensors_without_the_interpreter_get_a_clear_error():
    code = (
        "import torch\n"
        "from kernels import write_kv\n"
        "from pagedlearn.errors import KernelUnavailableError\n"
        "c = torch.zeros(1, 1, 1, 16)\n"
        "try:\n"
        "    write_kv(c[0], c[0], c, c.clone(), torch.tensor([0]))\n"
        "except KernelUnavailableError as e:\n"
        "    print(e)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert "TRITON_INTERPRET=1" in out.stdout and "write_kv_ref" in out.stdout


def test_without_triton_the_kernels_import_and_point_to_the_reference():
    code = (
        "import sys, inspect; sys.modules['triton'] = None\n"
        "import kernels\n"
        "from kernels import paged_attention_decode\n"
        "from pagedlearn.attention import paged_attention_ref\n"
        "assert not kernels.triton_available()\n"
        "sig = inspect.signature\n"
        "assert sig(paged_attention_decode) == sig(paged_attention_ref)\n"
        "try:\n"
        "    paged_attention_decode(None, None, None, None, None)\n"
        "except RuntimeError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("KernelUnavailableError") and "paged_attention_ref" in out.stdout


def test_kernels_have_the_signatures_of_their_references():
    import inspect

    from pagedlearn import attention

    assert inspect.signature(paged_attention_decode).parameters.keys() == (
        inspect.signature(attention.paged_attention_ref).parameters.keys() | {"num_splits"}
    )
    assert list(inspect.signature(write_kv).parameters) == list(
        inspect.signature(attention.write_kv_ref).parameters
    )
    assert kernels.triton_available()


def test_setting_the_interpreter_after_importing_triton_is_explained():
    code = (
        "import os, triton, torch\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from kernels import write_kv\n"
        "c = torch.zeros(1, 1, 1, 16)\n"
        "write_kv(c[0], c[0], c, c.clone(), torch.tensor([0]))\n"
    )
    out = _run(code)
    assert out.returncode == 1 and "set after triton was imported" in out.stderr
