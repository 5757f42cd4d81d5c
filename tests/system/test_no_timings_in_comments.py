"""No comment or docstring in the package quotes a measurement of some run.

A comment states the rule and its invariant ("the skinny product wins for few rows; above that
oneDNN does"); the timing that motivated it is one machine's on one day and goes stale with the
next kernel, torch or CPU. Such measurements belong in a design note
(docs/design/measurements-from-comments.md keeps those that were once in comments).

Scanned: every comment (``tokenize``) and every string statement (docstrings, ``ast``) of
``lookupdec/**/*.py``, and every ``//`` and ``/* */`` comment of ``csrc/**`` (the compiled core).
Flagged: a number with a time unit (``31.5 ms``, ``5 µs``, ``0.4 s``, ``2M appends/s``) or a
time in words ("half a second", "a few microseconds"), a speed ratio (``2.1x faster``,
``1.3x slower``, ``9% cheaper``), a machine name (Xeon, EPYC, H100, H200) and anything shaped
like a commit hash (7 to 40 lowercase hex digits with a digit and a letter). Units without a
number are fine: ``timeout_s``, ``forward_ms``, "the seconds of its trials"."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from repo_paths import REPO

ROOT = Path(REPO)
PACKAGE = ROOT / "lookupdec"
CSRC = ROOT / "csrc"

_NUM = r"(?<![\w.])\d+(?:[.,]\d+)*"
_PATTERNS = [
    # a number with a time unit: 31.5 ms, 5 µs, 0.4 s, 713 us, 30 ns, 2 seconds, 87.8 tokens/s
    ("timing", re.compile(_NUM + r"\s*(?:ms|µs|μs|us|ns)(?![\w/])")),
    ("timing", re.compile(_NUM + r"\s+s(?![\w/'])")),
    ("timing", re.compile(_NUM + r"\s*(?:sec|secs|seconds?|milliseconds?|microseconds?|nanoseconds?)\b")),
    ("timing", re.compile(_NUM + r"\s*[kKMG]?\s*[A-Za-z][\w-]*/s\b")),
    # ... or in words: about half a second, a few microseconds each
    ("timing", re.compile(r"\b(?:half an?|a few|a tenth of an?|a quarter of an?) "
                          r"(?:seconds?|milliseconds?|microseconds?|nanoseconds?)\b", re.I)),
    # a speed ratio: 2.1x faster, 1.3x slower, 3 times faster, 9-15% cheaper
    ("speed ratio", re.compile(_NUM + r"\s*(?:x|×|times)\s+(?:faster|slower|cheaper|quicker|dearer)\b", re.I)),
    ("speed ratio", re.compile(_NUM + r"\s*%\s+(?:faster|slower|cheaper|quicker|dearer)\b", re.I)),
    # the machine a number was measured on
    ("machine name", re.compile(r"(?<![A-Za-z])(?:xeon|epyc|h100|h200)(?![A-Za-z0-9])", re.I)),
    # a commit hash (a scratch run's revision)
    ("commit hash", re.compile(r"(?<![0-9A-Za-z])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z])")),
]


def offences(text: str) -> list[str]:
    """What ``text`` (one line of a comment or docstring) quotes, as ``kind: match`` each."""
    return [f"{kind}: {m.group(0).strip()}" for kind, pattern in _PATTERNS for m in pattern.finditer(text)]


def python_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string statement (docstrings) of a Python file."""
    source = path.read_text(encoding="utf-8")
    texts = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            texts += [(node.value.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
    return texts


def cpp_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every ``//`` and ``/* */`` comment of a C++ file (string and character
    literals skipped; raw strings are not used in csrc)."""
    source = path.read_text(encoding="utf-8")
    texts, i, line, n = [], 0, 1, len(source)
    while i < n:
        if source.startswith("//", i):
            end = source.find("\n", i)
            end = n if end < 0 else end
            texts.append((line, source[i:end]))
            i = end
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            end = n if end < 0 else end + 2
            texts += [(line + k, part) for k, part in enumerate(source[i:end].split("\n"))]
            line += source.count("\n", i, end)
            i = end
        elif source[i] in "\"'":
            quote, i = source[i], i + 1
            while i < n and source[i] != quote and source[i] != "\n":
                i += 2 if source[i] == "\\" else 1
            i += 1
        else:
            line += source[i] == "\n"
            i += 1
    return texts


def _sources() -> list[Path]:
    paths = [p for p in PACKAGE.rglob("*.py")]
    cpp = [p for p in CSRC.rglob("*") if p.is_file() and p.suffix in {".cpp", ".hpp", ".h", ".cc", ".inc"}]
    assert cpp, f"no C++ sources under {CSRC}"  # (a moved tree would otherwise pass unscanned)
    return sorted(paths + cpp)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _offenders(paths) -> list[str]:
    found = []
    for path in paths:
        texts = python_texts(path) if path.suffix == ".py" else cpp_texts(path)
        for line, text in sorted(texts):
            found += [f"{_rel(path)}:{line}: {what}" for what in offences(text)]
    return found


def test_scanner_finds_quotes_not_words():
    flagged = [
        "SmolLM2 at one thread: 129.7 and 174.1 ms a forward",
        "(a torch tensor's DLPack import cost 5 µs of a call's 8)",
        "405 against 713 us for 16 rows",
        "cost 0.15-0.45 s per bucket",
        "measured: ~2M appends/s",
        "one forward of each (about half a second at one thread)",
        "creating a numpy array costs a few microseconds each",
        "8 clients ran alike: 87.8 and 87.7 tokens/s",
        "attention 2.1-2.4x faster than the folded call",
        "kept sizes 9-15% cheaper than measured",
        "SmolLM2 on an AMD EPYC at 2 threads",
        "on an H200",
        "bench/results/server_batch_1t_426b7d2.json",
    ]
    for text in flagged:
        assert offences(text), text
    fine = [
        "timeout_s: the seconds a request may take; forward_ms and max_new_tokens are stats",
        "a finite number of seconds, at least 0",
        "int32 [n]; ids up to 2**31 - 1; 8 rows x 3 panels = 24 zmm accumulators",
        "the float32 matrix of chunks x dim; 0.5 MB at a 2000-token context",
        "``CostModel([1, 2, 4], [1.0, 1.1, 1.3])``; the seconds it took (0 once made)",
        "SHA-256 of the record; 16 hex digits; deadbeef; 1234567",
        "status 2; the 503s; 4 MiB",
    ]
    for text in fine:
        assert not offences(text), (text, offences(text))


def test_cpp_comments_skip_strings():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.cpp"
        path.write_text('const char* s = "// 5 ms"; // real\n/* a\n   b 3 ms */ int x;\n', encoding="utf-8")
        assert cpp_texts(path) == [(1, "// real"), (2, "/* a"), (3, "   b 3 ms */")]


def test_no_timings_in_comments():
    found = _offenders(_sources())
    assert not found, (
        "comments and docstrings quote measurements (state the rule instead; put the numbers in "
        "docs/design/):\n" + "\n".join(found)
    )
