"""Imports only run down the layers (docs/architecture.md, "## Layers").

The layer table is the one in docs/architecture.md: its rows, lowest first, name the folders and modules
of ``parallel_layers/`` each layer holds. Every module of the package (and ``triton_kernels/``, installed as
``parallel_layers.triton_kernels``) is parsed with ``ast``: each ``import`` and ``from ... import`` at any
depth (module level, in a function, under ``TYPE_CHECKING``), relative ones resolved against the module's
package, ``from . import x`` to the submodule ``x`` when there is one, and ``importlib.import_module`` /
``__import__`` of a literal name. A module may import from its own layer and the ones before it; the test
fails naming each import that goes up (importer, imported, both layers), each import of ``benchmarks`` or
``tests`` (not part of the installed package), and each module the table does not place.
"""
from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "parallel_layers"
ARCHITECTURE = REPO / "docs" / "architecture.md"
# folders of the checkout that are not part of the installed package: nothing in it may import them
NOT_INSTALLED = ("benchmarks", "tests")
# Allowed upward imports, as (importer, imported) module names, each with the reason it cannot go. Empty: every
# upward import found so far was fixed by moving code to its layer (issue 47).
ALLOWED: List[Tuple[str, str]] = []

Table = List[Tuple[str, List[str]]]     # (layer, entries: "ops/" a folder, "mesh.py" a module, "_C" a name)


def layer_table(markdown: str) -> Table:
    """The rows of the first table of the ``## Layers`` section: each layer's name and its backquoted
    entries, lowest layer first."""
    start = markdown.index("\n## Layers\n")
    end = markdown.find("\n## ", start + 1)
    section = markdown[start:end if end != -1 else len(markdown)]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    table = []
    for line in rows[2:]:                    # header and |---| line
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        table.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    return table


def layer_of_key(table: Table) -> Dict[str, Tuple[int, str]]:
    """``{"ops": (0, "ops and kernels"), "mesh": (1, "distributed"), "__init__": ...}``: a folder, a module
    or a name directly under the package, to its layer's index and name."""
    out: Dict[str, Tuple[int, str]] = {}
    for index, (name, entries) in enumerate(table):
        for entry in entries:
            key = entry.rstrip("/")
            key = key[:-3] if key.endswith(".py") else key
            assert key not in out, f"the layer table names {entry} twice"
            out[key] = (index, name)
    return out


def source_modules(roots: Dict[str, Path]) -> Dict[str, Tuple[Path, bool]]:
    """``{dotted name: (file, is a package)}`` for every ``.py`` under each root (``{"parallel_layers":
    Path("parallel_layers"), ...}``)."""
    modules = {}
    for name, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = [name] + list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            modules[".".join(parts)] = (path, is_package)
    return modules


def imports_in(source: str, module: str, is_package: bool,
               known: Sequence[str]) -> Iterator[Tuple[str, int]]:
    """``(imported module, line)`` for each import in ``source``, at any depth. ``from X import y`` is the
    module ``X.y`` when ``known`` names it (a module, or a name the layer table places, as the compiled
    ``_C``), else ``X``."""
    known = set(known)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield (sub if sub in known else target), node.lineno
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__"):
                yield node.args[0].value, node.lineno


def layer_violations(modules: Dict[str, Tuple[Path, bool]], table: Table, package: str = PACKAGE,
                     allowed: Sequence[Tuple[str, str]] = ()) -> List[str]:
    """One line per import that goes up a layer, per import of a folder that is not installed, and per
    module of ``package`` the table does not place."""
    layers = layer_of_key(table)
    known = list(modules) + [f"{package}.{k}" for k in layers]

    def layer(name: str) -> Optional[Tuple[int, str]]:
        parts = name.split(".")
        return layers.get(parts[1] if len(parts) > 1 else "__init__")

    problems = []
    for module, (path, is_package) in sorted(modules.items()):
        own = layer(module)
        if own is None:
            problems.append(f"{module} ({path}): no row of the layer table names it")
            continue
        for imported, line in sorted(set(imports_in(path.read_text(), module, is_package, known)), key=lambda x: x[1]):
            top = imported.split(".")[0]
            where = f"{module}:{line}"
            if top in NOT_INSTALLED:
                problems.append(f"{where} imports {imported}, which is not part of the installed package")
            elif top == package and (module, imported) not in allowed:
                theirs = layer(imported)
                if theirs is None:
                    problems.append(f"{where} imports {imported}, which no row of the layer table names")
                elif theirs[0] > own[0]:
                    problems.append(f"{where} [{own[1]}] imports {imported} [{theirs[1]}]: up a layer")
    return problems


def package_modules() -> Dict[str, Tuple[Path, bool]]:
    return source_modules({PACKAGE: REPO / PACKAGE, f"{PACKAGE}.triton_kernels": REPO / "triton_kernels"})


