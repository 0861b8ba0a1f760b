"""Copies: the exercises a submission did not write itself, found by reading it (never running it).

The grader calls :func:`find_copies` on the submitted files, in the grading process, and gives
0 points to every check of an exercise it names, with its reason. A graded target (a function
or method a lab names) counts as the student's only when the submission defines it with its own
``def``. Three findings:

1. **not written**: the target comes from outside the submission -- imported
   (``from pagedlearn.core.kv_cache_manager import *``), assigned (``fork = KVCacheManager.fork``),
   or inherited from a class the submission did not write (``class KVCacheManager(KVCacheManager):
   pass`` in a notebook, whose first cell's ``start(...)`` put the reference's class there) -- or
   the student's ``def`` calls the reference's (``super().fork(...)``). Only when the submission
   imports this package (``pagedlearn``, ``kernels``): anything else cannot be the reference.
2. **loads code at run time**: ``exec``/``eval``/``compile`` of a non-literal, ``__import__``,
   ``importlib``, ``runpy``, ``sys.path``/``sys.modules``, or reading a file of the package.
   What that brings in cannot be known without running it, and a lab never needs it: every
   exercise is named.
3. **a copy**: the target's body (docstring dropped) is the reference's up to the names of its
   variables and arguments, the text of its strings and its layout (:func:`_canonical`). Only
   bodies of at least :data:`MIN_COPY_NODES` ast nodes are compared: below that an independent
   correct answer may well be the same (a one-line ``return`` of a rule the task spells out).

A stub (``raise NotImplementedError(...)``, as handed out) is neither: the checks score it 0
already, as "not implemented yet". Statically, a determined student can still hide a copy (add
dead code, reorder statements); what this catches is the copy that costs nothing.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass, field
from pathlib import Path

from pagedlearn.labs.handout import _find, is_stub, reference_source
from pagedlearn.labs.lab import Lab
from pagedlearn.labs.submission import SubmissionError, notebook_cells

PACKAGES = ("pagedlearn", "kernels")  # where the reference lives
# Smallest body (ast nodes, contexts not counted) compared with the reference's. The six labs'
# targets measure 9..456 (``python -m pagedlearn.labs.copies`` prints them); the 13 under 50 are
# never called copies: their tasks dictate the code (fork's steps in order, hash_block's exact
# serialisation, a 3-line _can_admit), so an honest answer may be the reference's, name for name.
MIN_COPY_NODES = 50
TAIL = "0 points for this exercise's checks"
COPY = "a copy of the reference's (identical up to names)"


# --- what a name is bound to ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Func:  # a ``def`` of the submission
    node: ast.FunctionDef | ast.AsyncFunctionDef
    module: str  # the submission file (a notebook's cells share one)


@dataclass(frozen=True)
class _Class:  # a ``class`` of the submission: its own members, then its bases'
    bases: tuple
    members: dict
    module: str


@dataclass(frozen=True)
class _Outside:  # anything the submission did not write: an import, an assignment, ...
    why: str  # completes "X is not written in the submission (...)"
    name: str = ""  # the imported name, when it is one


@dataclass
class _Env:
    """A namespace as the statements run: ``names``, and after ``from m import *`` (or a call
    handed ``globals()``) every other name is ``default``."""

    names: dict = field(default_factory=dict)
    default: str | None = None  # a ``why`` with {name} in it

    def get(self, name: str):
        if name in self.names:
            return self.names[name]
        return _Outside(self.default.format(name=name), name) if self.default else None

    def copy(self) -> _Env:
        return _Env(dict(self.names), self.default)


def _merge(alternatives: list[_Env]) -> _Env:
    """After an ``if``/``try``/loop: a name is the reference's if any path makes it so."""
    out = _Env(default=next((a.default for a in alternatives if a.default), None))
    for name in {n for a in alternatives for n in a.names}:
        seen = [a.get(name) for a in alternatives]
        outside = [b for b in seen if isinstance(b, _Outside)]
        out.names[name] = outside[0] if outside else [b for b in seen if b is not None][-1]
    return out


