"""How many wrong answers does each lab's grader catch? (Prints numbers; asserts nothing.)

Mutation testing with our own AST operator swaps: every function a lab asks students to write is
taken from the package and changed in one small way at a time -- a comparison flipped (``<`` ->
``<=``, ``==`` -> ``!=``, ``in`` -> ``not in``), an operator swapped (``+`` <-> ``-``, ``*`` <->
``//``, ``%`` -> ``//``), a constant moved by one or a boolean flipped, ``and`` <-> ``or``, a
condition negated, one statement dropped. Each such *mutant* is a plausible slip; it is graded
like a submission (every check, in this process, each under its time limit). A mutant is *killed*
when it loses at least one point.

    score = killed / mutants

Some mutants do not change behaviour (dropping a comment-like statement, ``<=`` where equality
never happens): no check can kill them, so 100% is not the goal. The survivors are printed, to
be read: each is either an equivalent mutant or a missing check.

Usage: python benchmarks/lab_mutation_score.py [LAB ...] [--limit N] [--survivors]
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from pagedlearn.labs import LAB_IDS, get
from pagedlearn.labs.handout import _find, reference_source
from pagedlearn.labs.runner import PASSED, run_check
from pagedlearn.labs.submission import SubmissionError, load
from pagedlearn.labs.worker import use_triton_interpreter_without_gpu

COMPARE_SWAPS = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
BINOP_SWAPS = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.FloorDiv: ast.Mult,
    ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv,
}


def mutations(fn: ast.FunctionDef) -> list[tuple[str, object]]:
    """``(description, apply)`` for each one-point change inside ``fn``'s body; ``apply(node)``
    changes the node found at the same walk position in a copy of the tree."""
    found = []
    body_nodes = [n for stmt in fn.body for n in ast.walk(stmt)]
    for i, node in enumerate(body_nodes):
        line = getattr(node, "lineno", fn.lineno)
        if isinstance(node, ast.Compare):
            for j, op in enumerate(node.ops):
                if type(op) in COMPARE_SWAPS:
                    found.append(
                        (
                            f"line {line}: {type(op).__name__} -> "
                            f"{COMPARE_SWAPS[type(op)].__name__}",
                            (i, "cmp", j),
                        )
                    )
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in BINOP_SWAPS:
            new = BINOP_SWAPS[type(node.op)].__name__
            found.append((f"line {line}: {type(node.op).__name__} -> {new}", (i, "binop", None)))
        elif isinstance(node, ast.BoolOp):
            found.append((f"line {line}: and <-> or", (i, "boolop", None)))
        elif isinstance(node, ast.Constant) and type(node.value) in (int, bool):
            if isinstance(node.value, bool):
                found.append((f"line {line}: {node.value} -> {not node.value}", (i, "const", 0)))
            else:
                for d in (1, -1):
                    found.append(
                        (f"line {line}: {node.value} -> {node.value + d}", (i, "const", d))
                    )
        elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
            found.append((f"line {line}: condition negated", (i, "negate", None)))
        if isinstance(node, ast.stmt) and not _is_docstring(node, fn):
            found.append((f"line {line}: statement dropped", (i, "drop", None)))
    return found


def _is_docstring(node, fn) -> bool:
    return (
        node is fn.body[0] and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    )


def apply(tree: ast.Module, qualname: str, where) -> ast.Module:
    tree = copy.deepcopy(tree)
    fn = _find(tree, qualname)
    i, kind, arg = where
    node = [n for stmt in fn.body for n in ast.walk(stmt)][i]
    if kind == "cmp":
        node.ops[arg] = COMPARE_SWAPS[type(node.ops[arg])]()
    elif kind == "binop":
        node.op = BINOP_SWAPS[type(node.op)]()
    elif kind == "boolop":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind == "const":
        node.value = (not node.value) if isinstance(node.value, bool) else node.value + arg
    elif kind == "negate":
        node.test = ast.UnaryOp(ast.Not(), node.test)
    elif kind == "drop":
        _replace_stmt(fn, node, ast.Pass())
    return ast.fix_missing_locations(tree)


def _replace_stmt(fn, old, new) -> None:
    for parent in ast.walk(fn):
        for name in ("body", "orelse", "finalbody", "handlers"):
            stmts = getattr(parent, name, None)
            if isinstance(stmts, list) and old in stmts:
                stmts[stmts.index(old)] = new
                return


def score_lab(lab_id: str, limit: int | None, seed: int, show: bool) -> tuple[int, int]:
    lab = get(lab_id)
    targets = [q for ex in lab.exercises for q in ex.targets]
    mutants = []
    for path in lab.files:
        tree = ast.parse(reference_source(path))
        for qualname in targets:
            try:
                fn = _find(tree, qualname)
            except LookupError:
                continue
            mutants += [(path, tree, qualname, d, w) for d, w in mutations(fn)]
    if limit is not None and len(mutants) > limit:
        mutants = random.Random(seed).sample(mutants, limit)
    killed, survivors = 0, []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # The unmutated reference, written the way every mutant is (ast.unparse), must get full
        # marks; otherwise every mutant would count as killed for nothing.
        files = [Path(tmp) / "ref" / Path(p).name for p in lab.files]
        files[0].parent.mkdir()
        for p, f in zip(lab.files, files, strict=True):
            f.write_text(ast.unparse(ast.parse(reference_source(p))))
        sub = load(lab, files)
        bad = [c.name for c in lab.checks if run_check(c, sub).status != PASSED]
        if bad:
            raise SystemExit(f"{lab_id}: the unparsed reference fails {bad}: fix that first")
        for k, (path, tree, qualname, desc, where) in enumerate(mutants):
            files = []
            for p in lab.files:
                out = Path(tmp) / f"m{k}" / Path(p).name
                out.parent.mkdir(exist_ok=True)
                src = ast.unparse(apply(tree, qualname, where)) if p == path else None
                out.write_text(src if src is not None else reference_source(p))
                files.append(out)
            try:
                sub = load(lab, files)
            except (SubmissionError, Exception):
                killed += 1  # does not even load: any grader rejects it
                continue
            lost = any(run_check(c, sub, min(c.timeout_s, 10)).status != PASSED for c in lab.checks)
            killed += lost
            if not lost:
                survivors.append(f"{qualname}: {desc}")
    seconds = time.perf_counter() - start
    n = len(mutants)
    print(f"{lab_id:<10} {killed:>4}/{n:<4} killed = {killed / max(n, 1):6.1%}   ({seconds:.0f} s)")
    if show:
        for s in survivors:
            print(f"    survived: {s}")
    sys.stdout.flush()
    return killed, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", default=list(LAB_IDS))
    parser.add_argument("--limit", type=int, default=None, help="at most N mutants per lab")
    parser.add_argument("--seed", type=int, default=0, help="which mutants --limit samples")
    parser.add_argument("--survivors", action="store_true", help="list the mutants not caught")
    args = parser.parse_args()
    use_triton_interpreter_without_gpu()  # as the grader does, before the kernel lab loads triton
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print("score = killed / mutants (one-point AST changes of each lab's target functions)")
    for lab_id in args.labs:
        score_lab(lab_id, args.limit, args.seed, args.survivors)


if __name__ == "__main__":
    main()
