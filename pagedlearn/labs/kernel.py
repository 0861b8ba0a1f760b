"""Lab 5 · The Triton decode kernel's inner loop: one tile of the online softmax, on a GPU's terms.

You write the two ``@triton.jit`` helpers of ``kernels/decode_attention.py`` that hold the
arithmetic of ``_paged_decode_kernel``, the kernel chapter 05 (``05_paged_attention_kernel``)
walks through; lab 4's ``paged_attention_online_softmax_ref`` is the same loop in PyTorch:

- ``tile`` -- ``_attend_tile``: fold ``TILE_N`` tokens into the running ``(m_i, l_i, acc)``:
  each token's physical block from the block table (``pos // BLOCK_SIZE``), its offset in it
  (``pos % BLOCK_SIZE``), masked loads past the split's end, scores ``q kᵀ * scale`` that are
  ``-inf`` where masked, the new max, ``l_i`` and ``acc`` rescaled by ``exp(m_old - m_new)``;
- ``finish`` -- ``_split_result``: ``acc / l_i``, divided once, and the split's log-sum-exp
  ``m_i + log(l_i)`` that flash-decoding merges splits by; no keys: zeros and ``-inf``.

How it is graded. Each check launches the package's ``_paged_decode_kernel`` with *your* helper
in place of the reference's, where your code runs (:func:`observe_kernel`, called through
:func:`~pagedlearn.labs.remote.in_student`: the grader's sandboxed process, or the notebook's
own), and the check, in the grader, compares the output it sends back with
:func:`~pagedlearn.attention.paged_attention_ref` on tiny float32 inputs
(:mod:`pagedlearn.labs.attention_cases`: shuffled blocks, NaN in unwritten slots, scores past
``exp``'s range). The other helper is the one ``kernels.decode_attention`` has where your code
runs: the reference's in the repository, so that each exercise is graded on its own; in the
student edition, where it is a stub, the check says that it is not written yet. Without a CUDA
GPU the kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported: ``pagedlearn.cli.notebook.setup()`` in the notebook, the grader by itself); with one,
it is compiled and runs on the GPU.

The mechanism: the kernel's Python function is rebuilt with a copy of its module's globals in
which ``_attend_tile`` / ``_split_result`` are yours, and jitted again. It is the same for a
``.py`` submission and for the notebook (whose cells define only the helpers), and it never
touches the reference module. A stub (``raise NotImplementedError``) is found in the helpers'
source before launching: a GPU could not even compile it. In the interpreter, every load and
store is first checked to fall inside the tensors the kernel was given, so a wrong offset fails
the check with a message (and the line) instead of reading wild memory or ending the process.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
import types

import numpy as np
import torch

from pagedlearn import attention as ref
from pagedlearn.labs.attention_cases import (
    ATOL,
    RTOL,
    Case,
    compare,
    known_mistakes,
    make_case,
)
from pagedlearn.labs.handout import is_stub
from pagedlearn.labs.lab import CheckFailed, Exercise, Lab, student_line
from pagedlearn.labs.remote import in_student

LAB = Lab(
    id="kernel",
    number=5,
    title="The Triton decode kernel's inner loop",
    chapter="05_paged_attention_kernel",
    files=("kernels/decode_attention.py",),
    exercises=(
        Exercise(
            "tile",
            "One tile of the online softmax, in Triton",
            {
                "_attend_tile": "load this tile's K and V through the block table (positions "
                "tile_start + arange(TILE_N), masked at >= end), score them (-inf where "
                "masked), raise the running max, rescale l_i and acc by exp(m_old - m_new), add "
                "the tile's exp(s - m_new); return the new (m_i, l_i, acc)",
            },
        ),
        Exercise(
            "finish",
            "Divide once, and the split's log-sum-exp",
            {
                "_split_result": "return (out, lse): acc divided once by l_i, and the "
                "log-sum-exp m_i + log(l_i); where l_i is 0 (no keys) out is 0 and lse -inf, "
                "never NaN",
            },
        ),
    ),
)
HELPERS = {"tile": "_attend_tile", "finish": "_split_result"}


# --- launching the kernel with the student's helper ------------------------------------------
def _device() -> str:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return "cuda" if torch.cuda.is_available() and not interpreted else "cpu"


def _raise_if_stub(name: str, helper) -> None:
    """Raise the stub's NotImplementedError without launching (a GPU cannot compile a raise)."""
    try:
        source = textwrap.dedent(inspect.getsource(helper.fn))
    except (OSError, TypeError):  # no source to read (a notebook loaded by the grader)
        return
    fn = next((n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)), None)
    if fn is not None and is_stub(fn):
        call = fn.body[-1].exc
        args = call.args if isinstance(call, ast.Call) else []
        text = args[0].value if args and isinstance(args[0], ast.Constant) else f"write {name}"
        raise NotImplementedError(text)


