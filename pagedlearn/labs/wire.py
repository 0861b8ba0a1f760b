"""Values and exceptions on the line between the grader and the student's process (remote.py).

A request or an answer is one line of JSON. What it can carry is *data*: None, bools, numbers
(big ints and nan/inf tagged), str, bytes, lists, tuples, dicts and sets of those, and tensors
(dtype, shape and raw bytes; the dtype from an allow-list, the size checked against the shape).
Any other object the worker's side refers to by a handle number, and the grader's side makes a
proxy of it (remote.Remote). Decoding runs no code the other side chose: it builds only these
types, so a malicious answer can be a wrong value, never an action.

An exception crosses as its class name, the names in its MRO, its message (cut) and the line of
the student's code that raised it; the grader rebuilds it as its *own* class -- the first of the
MRO it knows (``NotImplementedError``, a ``PagedLearnError`` kind, a builtin), else a
:class:`StudentError` named like the student's -- so a check's ``except OutOfBlocksError`` works
on it, and nothing the student defined is ever instantiated here.
"""

from __future__ import annotations

import base64
import builtins
import math
import re
from typing import Any

MAX_TEXT = 500  # characters of a student's exception message or repr kept in a verdict
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
          "bool")  # fmt: skip


class WireError(ValueError):
    """A value on the wire the grader does not accept (remote.py turns it into WorkerGone)."""


class StudentError(Exception):
    """An exception the student's code raised, of a class the grader does not know."""


def cut(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- values on the wire ---------------------------------------------------------------------------
def is_tensor(v) -> bool:
    """A torch tensor, asked without importing torch (the grader may never need it)."""
    return type(v).__module__ == "torch" and type(v).__name__ == "Tensor"


def _tensor_to_wire(t) -> dict:
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch_uint8()).numpy().tobytes() if t.numel() else b""
    return {
        "t": [str(t.dtype).removeprefix("torch."), list(t.shape), base64.b64encode(raw).decode()]
    }


def torch_uint8():
    import torch

    return torch.uint8


def _tensor_from_wire(spec) -> Any:
    import torch

    dtype, shape, data = spec
    if dtype not in DTYPES or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise WireError(f"the worker sent a tensor the grader does not accept ({dtype}, {shape})")
    dt = getattr(torch, dtype)
    raw = base64.b64decode(data)
    n = math.prod(shape)
    if len(raw) != n * torch.empty((), dtype=dt).element_size():
        raise WireError("the worker sent a tensor whose bytes do not match its shape")
    if n == 0:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape).clone()


class Codec:
    """Turns values into JSON and back. ``handle(obj)`` gives an object a handle number and
    ``resolve(number)`` finds it again (the worker's side); ``remote(number, type)`` makes a
    proxy of one, and ``proxy`` is that proxy's class, sent back as its number (the grader's
    side). A side that passes none of them refuses objects."""

    def __init__(self, handle=None, resolve=None, remote=None, proxy: type | None = None):
        self.handle, self.resolve, self.remote, self.proxy = handle, resolve, remote, proxy

    def encode(self, v, depth: int = 0):
        if depth > 50:
            raise ValueError("a value nested more than 50 levels deep")
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return v if abs(v) < 2**53 else {"i": str(v)}
        if isinstance(v, float):
            return v if math.isfinite(v) else {"f": repr(v)}
        if isinstance(v, (bytes, bytearray)):
            return {"b": base64.b64encode(bytes(v)).decode()}
        enc = lambda xs: [self.encode(x, depth + 1) for x in xs]  # noqa: E731
        if type(v) is list:
            return enc(v)
        if type(v) is tuple or (isinstance(v, tuple) and not hasattr(v, "_fields")):
            return {"tu": enc(v)}  # a tuple subclass (ExtraKeys) crosses as its tuple
        if type(v) is dict:
            return {
                "d": [[self.encode(k, depth + 1), self.encode(x, depth + 1)] for k, x in v.items()]
            }
        if type(v) in (set, frozenset):
            return {"s": enc(sorted(v, key=repr)), "frozen": type(v) is frozenset}
        if type(v).__name__ in ("list_iterator", "tuple_iterator"):  # an argument walked once
            return {"it": enc(list(v))}
        if is_tensor(v):
            return _tensor_to_wire(v)
        if self.proxy is not None and isinstance(v, self.proxy):  # a handle going back
            return {"r": object.__getattribute__(v, "_h")}
        if self.handle is None:
            raise TypeError(f"a {type(v).__name__} cannot cross to the other process")
        return {"h": self.handle(v), "type": cut(type(v).__name__, 80)}

    def decode(self, v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [self.decode(x) for x in v]
        if not isinstance(v, dict) or len(v) == 0:
            raise WireError(f"an unknown value on the wire: {cut(repr(v), 80)}")
        if "i" in v:
            return int(v["i"])
        if "f" in v:
            return float(v["f"])
        if "b" in v:
            return base64.b64decode(v["b"])
        if "tu" in v:
            return tuple(self.decode(x) for x in v["tu"])
        if "d" in v:
            return {self.decode(k): self.decode(x) for k, x in v["d"]}
        if "s" in v:
            items = [self.decode(x) for x in v["s"]]
            return frozenset(items) if v.get("frozen") else set(items)
        if "it" in v:
            return iter([self.decode(x) for x in v["it"]])
        if "t" in v:
            return _tensor_from_wire(v["t"])
        if "r" in v and self.resolve is not None:
            return self.resolve(v["r"])
        if "h" in v and self.remote is not None:
            return self.remote(int(v["h"]), str(v.get("type", "?")))
        raise WireError(f"an unknown value on the wire: {cut(repr(v), 80)}")


# --- exceptions on the wire -----------------------------------------------------------------------
def exception_to_wire(e: BaseException) -> dict:
    from pagedlearn.labs.lab import student_line

    return {
        "type": cut(type(e).__name__, 80),
        "bases": [c.__name__ for c in type(e).__mro__][:20],
        "message": cut(str(e), 4 * MAX_TEXT),
        "where": cut(student_line(e), MAX_TEXT),
    }


def exception_from_wire(info: dict) -> BaseException:
    """The grader's own class for what the student raised (the first known one in its MRO)."""
    from pagedlearn import errors
    from pagedlearn.labs.lab import CheckFailed

    message = cut(str(info.get("message", "")), 4 * MAX_TEXT)
    bases = [str(b) for b in info.get("bases", [])]
    cls: type[BaseException] | None = None
    for name in bases:
        if name == "CheckFailed":  # an observation's own verdict: it can only fail a check
            cls = CheckFailed
        elif isinstance(getattr(errors, name, None), type) and issubclass(
            getattr(errors, name), Exception
        ):
            cls = getattr(errors, name)
        elif (
            name not in ("Exception", "BaseException", "object")
            and isinstance(getattr(builtins, name, None), type)
            and issubclass(getattr(builtins, name), Exception)
        ):
            cls = getattr(builtins, name)
        if cls is not None:
            break
    name = str(info.get("type", "Exception"))
    if cls is None:
        safe = re.sub(r"\W", "_", name)[:60] or "StudentError"
        cls = type(safe, (StudentError,), {})
    try:
        exc = cls(message)
    except Exception:  # a class whose constructor takes other arguments (OutOfBlocksError)
        exc = cls.__new__(cls)
        Exception.__init__(exc, message)
    exc.student_where = cut(str(info.get("where", "")), MAX_TEXT)  # see lab.student_line
    return exc