class _Reader:
    """Runs a file's (or a notebook's) statements symbolically, binding names to what they are."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.imports: list[str] = []  # "pagedlearn.core.kv_cache_manager", ...
        self.dynamic: list[str] = []  # "importlib.util.find_spec at cow.py, line 3", ...

    def block(self, stmts: list[ast.stmt], env: _Env, where: str) -> _Env:
        for s in stmts:
            env = self.stmt(s, env, where)
        return env

    def stmt(self, s: ast.stmt, env: _Env, where: str) -> _Env:
        at = f"{where}, line {s.lineno}"
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            env.names[s.name] = _Func(s, self.module)
        elif isinstance(s, ast.ClassDef):
            bases = tuple(_value(b, env, at) for b in s.bases)
            members = self.block(s.body, _Env(), where).names
            env.names[s.name] = _Class(bases, members, self.module)
        elif isinstance(s, ast.Import):
            for a in s.names:
                self._imported(a.name)
                name = a.asname or a.name.split(".")[0]
                env.names[name] = _Outside(f"it imports {a.name}", name)
        elif isinstance(s, ast.ImportFrom):
            module = "." * s.level + (s.module or "")
            self._imported(module if not s.level else "")
            for a in s.names:
                if a.name == "*":
                    env = _Env(default=f"it imports * from {module}")
                else:
                    why = f"it imports {a.name} from {module}"
                    env.names[a.asname or a.name] = _Outside(why, a.name)
        elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            value = _value(s.value, env, at) if s.value is not None else None
            if isinstance(s.value, ast.Call):  # check = start("cow", globals())
                self._call(s.value, env, at)
            for t in targets:
                self._assign(t, value, env, at)
        elif isinstance(s, ast.Delete):
            for t in s.targets:
                if isinstance(t, ast.Name):
                    env.names.pop(t.id, None)
        elif isinstance(s, ast.Expr) and isinstance(s.value, ast.Call):
            self._call(s.value, env, at)
        elif isinstance(s, ast.If) and isinstance(s.test, ast.Constant):
            env = self.block(s.body if s.test.value else s.orelse, env, where)
        elif isinstance(s, ast.If):
            env = _merge([self.block(b, env.copy(), where) for b in (s.body, s.orelse)])
        elif isinstance(s, (ast.For, ast.AsyncFor, ast.While)):
            env = _merge([env, self.block(s.body + s.orelse, env.copy(), where)])
        elif isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
            paths = [self.block(s.body + s.orelse, env.copy(), where)]
            paths += [self.block(h.body, env.copy(), where) for h in s.handlers]
            env = self.block(s.finalbody, _merge(paths), where)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            env = self.block(s.body, env, where)
        elif isinstance(s, ast.Match):
            env = _merge([env] + [self.block(c.body, env.copy(), where) for c in s.cases])
        return env

    def _imported(self, module: str) -> None:
        if module.split(".")[0] in PACKAGES:
            self.imports.append(module)

    def _assign(self, target: ast.expr, value, env: _Env, at: str) -> None:
        if isinstance(target, ast.Name):
            env.names[target.id] = value or _Outside(f"{target.id} is assigned at {at}")
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._assign(t, None, env, at)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            self._set_member(target.value.id, target.attr, env, at)

    def _set_member(self, cls_name: str, member: str, env: _Env, at: str) -> None:
        cls = env.names.get(cls_name)
        if isinstance(cls, _Class):
            why = f"{cls_name}.{member} is assigned at {at}"
            env.names[cls_name] = _Class(
                cls.bases, {**cls.members, member: _Outside(why)}, cls.module
            )

    def _call(self, call: ast.Call, env: _Env, at: str) -> None:
        name = _dotted(call.func)
        if name == "setattr" and len(call.args) >= 2 and isinstance(call.args[0], ast.Name):
            attr = call.args[1]
            member = attr.value if isinstance(attr, ast.Constant) else "*"
            self._set_member(call.args[0].id, str(member), env, at)
        if any(_dotted(n) in ("globals", "vars", "locals") for n in ast.walk(call)):
            # start("cow", globals()) in a lab notebook's first cell: the reference's names.
            env.names.clear()
            env.default = (
                f"{{name}} is the reference's, put there by {name or 'a call'}(...) at {at}"
            )


def _dotted(node: ast.AST) -> str:
    """``"a.b.c"`` for a name or an attribute chain, ``"f"`` for ``f()``; else ``""``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        root = _dotted(node.value)
        return f"{root}.{node.attr}" if root else ""
    return _dotted(node.func) if isinstance(node, ast.Call) else ""


def _value(node: ast.expr, env: _Env, at: str):
    """What an expression is bound to: a name's binding, else something not written here."""
    if isinstance(node, ast.Name):
        return env.get(node.id)
    return _Outside(f"{ast.unparse(node)[:60]} at {at} is not written in it")


# --- code loaded at run time ----------------------------------------------------------------------
CODE_CALLS = {"exec", "eval", "compile", "execfile"}  # of a string literal: harmless
DYNAMIC_ATTRS = {"__import__", "reload", "import_module", "find_spec", "spec_from_file_location",
                 "module_from_spec", "exec_module", "load_module", "SourceFileLoader",
                 "run_module", "run_path"}  # fmt: skip
DYNAMIC_MODULES = {"importlib", "runpy", "imp", "pkgutil", "zipimport", "builtins", "marshal"}
READS = {"open", "read_text", "read_bytes", "getsource", "getsourcelines"}