def test_imports_only_run_down_the_layers():
    table = layer_table(ARCHITECTURE.read_text())
    assert len(table) >= 5, table
    problems = layer_violations(package_modules(), table, allowed=ALLOWED)
    assert not problems, "imports against docs/architecture.md's layer order:\n" + "\n".join(problems)


def test_every_table_entry_exists():
    """A row naming a folder or module that is gone would place nothing: each entry is on disk."""
    for name, entries in layer_table(ARCHITECTURE.read_text()):
        for entry in entries:
            if entry == "_C":           # the compiled extension: csrc/, built by setup.py or just in time
                assert (REPO / "csrc").is_dir()
            elif entry == "triton_kernels/":
                assert (REPO / "triton_kernels" / "__init__.py").is_file()
            else:
                assert (REPO / PACKAGE / entry).exists(), f"layer {name!r} names {entry}, which does not exist"


def test_kernels_import_nothing_of_the_library():
    """``triton_kernels/`` imports only torch, triton and itself (docs/architecture.md)."""
    problems = []
    for module, (path, is_package) in package_modules().items():
        if not module.startswith(f"{PACKAGE}.triton_kernels"):
            continue
        for imported, line in imports_in(path.read_text(), module, is_package, []):
            if imported.startswith(PACKAGE) and not imported.startswith(f"{PACKAGE}.triton_kernels"):
                problems.append(f"{module}:{line} imports {imported}")
    assert not problems, problems


def test_the_allowed_list_is_not_stale():
    """An allowed upward import that no longer exists must leave the list."""
    modules = package_modules()
    known = list(modules)
    found = {(m, imported) for m, (path, pkg) in modules.items()
             for imported, _ in imports_in(path.read_text(), m, pkg, known)}
    assert not [pair for pair in ALLOWED if pair not in found]


# ---- the checker itself: a fake package whose imports it must flag

FAKE_TABLE = """
## Layers

| layer | folders and modules | |
|---|---|---|
| low | `low/`, `util.py` | a |
| mid | `mid/` | b \\| c |
| top | `top/`, `__init__.py` | d |

## Next
"""


def _fake_package(tmp_path: Path, files: Dict[str, str]) -> Dict[str, Tuple[Path, bool]]:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return source_modules({"pkg": root})


def test_layer_table_is_read_in_order():
    assert layer_table(FAKE_TABLE) == [("low", ["low/", "util.py"]), ("mid", ["mid/"]),
                                       ("top", ["top/", "__init__.py"])]


def test_checker_flags_upward_imports_of_every_form(tmp_path):
    modules = _fake_package(tmp_path, {
        "__init__.py": "from .top import a\n",                        # top -> top: fine
        "util.py": "",
        "low/__init__.py": "from . import helper\n",                 # resolved to low.helper: fine
        "low/helper.py": """
            import os
            from ..mid import thing                                   # up, relative, module level

            def f():
                from pkg.top.a import x                               # up, absolute, in a function
                import pkg.mid.b                                      # up, plain import
                from .. import top                                    # up: the package pkg.top
                return importlib.import_module("pkg.mid.b")           # up, dynamic with a literal name
            """,
        "mid/__init__.py": "",
        "mid/b.py": """
            from ..low import helper                                  # down: fine
            from ..util import y                                      # down, a module: fine
            from .. import util                                       # down: fine
            from benchmarks import suite                              # not installed
            """,
        "top/__init__.py": "",
        "top/a.py": "from pkg import util\nfrom pkg.mid import b\n",   # down: fine
        "stray.py": "",                                               # in no row
    })
    problems = layer_violations(modules, layer_table(FAKE_TABLE), package="pkg")
    up = sorted(p.split(" imports ")[0] + " -> " + p.split(" imports ")[1].split(" ")[0]
                for p in problems if "up a layer" in p)
    assert up == ["pkg.low.helper:3 [low] -> pkg.mid", "pkg.low.helper:6 [low] -> pkg.top.a",
                  "pkg.low.helper:7 [low] -> pkg.mid.b", "pkg.low.helper:8 [low] -> pkg.top",
                  "pkg.low.helper:9 [low] -> pkg.mid.b"], problems
    assert any(p.startswith("pkg.mid.b:5 imports benchmarks") for p in problems), problems
    assert any(p.startswith("pkg.stray") and "no row" in p for p in problems), problems
    assert len(problems) == 7, problems


def test_allowed_exceptions_silence_only_their_pair(tmp_path):
    modules = _fake_package(tmp_path, {
        "__init__.py": "", "util.py": "", "mid/__init__.py": "", "top/__init__.py": "", "top/a.py": "",
        "low/__init__.py": "from ..mid import x\nfrom ..top import a\n"})
    table = layer_table(FAKE_TABLE)
    assert len(layer_violations(modules, table, package="pkg")) == 2
    left = layer_violations(modules, table, package="pkg", allowed=[("pkg.low", "pkg.mid")])
    assert len(left) == 1 and "pkg.top.a" in left[0], left
