"""The package's layers only point down (ARCHITECTURE.md): every import inside ``lookupdec/``,
function-level ones included, goes to the same layer or a lower one; the ``model`` package is the
one gate to ``transformers`` (the demo's training script aside); the package's face is lazy."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lookupdec")

# Bottom first. A module belongs to the entry with the longest matching prefix.
LAYERS = [
    ("base", ["lookupdec.tree", "lookupdec.tokens", "lookupdec.config", "lookupdec.version", "lookupdec.automaton",
              "lookupdec.stops", "lookupdec.workloads", "lookupdec.model_files", "lookupdec.validate", "lookupdec.demo",
              "lookupdec.cache_file"]),
    ("index", ["lookupdec.index"]),
    ("model", ["lookupdec.model", "lookupdec.sampling"]),
    ("proposers", ["lookupdec.proposers"]),
    ("engine", ["lookupdec.budget", "lookupdec.mixture", "lookupdec.step", "lookupdec.engine", "lookupdec.batch",
                "lookupdec.simulate"]),
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
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")].split(os.sep)
                out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    return out


def imports(path: str, modules: dict) -> set[str]:
    """Every module name imported anywhere in the file (``from lookupdec import model`` names
    the submodule ``lookupdec.model``)."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & set(modules)
            found.update(subs or {node.module})
            if subs and len(subs) < len(node.names):
                found.add(node.module)
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


def test_only_the_model_package_imports_transformers():
    modules = package_modules()
    importers = {m for m, path in modules.items()
                 if any(i == "transformers" or i.startswith("transformers.") for i in imports(path, modules))}
    assert importers <= TRANSFORMERS_GATES, importers - TRANSFORMERS_GATES


@pytest.mark.parametrize("module", ["lookupdec", "lookupdec.automaton", "lookupdec.config", "lookupdec.tree",
                                    "lookupdec.tokens", "lookupdec.workloads"])
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
