"""No module reaches into another module's private members.

A name with one leading underscore is its owner's business: the owner may rename or remove it without
looking elsewhere. This test keeps that promise true for the library, the benchmarks and the Triton
kernels. It collects every private name our own code defines (functions, classes, ``self._x =`` /
``cls._x =`` attributes, class-level and module-level names, private module files) and flags:

- ``<expr>._name`` where ``expr`` is not ``self``/``cls``/``super()``, ``_name`` is one of ours and the
  access sits in a file that does not define it (same file stands in for "same class or module");
- ``from <our module> import _name`` of a name defined in another file, and any import of a private
  module (``_backend.py``) from outside the package that holds it.

Torch, Triton and Hugging Face have privates of their own that we cannot avoid (``untyped_storage()._cdata``,
``Variable._execution_engine``, ...); those are reached through names we do not define, so they do not
show here. A private of theirs that happens to share its name with one of ours is a collision: it goes in
ALLOWED with the reason.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("parallel_layers", "benchmarks", "triton_kernels")
OURS = set(SCANNED)

# (file relative to the repository root, private name) -> why reaching it from that file is allowed.
ALLOWED: Dict[Tuple[str, str], str] = {
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _files(root: Path) -> List[Path]:
    return sorted(p for top in SCANNED if (root / top).is_dir() for p in (root / top).rglob("*.py"))


def _parts(root: Path, path: Path) -> List[str]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    # triton_kernels/ installs as parallel_layers.triton_kernels (setup.py's package_dir)
    return ["parallel_layers"] + parts if parts[0] == "triton_kernels" else parts


def _module_name(root: Path, path: Path) -> str:
    parts = _parts(root, path)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(root: Path, path: Path) -> str:
    """The package a file sits in (for __init__.py: the package it initialises)."""
    return ".".join(_parts(root, path)[:-1])


def _targets(node: ast.AST) -> Iterator[ast.AST]:
    if isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def _assigned(stmt: ast.stmt) -> Iterator[ast.AST]:
    if isinstance(stmt, ast.Assign):
        for target in stmt.targets:
            yield from _targets(target)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        yield stmt.target


def _is_self(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _survey(tree: ast.Module) -> Tuple[Set[str], List[ast.AST]]:
    """The private names this file defines, and the nodes that may reach another file's: ``x._name`` (x not
    self/cls/super()) and imports. One walk: the scan must stay fast."""
    names: Set[str] = set()
    uses: List[ast.AST] = []
    scopes = [tree.body]                                           # module-level and class-level names
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if _private(node.attr):
                if not _is_self(node.value):
                    uses.append(node)
                elif isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            uses.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if _private(node.name):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                scopes.append(node.body)
    for body in scopes:
        for stmt in body:
            for target in _assigned(stmt):
                if isinstance(target, ast.Name) and _private(target.id):
                    names.add(target.id)
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                names.update(a.asname for a in stmt.names if a.asname and _private(a.asname))
    return names, uses


def _resolve(root: Path, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from X import`` names ('' when it is not one of ours)."""
    if node.level == 0:
        module = node.module or ""
        return module if module.split(".")[0] in OURS else ""
    base = _package(root, path).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan(root: Path = ROOT, allowed: Dict[Tuple[str, str], str] = ALLOWED) -> List[Tuple[str, int, str, str]]:
    """Every reach as (file, line, what, private name), less those ``allowed`` lets through."""
    parsed = {p: ast.parse(p.read_text(), str(p)) for p in _files(root)}
    modules = {_module_name(root, p): p for p in parsed}
    for top in SCANNED:                                              # compiled extensions (_C) are modules too
        for binary in (root / top).rglob("*.so") if (root / top).is_dir() else ():
            modules[_module_name(root, binary.with_name(binary.name.split(".")[0] + ".py"))] = binary
    surveyed = {path: _survey(tree) for path, tree in parsed.items()}
    defined_in: Dict[str, Set[Path]] = {}
    for path, (names, _) in surveyed.items():
        for name in names:
            defined_in.setdefault(name, set()).add(path)
        if _private(path.stem):
            defined_in.setdefault(path.stem, set()).add(path)

    def private_module(dotted: str) -> str:
        """The package holding the first private module along ``dotted`` ('' when there is none)."""
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            if _private(part) and ".".join(parts[: i + 1]) in modules:
                return ".".join(parts[:i])
        return ""

    def reaches_private_module(path: Path, dotted: str) -> bool:
        holder = private_module(dotted)
        here = _module_name(root, path)
        return bool(holder) and not (here == holder or here.startswith(holder + "."))

    found = []
    for path, (_, uses) in surveyed.items():
        rel = path.relative_to(root).as_posix()

        def flag(line: int, what: str, name: str) -> None:
            if (rel, name) not in allowed:
                found.append((rel, line, what, name))

        for node in uses:
            if isinstance(node, ast.Attribute):
                owners = defined_in.get(node.attr)
                if owners and path not in owners:
                    flag(node.lineno, f"{ast.unparse(node.value)}.{node.attr}", node.attr)
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(root, path, node)
                if not source:
                    continue
                if reaches_private_module(path, source):
                    flag(node.lineno, f"from {source} import ...", source.rsplit(".", 1)[-1])
                    continue
                for alias in node.names:
                    if not _private(alias.name):
                        continue
                    what = f"from {source} import {alias.name}"
                    if f"{source}.{alias.name}" in modules:               # a private module of that package
                        if reaches_private_module(path, f"{source}.{alias.name}"):
                            flag(node.lineno, what, alias.name)
                    elif modules.get(source) != path:
                        flag(node.lineno, what, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in OURS and reaches_private_module(path, alias.name):
                        flag(node.lineno, f"import {alias.name}", alias.name.rsplit(".", 1)[-1])
    return sorted(found)


@functools.lru_cache(maxsize=None)
def _every_reach() -> Tuple[Tuple[str, int, str, str], ...]:
    """This checkout's reaches, the allowed ones included (scanned once for both tests)."""
    return tuple(scan(allowed={}))


def test_no_private_member_is_reached_from_another_module():
    found = [r for r in _every_reach() if (r[0], r[3]) not in ALLOWED]
    assert not found, "private members reached from outside their module:\n" + "\n".join(
        f"{rel}:{line}: {what}" for rel, line, what, _ in found)


def test_every_allowed_entry_is_still_needed():
    """An allowlist entry with nothing left to allow would silently let the next reach through."""
    reached = {(rel, name) for rel, _, _, name in _every_reach()}
    stale = sorted(set(ALLOWED) - reached)
    assert not stale, f"allowlist entries with nothing left to allow: {stale}"


def _write(root: Path, files: Dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_scan_flags_each_kind_of_reach(tmp_path):
    """A scan that finds nothing proves nothing: each kind of reach, planted, is found; each allowed use is not."""
    _write(tmp_path, {
        "parallel_layers/__init__.py": "",
        "parallel_layers/owner.py": (
            "import torch as _torch\n"
            "_limit = 3\n"
            "def _helper():\n    return _limit\n"
            "class Owner:\n    _shared = 1\n"
            "    def __init__(self):\n        self._state = {}\n"
            "    def merge(self, other):\n        return other._state\n"),      # same file: allowed
        "parallel_layers/ops/__init__.py": "from . import _backend\n",            # own package: allowed
        "parallel_layers/ops/_backend.py": "def pick():\n    return 1\n",
        "parallel_layers/ops/user.py": "from ._backend import pick\n",            # own package: allowed
        "parallel_layers/user.py": (
            "from .owner import Owner, _helper\n"                                  # line 1
            "from . import owner as o\n"
            "def f(x):\n"
            "    return x._state, o._limit, Owner._shared, x.grad._cdata\n"        # line 4; _cdata: not ours
            "from .ops import _backend\n"                                          # line 5
            "import parallel_layers.ops._backend\n"                                # line 6
            "from .ops._backend import pick\n"),                                   # line 7
        "benchmarks/bench.py": "from parallel_layers.owner import _torch\n",     # an alias is private too
    })
    found = {(rel, line, what) for rel, line, what, _ in scan(tmp_path, allowed={})}
    assert found == {
        ("benchmarks/bench.py", 1, "from parallel_layers.owner import _torch"),
        ("parallel_layers/user.py", 1, "from parallel_layers.owner import _helper"),
        ("parallel_layers/user.py", 4, "x._state"),
        ("parallel_layers/user.py", 4, "o._limit"),
        ("parallel_layers/user.py", 4, "Owner._shared"),
        ("parallel_layers/user.py", 5, "from parallel_layers.ops import _backend"),
        ("parallel_layers/user.py", 6, "import parallel_layers.ops._backend"),
        ("parallel_layers/user.py", 7, "from parallel_layers.ops._backend import ..."),
    }
    allowed = {("parallel_layers/user.py", "_state"): "test"}
    assert ("parallel_layers/user.py", 4, "x._state", "_state") not in scan(tmp_path, allowed=allowed)