def _helper(sub, exercise: str):
    name = HELPERS[exercise]
    helper = getattr(sub, name)
    if not hasattr(helper, "fn"):
        raise CheckFailed(_not_jit(name, type(helper).__name__))
    _raise_if_stub(name, helper)
    return helper


def _not_jit(name: str, kind: str) -> str:
    return f"{name} must stay a @triton.jit function (keep the decorator); yours is a {kind}"


_BUILT: dict = {}  # (tile helper, finish helper) -> the kernel calling them


def student_kernel(sub, *exercises: str):
    """``_paged_decode_kernel`` calling the student's helpers for ``exercises``, and for the
    others those ``kernels.decode_attention`` has in this process (the reference's in the
    repository) -- or, where that one is a stub (a student edition, the grader's sandbox), the
    student's own; a stub left is raised here, before a GPU would fail to compile a ``raise``."""
    import triton

    from kernels import decode_attention as da

    helpers = {name: getattr(da, name) for name in HELPERS.values()}
    for ex, name in HELPERS.items():
        if ex in exercises:
            continue
        try:
            _raise_if_stub(name, helpers[name])
        except NotImplementedError:  # not in this process: the student's own, if written
            if name not in sub or not hasattr(getattr(sub, name), "fn"):
                raise
            _raise_if_stub(name, getattr(sub, name))
            helpers[name] = getattr(sub, name)
    helpers.update({HELPERS[ex]: _helper(sub, ex) for ex in exercises})
    key = tuple(helpers.values())
    if key not in _BUILT:
        fn = da._paged_decode_kernel.fn
        scope = {**fn.__globals__, **helpers}  # the kernel looks its helpers up here
        new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        new.__annotations__, new.__qualname__ = fn.__annotations__, fn.__qualname__
        new.__module__ = fn.__module__
        if len(_BUILT) > 16:  # each submission brings new helpers: keep only the latest
            _BUILT.clear()
        _BUILT[key] = _guarded(triton.jit(new))
    return _BUILT[key]


class WildAccess(Exception):
    """A load or store of the kernel outside every tensor it was given."""


