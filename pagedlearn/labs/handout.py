"""The student handout, made from the package's own source: the named bodies become stubs.

A lab names functions and methods (``"BlockAllocator.allocate"``). :func:`blank_source` parses
a reference file with ``ast`` and replaces each named body with::

    raise NotImplementedError("allocator: take n free blocks, all or nothing ...")

keeping the signature, the docstring and every other line of the file. Nothing in the package
marks the solutions: which bodies a lab blanks is said once, in the lab's definition. So the
handout is regenerated from whatever the package says today, and the package's own files are a
full-mark submission.

The lab notebooks hold the same code in *exercise cells* (:func:`exercise_cell`). A cell
defines only what the student writes, on top of the reference::

    class BlockAllocator(BlockAllocator):   # the reference, with these methods yours
        def allocate(self, n: int = 1) -> list[int]:
            ...

so it stays short, and it is generated from the same source (``python -m pagedlearn.labs.sync``
rewrites the cells; a test fails when they are stale).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from pagedlearn.labs.lab import Exercise, Lab

ROOT = Path(__file__).resolve().parents[2]  # the repository (or the installed tree) root


def reference_source(path: str) -> str:
    """The text of a reference file, ``path`` relative to the repository root."""
    return (ROOT / path).read_text()


def _find(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    """The ``def`` node of ``"func"`` or ``"Class.method"`` in ``tree``."""
    nodes: list[ast.stmt] = list(tree.body)
    *outer, name = qualname.split(".")
    for cls_name in outer:
        cls = next((n for n in nodes if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
        if cls is None:
            raise LookupError(f"no class {cls_name!r} for {qualname!r}")
        nodes = list(cls.body)
    for n in nodes:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
            return n
    raise LookupError(f"no function {qualname!r}")


def _body_lines(fn: ast.FunctionDef) -> tuple[int, int, int]:
    """``(first, last, indent)``: the 1-based line range of ``fn``'s body after its docstring,
    and the body's indentation."""
    body = fn.body
    has_doc = (
        isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )
    first = body[0].end_lineno + 1 if has_doc else body[0].lineno
    return first, fn.end_lineno, body[0].col_offset


def stub(lab_id: str, task: str, indent: int) -> str:
    message = f"{lab_id}: {task}"
    return " " * indent + f"raise NotImplementedError({message!r})\n"


def blank_source(source: str, targets: dict[str, str], lab_id: str) -> str:
    """``source`` with the body of each target replaced by a stub raising its task."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    spans = []
    for qualname, task in targets.items():
        first, last, indent = _body_lines(_find(tree, qualname))
        spans.append((first, last, stub(lab_id, task, indent)))
    for first, last, text in sorted(spans, reverse=True):  # bottom up: line numbers stay valid
        lines[first - 1 : last] = [text]
    return "".join(lines)


def is_stub(fn: ast.FunctionDef) -> bool:
    """Whether ``fn``'s body (after its docstring) is a lone ``raise NotImplementedError(...)``."""
    first, _, _ = _body_lines(fn)
    rest = [s for s in fn.body if s.lineno >= first]
    if len(rest) != 1 or not isinstance(rest[0], ast.Raise) or rest[0].exc is None:
        return False
    exc = rest[0].exc
    name = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(name, ast.Name) and name.id == "NotImplementedError"


def is_stub_function(fn) -> bool:
    """Whether the function ``fn`` (a method, or a ``@triton.jit`` function's ``.fn``) is a stub
    as blanked here; False when its source cannot be read."""
    import inspect

    try:
        source = textwrap.dedent(inspect.getsource(getattr(fn, "fn", fn)))
    except (OSError, TypeError):
        return False
    node = next((n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)), None)
    return node is not None and is_stub(node)


def lab_files(lab: Lab, blank: bool) -> dict[str, str]:
    """Each reference file of ``lab`` (by its name), blanked or as the package has it."""
    out = {}
    for path in lab.files:
        source = reference_source(path)
        if blank:
            targets = {
                q: t
                for ex in lab.exercises
                for q, t in ex.targets.items()
                if _defined_in(source, q)
            }
            source = blank_source(source, targets, lab.id)
        out[Path(path).name] = source
    return out


def _defined_in(source: str, qualname: str) -> bool:
    try:
        _find(ast.parse(source), qualname)
    except LookupError:
        return False
    return True


# --- exercise cells of the lab notebooks ----------------------------------------------------------
EXERCISE_TAG = "exercise"


def exercise_code(lab: Lab, exercise: Exercise, blank: bool) -> str:
    """The code of ``exercise``'s notebook cell: each target function, and for methods a
    subclass of the class as defined so far holding just those methods; then ``check(...)``."""
    sources = {p: reference_source(p) for p in lab.files}
    by_class: dict[str, list[str]] = {}
    functions: list[str] = []
    for qualname, task in exercise.targets.items():
        path = next((p for p, s in sources.items() if _defined_in(s, qualname)), None)
        if path is None:
            raise LookupError(f"lab {lab.id!r}: {qualname!r} is in none of {lab.files}")
        source = sources[path]
        if blank:
            source = blank_source(source, {qualname: task}, lab.id)
        fn = _find(ast.parse(source), qualname)
        start = fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno
        text = textwrap.dedent("".join(source.splitlines(keepends=True)[start - 1 : fn.end_lineno]))
        if "." in qualname:
            by_class.setdefault(qualname.split(".")[0], []).append(text)
        else:
            functions.append(text)
    header = f"# Exercise {exercise.id!r}: {exercise.title}"
    parts = [f.rstrip() + "\n" for f in functions]
    for cls, methods in by_class.items():
        body = "\n".join(textwrap.indent(m.rstrip() + "\n", "    ") for m in methods)
        parts.append(f"class {cls}({cls}):  # the class so far, with these methods yours\n{body}")
    parts[0] = f"{header}\n{parts[0]}"
    parts.append(f'check("{exercise.id}")')
    # Laid out as ruff formats it (two blank lines between definitions), so that the
    # committed notebooks pass `make lint` as generated.
    return "\n\n\n".join(p.rstrip("\n") for p in parts) + "\n"