def _dynamic(tree: ast.AST, where: str) -> list[str]:
    """Each way ``tree`` loads code at run time, as ``"<what> at <where>, line N"``."""
    found = []
    for node in ast.walk(tree):
        what = ""
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            last = name.rsplit(".", 1)[-1] if name else getattr(node.func, "attr", "")
            literal = node.args and isinstance(node.args[0], ast.Constant)
            if (name in CODE_CALLS and not literal) or last in DYNAMIC_ATTRS:
                what = name or last
            elif last in READS and _mentions_package(node):
                what = f"{last} of the package's files"
        elif isinstance(node, ast.Attribute) and _dotted(node) in (
            "sys.path", "sys.modules", "sys.meta_path", "sys.path_hooks"
        ):  # fmt: skip
            what = _dotted(node)
        elif isinstance(node, ast.Name) and node.id in ("__builtins__", "__loader__", "__spec__"):
            what = node.id
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            )
            what = next((m for m in modules if (m or "").split(".")[0] in DYNAMIC_MODULES), "")
            what = f"import {what}" if what else ""
        if what:
            found.append(f"{what} at {where}, line {node.lineno}")
    return found


def _mentions_package(node: ast.AST) -> bool:
    words = [getattr(n, a, "") for n in ast.walk(node) for a in ("id", "attr", "value")]
    return any(isinstance(w, str) and p in w for w in words for p in PACKAGES)


# --- bodies compared with the reference's --------------------------------------------------------
class _Canon(ast.NodeTransformer):
    """Names become ``v0, v1, ...`` in order of first appearance; strings become ``""``;
    docstrings, annotations and string statements go. Attribute names stay (the API)."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}

    def _id(self, name: str) -> str:
        return self.ids.setdefault(name, f"v{len(self.ids)}")

    def visit_Name(self, node: ast.Name) -> ast.Name:
        node.id = self._id(node.id)
        return node

    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.arg, node.annotation = self._id(node.arg), None
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        return ast.Constant("") if isinstance(node.value, str) else node

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.Constant:
        return ast.Constant("")

    def visit_Expr(self, node: ast.Expr):
        is_text = isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        return None if is_text else self.generic_visit(node)


def _canonical(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, int]:
    """``(dump, size)`` of ``fn``'s body, normalised by :class:`_Canon`; size counts nodes."""
    body = _Canon().visit(ast.Module(body=copy.deepcopy(fn.body), type_ignores=[]))
    size = sum(not isinstance(n, ast.expr_context) for n in ast.walk(body)) - 1
    return ast.dump(body), size


def reference_bodies(lab: Lab) -> dict[str, tuple[str, int]]:
    """Each target of ``lab``: the canonical dump and size of the reference's body."""
    trees = [ast.parse(reference_source(p)) for p in lab.files]
    out = {}
    for ex in lab.exercises:
        for qualname in ex.targets:
            for tree in trees:
                try:
                    out[qualname] = _canonical(_find(tree, qualname))
                except LookupError:
                    continue
                break
    return out


# --- the verdict ----------------------------------------------------------------------------------
def find_copies(lab: Lab, paths: list[str | Path]) -> dict[str, str]:
    """``{exercise id: reason}`` for each exercise of ``lab`` whose targets ``paths`` (the
    submission: ``.py`` files or one lab notebook) did not write itself (module docstring). A
    file that cannot be read or parsed is skipped: loading the submission reports it."""
    env, readers, modules = _Env(), [], {}
    for path in map(Path, paths):
        reader = _Reader(str(path))
        try:
            if path.suffix == ".ipynb":
                units = [(name, ast.parse(src)) for name, src, _ in notebook_cells(path)]
            else:
                units = [(path.name, ast.parse(path.read_text()))]
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError, SubmissionError):
            continue
        module_env = _Env()  # a .py file is a module of its own; a notebook's cells share one
        for where, tree in units:
            module_env = reader.block(tree.body, module_env, where)
            reader.dynamic += _dynamic(tree, where)
        readers.append(reader)
        modules[reader.module] = module_env
        env = _merge_into(env, module_env)  # the loader merges the files' names, later ones win
    dynamic = [d for r in readers for d in r.dynamic]
    imports = [m for r in readers for m in r.imports]
    references = reference_bodies(lab)
    lab_targets = {q.split(".")[-1] for ex in lab.exercises for q in ex.targets}
    out = {}
    for ex in lab.exercises:
        problems = []
        if dynamic:
            names = " and ".join(ex.targets)
            out[ex.id] = (
                f"exercise {ex.id!r}: the submission loads code at run time ({dynamic[0]}), "
                f"which can bring in the reference's {names}: write your own, without it -- {TAIL}"
            )
            continue
        by_finding: dict[str, list[str]] = {}  # one finding, the targets it is true of
        for qualname in ex.targets:
            problem = _judge(qualname, env, lab_targets, modules, references.get(qualname))
            if problem and (imports or problem == COPY):
                by_finding.setdefault(problem, []).append(qualname)
        for finding, names in by_finding.items():
            if len(names) == 1:
                problems.append(f"{names[0]} is {finding}")
            else:  # "A, B and C are copies of the reference's ..."
                finding = finding.replace("a copy of", "copies of")
                problems.append(f"{', '.join(names[:-1])} and {names[-1]} are {finding}")
        if problems:
            tail = TAIL if list(by_finding) == [COPY] else f"write your own -- {TAIL}"
            out[ex.id] = f"exercise {ex.id!r}: {'; '.join(problems)}: {tail}"
    return out