def _guarded(kernel):
    """In the interpreter, ``kernel`` with every load and store checked, before it happens, to
    fall inside the tensors it was launched with: a wrong offset then fails the check with a
    message, instead of reading wild memory -- or ending the process. (A GPU has no such
    guard: there a wild address is an illegal memory access.)"""
    from triton.runtime import interpreter

    from kernels.backend import is_interpreted

    if not is_interpreted(kernel):
        return kernel
    builder, run = interpreter.InterpreterBuilder, kernel.run

    def guarded_run(*args, **kwargs):
        storages = [a.untyped_storage() for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
        lo = np.array([st.data_ptr() for st in storages], dtype=np.uint64)
        hi = lo + np.array([st.nbytes() for st in storages], dtype=np.uint64)
        load, store = builder.create_masked_load, builder.create_masked_store

        def check(ptrs, mask, verb: str) -> None:
            size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
            addr = np.broadcast_to(ptrs.data, mask.data.shape)[mask.data].astype(np.uint64)
            inside = ((addr[:, None] >= lo) & (addr[:, None] + size <= hi)).any(axis=1)
            if not inside.all():
                raise WildAccess(
                    f"your kernel would {verb} memory outside every tensor it was given "
                    f"({int((~inside).sum())} of the {addr.size} addresses of one tl.{verb}): "
                    "a block id, an offset or a mask is wrong (an unmasked lane must point "
                    "inside the caches or the block table)"
                )

        def checked_load(self, ptrs, mask, other, *rest):
            check(ptrs, mask, "load")
            return load(self, ptrs, mask, other, *rest)

        def checked_store(self, ptrs, value, mask, *rest):
            check(ptrs, mask, "store")
            return store(self, ptrs, value, mask, *rest)

        builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
        try:
            return run(*args, **kwargs)
        finally:
            builder.create_masked_load, builder.create_masked_store = load, store

    kernel.run = guarded_run
    return kernel


def _root(e: BaseException) -> BaseException:
    """The first exception in ``e``'s chain (the interpreter wraps the student's in its own)."""
    seen = [e]
    while e.__cause__ is not None and e.__cause__ not in seen:
        e = e.__cause__
        seen.append(e)
    return e


def _tail_counted(case: Case, tile: int, num_splits: int):
    """The answer when the masked positions of a sequence's last tile count, with score 0 and
    value 0: what a kernel gives that masks the loads but not the scores."""
    if num_splits != 1:
        return None
    out = torch.empty_like(case.q)
    for i, n in enumerate(case.lens):
        pad = torch.zeros(-(-n // tile) * tile - n, *case.keys[i].shape[1:], device=out.device)
        k, v = torch.cat([case.keys[i], pad]), torch.cat([case.values[i], pad])
        out[i] = ref.contiguous_attention(case.q[i : i + 1], k, v)[0]
    return out


def _unrescaled(case: Case, tile: int, num_splits: int, acc_rescaled, l_rescaled):
    """The answer of the tile loop (TILE_N = ``tile``) when ``acc`` or ``l_i`` is not multiplied
    by ``alpha = exp(m_old - m_new)`` as the max grows: lab 4's online softmax, one tile at a
    time, with that step left out."""
    if num_splits != 1:
        return None
    out = torch.empty_like(case.q)
    heads, scale = case.q.shape[1], case.q.shape[-1] ** -0.5
    for i, n in enumerate(case.lens):
        group = heads // case.keys[i].shape[1]  # query heads per KV head (grouped heads)
        k = case.keys[i].repeat_interleave(group, dim=1)  # [n, heads, head_dim]
        v = case.values[i].repeat_interleave(group, dim=1)
        m = torch.full((heads,), float("-inf"), device=out.device)
        l_sum, acc = torch.zeros(heads, device=out.device), torch.zeros_like(case.q[i])
        for t in range(0, n, tile):
            s = torch.einsum("hd,thd->ht", case.q[i], k[t : t + tile]) * scale  # [heads, T]
            m_new = torch.maximum(m, s.max(dim=1).values)
            alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
            l_sum = (alpha if l_rescaled else 1) * l_sum + p.sum(dim=1)
            acc = (alpha[:, None] if acc_rescaled else 1) * acc + torch.einsum(
                "ht,thd->hd", p, v[t : t + tile]
            )
            m = m_new
        out[i] = acc / l_sum[:, None] if n else 0
    return out


def observe_kernel(sub, exercise: str, args: tuple, num_splits: int) -> dict:
    """(Runs where the student's code is.) Launch the kernel with the student's helper for
    ``exercise`` on a case's tensors ``args`` (``Case.args()``). Returns ``{"out": the output,
    on the CPU}``, or what went wrong: ``{"not_jit": the helper's type}``, ``{"wild": the
    guard's message}`` (a load or store outside the tensors), ``{"raised": "Type: message (at
    the line)"}``. A stub raises its NotImplementedError."""
    from kernels import decode_attention as da

    helper = getattr(sub, HELPERS[exercise])
    if not hasattr(helper, "fn"):
        return {"not_jit": type(helper).__name__}
    kernel = student_kernel(sub, exercise)
    args = tuple(a.to(_device()) for a in args)
    try:
        with np.errstate(all="ignore"):  # the interpreter's numpy would warn of overflows
            out = da.launch_decode(kernel, *args, None, num_splits)
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as e:
        root = _root(e)
        if isinstance(root, NotImplementedError):
            raise root from None
        if isinstance(root, WildAccess):
            return {"wild": f"{root}{student_line(root)}"}
        return {"raised": f"{type(root).__name__}: {root}{student_line(root)}"}
    return {"out": out.detach().cpu() if torch.is_tensor(out) else repr(out)}


def check_kernel(sub, exercise: str, case: Case, num_splits: int = 1, hint: str = "") -> None:
    """Launch the kernel with the student's helper on ``case`` (in their process, through
    :func:`observe_kernel`); here, CheckFailed if its output is not the reference's."""
    from kernels import decode_attention as da

    where = (
        f"the kernel with your {HELPERS[exercise]}, num_splits={num_splits}, on {case.setting()}"
    )
    args = tuple(t.cpu() for t in case.args())
    obs = in_student(sub, observe_kernel, exercise, args, num_splits)
    if "not_jit" in obs:
        raise CheckFailed(_not_jit(HELPERS[exercise], obs["not_jit"]))
    if "wild" in obs:
        raise CheckFailed(f"{where}: {obs['wild']}; {hint}")
    if "raised" in obs:
        raise CheckFailed(f"{where}: your code raised {obs['raised']}")
    out = obs["out"]
    if torch.is_tensor(out):
        out = out.to(case.q.device)
    shape = da.check_decode(*case.args(), None, False)
    tile = da.launch_constants(shape, case.q.dtype, _device() == "cpu", num_splits)["decode"]
    tile = tile["TILE_N"]
    mistakes = [m for m in known_mistakes(case) if "physical order" in m[0] or "scale" in m[0]]
    mistakes.append(
        (
            f"the positions past the end of the last tile (TILE_N = {tile}) seem to count "
            "with score 0: their scores must be -inf (tl.where(t_mask, s, -inf)), not only "
            "their loads masked",
            lambda: _tail_counted(case, tile, num_splits),
        )
    )
    for what, acc, l_i in (
        ("acc seems", False, True),
        ("l_i seems", True, False),
        ("l_i and acc seem", False, False),
    ):
        mistakes.append(
            (
                f"{what} not to be rescaled: alpha = exp(m_i - "
                "m_new) must rescale both l_i and acc before this tile's p = exp(s - m_new) "
                "is added",
                lambda acc=acc, l_i=l_i: _unrescaled(case, tile, num_splits, acc, l_i),
            )
        )
    want = ref.paged_attention_ref(*case.args())
    if _read_unwritten(out, want):  # the check's own hint may be about something else
        hint = _which_slots(sub, exercise, case, num_splits) or hint
    compare(where, out, want, case, hint, mistakes)


def _close(a, b) -> bool:
    return torch.allclose(a, b, atol=ATOL, rtol=RTOL)


def _read_unwritten(out, want) -> bool:
    """Non-finite where the reference is finite: the first sign of reading a NaN slot."""
    return (
        torch.is_tensor(out)
        and out.shape == want.shape
        and bool((~torch.isfinite(out) & torch.isfinite(want)).any())
    )


def _which_slots(sub, exercise: str, case: Case, num_splits: int) -> str:
    """The hint when the output has NaN: launch the student's kernel once more with every
    unwritten slot holding a number. Still NaN: it came from the arithmetic (0 / 0, exp
    overflowing), and the check's own hint stands (""). Finite: a slot no token was written to
    was read, and the answer says which: the output of ``context_len + 1`` tokens is a mask that
    lets position ``end`` through; of whole blocks, the last block read in full."""
    g = torch.Generator().manual_seed(0)
    kc, vc = case.key_cache.cpu(), case.value_cache.cpu()
    kc = torch.where(kc.isnan(), torch.randn(kc.shape, generator=g), kc)
    vc = torch.where(vc.isnan(), torch.randn(vc.shape, generator=g), vc)
    q, tables, lens = case.q.cpu(), case.block_tables.cpu(), case.context_lens.cpu()
    obs = in_student(sub, observe_kernel, exercise, (q, kc, vc, tables, lens), num_splits)
    out = obs.get("out")
    if not torch.is_tensor(out) or not torch.isfinite(out).all():
        return ""
    bs, right = case.block_size, ref.paged_attention_ref(q, kc, vc, tables, lens)
    for why, read in (
        (
            "it counts one position too many: position `end` itself (t_mask = pos <= end?) "
            "must be masked; t_mask = pos < end keeps positions start .. end - 1",
            lens + 1,
        ),
        (
            "it reads the last block in full: mask every position at or past `end`",
            -(-lens // bs) * bs,
        ),
    ):
        wrong = ref.paged_attention_ref(q, kc, vc, tables, read)
        # Sequence by sequence: one whose end falls on a tile's end reads no extra slot.
        close = [(_close(o, r), _close(o, w)) for o, r, w in zip(out, right, wrong, strict=True)]
        if all(r or w for r, w in close) and any(w and not r for r, w in close):
            return f"your kernel reads slots no token was written to (here they hold NaN): {why}"
    return (
        "your kernel reads slots no token was written to (here they hold NaN; filled with "
        f"numbers, your output is finite): a position at or past `end`, or a wrong block or "
        f"offset; {WHERE_HINT}"
    )


def case(lens, block_size, heads=2, kv_heads=2, **kwargs) -> Case:
    return make_case(lens, block_size, heads, kv_heads, device=_device(), pad_inside=True, **kwargs)


# --- the tile ------------------------------------------------------------------------------------
WHERE_HINT = (
    "token t is at offset t % BLOCK_SIZE of physical block table_row[t // BLOCK_SIZE], and "
    "its K/V at block * stride_block + offset * stride_slot + head_off + offs_d"
)


@LAB.check("tile", points=2, timeout_s=30.0)
def tile_one_full_tile(sub):
    hint = f"one full tile, nothing masked: {WHERE_HINT}; scores are q kᵀ * scale"
    check_kernel(sub, "tile", case([32, 32], 4, seed=20), hint=hint)


@LAB.check("tile", points=2, timeout_s=30.0)
def tile_masks_positions_past_the_end(sub):
    hint = "positions at or past `end` must not count: mask their loads and make their scores -inf"
    check_kernel(sub, "tile", case([5, 45], 4, seed=21), hint=hint)


@LAB.check("tile", points=2, timeout_s=30.0)
def tile_block_sizes_1_5_and_64(sub):
    hint = f"a tile may span many blocks (block_size < TILE_N) or part of one (>); {WHERE_HINT}"
    for lens, bs in (([40], 1), ([40, 23], 5), ([100], 64)):
        check_kernel(sub, "tile", case(lens, bs, seed=22), hint=hint)


def _rising(i, t, n):
    return -8 + 16 * t / max(n - 1, 1)


def _steep(i, t, n):  # sequence 0 rises from -150 to 150, sequence 1 falls from 150 to -150
    return (-150 + 300 * t / max(n - 1, 1)) * (1 if i % 2 == 0 else -1)


@LAB.check("tile", points=2, timeout_s=30.0)
def tile_rescales_when_the_max_grows(sub):
    # The hint names rescaling only when the output is what a missing rescale gives
    # (_unrescaled, among check_kernel's known mistakes): other mistakes fail here too.
    hint = (
        "here the scores grow from tile to tile, so the running max m_i rises at every tile; "
        "your output is not what leaving out the rescale of l_i or acc gives, so the mistake "
        "is elsewhere (the checks above test one rule each)"
    )
    check_kernel(sub, "tile", case([96, 70], 8, heads=4, seed=23, ramp=_rising), hint=hint)


@LAB.check("tile", points=2, timeout_s=30.0)
def tile_large_scores_stay_finite(sub):
    hint = (
        "scores here reach +-150, and exp overflows float32 past 88: m_new must be the larger "
        "of the old max m_i and this tile's max, and p = exp(s - m_new), so that every exp "
        "is of a number <= 0"
    )
    check_kernel(sub, "tile", case([64, 96], 16, seed=24, ramp=_steep), hint=hint)


@LAB.check("tile", points=2, timeout_s=60.0)
def tile_batches_with_splits_and_grouped_heads(sub):
    hint = "the batches run smallest first; the checks above test one rule each"
    # (context_lens, block_size, heads, kv_heads, num_splits), smallest first
    for lens, bs, heads, kv_heads, splits in (
        ([1], 1, 2, 1, 1),
        ([17, 3], 2, 4, 2, 1),
        ([33], 4, 2, 2, 2),
        ([70, 0, 9], 8, 4, 1, 3),
        ([64, 65], 16, 2, 2, 4),
    ):
        check_kernel(sub, "tile", case(lens, bs, heads, kv_heads, seed=25), splits, hint)


# --- the end of the loop ---------------------------------------------------------------------
@LAB.check("finish", points=1, timeout_s=30.0)
def finish_divides_once(sub):
    hint = "out = acc / l_i: acc is the sum of exp(s - m_i) * v, l_i the sum of exp(s - m_i)"
    check_kernel(sub, "finish", case([40, 7], 4, seed=26), hint=hint)


@LAB.check("finish", points=1, timeout_s=30.0)
def finish_empty_context_is_zeros(sub):
    hint = (
        "a split without keys has l_i = 0 and m_i = -inf: its out must be 0 (divide by 1 "
        "instead) and its lse -inf, or NaN spreads through the merge"
    )
    for splits in (1, 4):
        check_kernel(sub, "finish", case([0, 7], 4, seed=27), splits, hint)


@LAB.check("finish", points=2, timeout_s=30.0)
def finish_splits_merge_by_log_sum_exp(sub):
    hint = (
        "the merge weights split s by exp(lse_s - max lse), so lse must be the log of the "
        "split's sum of exp(score): m_i + log(l_i)"
    )
    for splits in (2, 3):
        # with 2 and 3 splits, the last split of the 33 tokens holds one: l_i is exactly 1
        check_kernel(sub, "finish", case([100, 40, 9, 33], 4, seed=28), splits, hint)
