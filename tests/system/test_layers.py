"""The package's layers only point down (docs/architecture.md): every import inside ``lookupdec/``,
function-level ones included, goes to the same layer or a lower one, and no modules import each
other round a cycle, within a layer either; no module uses another's private names (a leading
underscore); the ``model`` package is the one gate to ``transformers`` (the demo's training
script aside); the package's face is lazy."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from repo_paths import REPO

PACKAGE = os.path.join(REPO, "lookupdec")

# Bottom first. A module belongs to the entry with the longest matching prefix.
LAYERS = [
    # lookupdec.native hands out the compiled extension lookupdec._native (csrc/), which imports nothing;
    # lookupdec.reference holds the definition of every fast path, each module in (or below) the layer
    # of the production module that falls back on it: the tree's, the automaton's and the drafting's
    # need only numpy
    ("base", ["lookupdec.native", "lookupdec._native", "lookupdec.tree", "lookupdec.tokens", "lookupdec.config",
              "lookupdec.version", "lookupdec.automaton", "lookupdec.stops", "lookupdec.workloads",
              "lookupdec.model_files", "lookupdec.validate", "lookupdec.demo", "lookupdec.cache_file",
              "lookupdec.reference"]),
    ("index", ["lookupdec.index"]),
    ("model", ["lookupdec.model", "lookupdec.sampling", "lookupdec.reference.model", "lookupdec.reference.sampling"]),
    ("proposers", ["lookupdec.proposers"]),
    ("engine", ["lookupdec.budget", "lookupdec.cost_cache", "lookupdec.mixture", "lookupdec.step", "lookupdec.request",
                "lookupdec.engine", "lookupdec.batch", "lookupdec.simulate",
                # the kernels' forms, kept in the cost cache's file (cost_cache.py): above it
                "lookupdec.model.kernel_forms",
                "lookupdec.reference.budget", "lookupdec.reference.request"]),
    ("faces", ["lookupdec", "lookupdec.cli", "lookupdec.server", "lookupdec.pipelines", "lookupdec.demo.data",
               "lookupdec.demo.train"]),
]
TRANSFORMERS_GATES = {"lookupdec.model", "lookupdec.model.load", "lookupdec.model.target", "lookupdec.model.cache",
                      "lookupdec.model.lean",
                      "lookupdec.demo.train"}


def layer_of(module: str) -> tuple[int, str]:
    best = None
    for level, (name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), level, name)
    assert best is not None, f"{module}: in no layer of LAYERS"
    return best[1], best[2]


def package_modules() -> dict[str, str]:
    """module name -> file, for every .py file of the package."""
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                out[module_of(path)] = path
    return out


def parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def module_of(path: str) -> str:
    """The module name of a file of the package."""
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def imported_from(node: ast.ImportFrom, path: str) -> str:
    """The absolute module a ``from ... import`` statement of ``path`` imports from (relative
    ones resolved against the file's package)."""
    if not node.level:
        return node.module or ""
    parts = module_of(path).split(".")
    if not path.endswith("__init__.py"):
        parts = parts[:-1]  # a module's package
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports(path: str, modules: dict) -> set[str]:
    """Every module name imported anywhere in the file, function-level imports included
    (``from lookupdec import model`` names the submodule ``lookupdec.model``)."""
    found = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = imported_from(node, path)
            subs = {f"{module}.{alias.name}" for alias in node.names} & set(modules)
            found.update(subs or {module})
            if subs and len(subs) < len(node.names):
                found.add(module)
    return found


def test_every_import_points_down_or_sideways():
    modules = package_modules()
    upward = []
    for module, path in sorted(modules.items()):
        level, name = layer_of(module)
        for imported in sorted(imports(path, modules)):
            if imported == "lookupdec" or imported.startswith("lookupdec."):
                their_level, their_name = layer_of(imported)
                if their_level > level:
                    upward.append(f"{module} ({name}) imports {imported} ({their_name})")
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in the file; importing itself, as a
    package its own compiled submodule, is no edge). A package's ``__init__`` that a submodule's
    import runs first is no edge either: only the imports written count."""
    modules = package_modules()
    return {m: {i for i in imports(path, modules) if i in modules and i != m} for m, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's
    algorithm, iterative): each is a set of modules that import one another round a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, edges = work[-1]
            for child in edges:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "modules that import one another (break each cycle: move what both need " \
                      "into a module both import):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cycle_finder():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}, "f": {"g"}, "g": {"f"}}
    assert cycles(graph) == [["a", "b", "c"], ["f", "g"]]


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def own_private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines: its functions, classes, methods, assigned names and
    attributes (``self._x = ...``), import aliases."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.alias):
            out.add(node.asname or node.name.split(".")[0])
    return {name for name in out if private(name)}


def private_uses() -> set[tuple[str, str, str]]:
    """(module, private name, where) for each use in a module of a private name of another
    module of the package: ``from lookupdec.x import _name`` (or ``import lookupdec._native``),
    and ``obj._name`` where ``obj`` is not ``self``, ``cls`` or ``super()`` and another module of
    the package defines ``_name`` (whether this one does too: ``engine._room`` in a module with a
    ``_room`` of its own is still the engine's; a third-party private, ``tensor._version``, is
    not the package's business here)."""
    modules = package_modules()
    trees = {m: parse(path) for m, path in modules.items()}
    own = {m: own_private_names(tree) for m, tree in trees.items()}
    compiled = {os.path.basename(f).split(".")[0] for root, _, files in os.walk(PACKAGE) for f in files
                if f.endswith((".so", ".pyd"))}  # compiled modules (the core, lookupdec._native)
    found = set()
    for module, tree in trees.items():
        others = compiled.union(*(names for m, names in own.items() if m != module))
        for node in ast.walk(tree):
            where = f"{modules[module]}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom):
                source = imported_from(node, modules[module])
                if (source == "lookupdec" or source.startswith("lookupdec.")) and source != module:
                    found.update((module, a.name, where) for a in node.names if private(a.name))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    parts = a.name.split(".")
                    if parts[0] == "lookupdec":
                        found.update((module, p, where) for p in parts if private(p))
            elif isinstance(node, ast.Attribute) and private(node.attr):
                value = node.value
                if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                    continue
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                    continue
                if node.attr in others:
                    found.add((module, node.attr, where))
    return found


# Private names used outside the module that defines them: private name -> the modules using it.
# Each is here because the modules involved are not this change's to edit; an entry no module
# uses any more must go (the test below says when).
ALLOWED_PRIVATE = {
    # SuffixAutomaton's compiled automaton (automaton/__init__.py, ``self._core``), which the
    # suffix proposer hands to the compiled drafts and the fused plan. (The compiled core itself,
    # lookupdec._native, is reached only through lookupdec.native's public submodules.)
    "_core": {"lookupdec.proposers.suffix"},
    # Unchecked constructors of tree.py (TokenTree._from_core, Draft._trusted) and automaton's
    # token conversion, for the proposers' and the mixture's hot paths (values the compiled core
    # or the proposer built valid). To be public (``Draft.trusted``...) where tree.py and
    # automaton/__init__.py are edited.
    "_trusted": {"lookupdec.mixture", "lookupdec.proposers.ngram", "lookupdec.proposers.recycle",
                 "lookupdec.proposers.suffix"},
    "_from_core": {"lookupdec.mixture"},
    "_int32_tokens": {"lookupdec.proposers.ngram"},
    # TargetModel's internals (model/target.py) read by its batched twin (model/batch.py): the
    # two halves of one model wrapper, split by file for size.
    "_weights_state": {"lookupdec.model.batch"},
    "_head": {"lookupdec.model.batch"},
    "_gqa": {"lookupdec.model.batch"},
    "_project": {"lookupdec.model.batch"},
    "_RowsHead": {"lookupdec.model.batch"},
}


def test_no_private_names_across_modules():
    bad = sorted(f"{where}: {module} uses {name}" for module, name, where in private_uses()
                 if module not in ALLOWED_PRIVATE.get(name, ()))
    assert not bad, "private names of another module (make them public, or move what both need " \
                    "into a module both import):\n" + "\n".join(bad)


def test_allowed_private_names_still_used():
    used = {(module, name) for module, name, _ in private_uses()}
    stale = sorted(f"{module} no longer uses {name}" for name, users in ALLOWED_PRIVATE.items()
                   for module in users if (module, name) not in used)
    assert not stale, "remove from ALLOWED_PRIVATE:\n" + "\n".join(stale)


def test_only_lookupdec_native_imports_the_extension():
    """The compiled core is reached through ``lookupdec.native``, whose submodules each caller
    names (``from lookupdec.native import kernels as native_kernels``): no module but that one
    imports the extension ``lookupdec._native``."""
    modules = package_modules()
    importers = {m for m, path in modules.items() if "lookupdec._native" in imports(path, modules)}
    assert importers == {"lookupdec.native"}, importers


def test_only_the_model_package_imports_transformers():
    modules = package_modules()
    importers = {m for m, path in modules.items()
                 if any(i == "transformers" or i.startswith("transformers.") for i in imports(path, modules))}
    assert importers <= TRANSFORMERS_GATES, importers - TRANSFORMERS_GATES


@pytest.mark.parametrize("module", ["lookupdec", "lookupdec.native", "lookupdec.automaton", "lookupdec.config",
                                    "lookupdec.tree", "lookupdec.tokens", "lookupdec.workloads",
                                    "lookupdec.reference.drafting"])
def test_low_modules_import_without_torch(module):
    """The package's face is lazy: importing it (or a low layer) must not import torch."""
    code = f"import sys; sys.modules['torch'] = None; import {module}; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_lazy_face_still_hands_out_the_public_names():
    import lookupdec

    from lookupdec.engine import Engine

    assert lookupdec.Engine is Engine
    assert set(lookupdec.__all__) <= set(dir(lookupdec))
    with pytest.raises(AttributeError):
        lookupdec.NoSuchThing  # noqa: B018