def _merge_into(env: _Env, module_env: _Env) -> _Env:
    if module_env.default:  # a star import: every name may be replaced
        return _Env(dict(module_env.names), module_env.default)
    return _Env({**env.names, **module_env.names}, env.default)


def _judge(qualname: str, env: _Env, lab_targets: set[str], modules: dict, reference) -> str | None:
    """What is wrong with the submission's ``qualname`` (a finding: "not written ...", or
    COPY), or None when it is the student's, absent or a stub."""
    *owner, name = qualname.split(".")
    found, cls = _resolve(env.get(owner[0]), name) if owner else (env.get(name), None)
    if isinstance(found, _Outside):
        return f"not written in the submission ({found.why})"
    if not isinstance(found, _Func) or is_stub(found.node):
        return None
    borrowed = _borrowed(found, cls, lab_targets, modules[found.module])
    if borrowed:
        return f"not written in the submission (it calls the reference's: {borrowed})"
    if reference is not None:
        dump, size = _canonical(found.node)
        if size >= MIN_COPY_NODES and dump == reference[0]:
            return COPY
    return None


def _resolve(binding, member: str) -> tuple:
    """``(member's binding, the class holding it)``: a class's own, else its bases' in order."""
    if isinstance(binding, _Outside):
        return _Outside(binding.why), None
    if not isinstance(binding, _Class):
        return None, None
    if member in binding.members or "*" in binding.members:  # "*": setattr(C, <unknown>, ...)
        own = binding.members.get(member)
        return (own if isinstance(own, _Outside) else binding.members.get("*", own)), binding
    for base in binding.bases:
        found, cls = _resolve(base, member)
        if found is not None:
            return found, cls
    return None, None


def _borrowed(fn: _Func, cls: _Class | None, lab_targets: set[str], env: _Env) -> str:
    """A call in ``fn``'s body to the reference's version of a graded target (``super().fork``,
    ``Reference.fork``, an imported ``hash_block``), as ``"<code> at line N"``; else ``""``."""
    local = {a.arg for a in ast.walk(fn.node.args) if isinstance(a, ast.arg)}
    local |= {n.id for n in ast.walk(fn.node) if isinstance(n, ast.Name)
              and isinstance(n.ctx, ast.Store)}  # fmt: skip
    for node in ast.walk(ast.Module(body=fn.node.body, type_ignores=[])):
        source = None
        if isinstance(node, ast.Attribute) and node.attr in lab_targets:
            root = node.value
            if isinstance(root, ast.Call) and _dotted(root.func) == "super" and cls is not None:
                source = next((b for b in cls.bases if _resolve(b, node.attr)[0]), None)
                source = _resolve(source, node.attr)[0]
            elif isinstance(root, (ast.Name, ast.Attribute)) and _root(root) not in local:
                base = env.get(_root(root))
                source = base if isinstance(base, _Outside) else _resolve(base, node.attr)[0]
        elif isinstance(node, ast.Name) and node.id not in local:
            binding = env.get(node.id)
            if isinstance(binding, _Outside) and (binding.name or node.id) in lab_targets:
                source = binding
        if isinstance(source, _Outside):
            return f"{ast.unparse(node)} at line {node.lineno}"
    return ""


def _root(node: ast.expr) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def _sizes() -> None:
    """Print every target's body size, smallest first (how MIN_COPY_NODES was chosen)."""
    from pagedlearn.labs import all_labs

    rows = [
        (size, lab.id, q) for lab in all_labs() for q, (_, size) in reference_bodies(lab).items()
    ]
    for size, lab_id, qualname in sorted(rows):
        mark = "never flagged" if size < MIN_COPY_NODES else ""
        print(f"{size:5d}  {lab_id:10s} {qualname:40s} {mark}")


if __name__ == "__main__":
    _sizes()


__all__ = ["MIN_COPY_NODES", "find_copies", "reference_bodies"]
