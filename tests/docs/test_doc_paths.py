"""Every path the README, deploy/README.md and docs/ name exists, and every test they cite is defined.

A path is a link target (from the doc's folder), or a backticked word with a `/` in it whose first part exists under
one of the folders paths are written from (the repository, the doc's own folder, a package's folder), so `org/Model`
or `10.0.0.0/16` are not taken for paths while a path that lost its file is; `{a,b}` alternatives are expanded and
globs must match.
A test is cited as `file.py::test_name` (the file by its path, or by its name alone where the doc already said where
it lives); `...` ends a prefix of the name.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
# Folders docs write paths from besides the repository and their own: the packages and the deploy tree.
BASES = ("kvsidecar", "contract", "client", "client/kvsidecar_client", "benchmarks", "deploy", "deploy/kubernetes")
MADE_BY_SETUP = (".venv",)  # scripts/setup.sh makes it; a fresh clone has none

_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_TEST = re.compile(r"(?:^|/)(test_\w+\.py)::(test_\w+)(\.\.\.)?")


def _expand(text: str) -> list[str]:
    """`a/{b,c}.py` -> `a/b.py`, `a/c.py`."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", text)
    if not m:
        return [text]
    return [x for alt in m.group(1).split(",") for x in _expand(text[: m.start()] + alt + text[m.end() :])]


def _words(doc: Path) -> list[str]:
    """Backticked words, as written."""
    return [w.strip("(),;:'\"") for span in _SPAN.findall(doc.read_text()) for w in span.split()]


def _links(doc: Path) -> list[str]:
    """Link targets within the repository, anchors dropped."""
    return [link.split("#")[0] for link in _LINK.findall(doc.read_text()) if not re.match(r"[a-z]+:|#", link)]


def _bases(doc: Path) -> list[Path]:
    return [ROOT, doc.parent, *(ROOT / b for b in BASES)]


def repository_paths(doc: Path) -> list[tuple[str, Path | None]]:
    """(path as written, where it resolves or None) for every repository path the doc names."""
    out: list[tuple[str, Path | None]] = [
        (link, (doc.parent / link).resolve() if (doc.parent / link).exists() else None) for link in _links(doc)
    ]
    for word in _words(doc):
        path = re.sub(r"(::|:\d).*$|\[[\w,]+\]$", "", word).rstrip("/")  # a test, a line, pip's extras
        if "/" not in path or path.startswith(("/", "~", *MADE_BY_SETUP)) or path.startswith("../.venv"):
            continue  # a system path (/dev/shm, /run/kvsidecar), or what setup makes
        for one in _expand(path):
            first = one.split("/")[0]
            bases = [b for b in _bases(doc) if first in ("..", ".") or (b / first).exists()]
            if not bases:
                continue  # not a path of this repository: a model name, a network, a placeholder
            found = [p for b in bases for p in ([*b.glob(one)] if "*" in one else [b / one]) if p.exists()]
            out.append((one, found[0].resolve() if found else None))
    return out


def cited_tests(doc: Path) -> list[tuple[str, str, bool]]:
    """(test file name or path, test name, whether the name is a prefix) for every test the doc cites."""
    out = []
    for word in _words(doc):
        m = _TEST.search(word)
        if m:
            path = word[: word.index("::")]
            out.append((path, m.group(2), bool(m.group(3))))
    return out


def _test_files(name: str) -> list[Path]:
    if "/" in name:
        return [ROOT / name] if (ROOT / name).exists() else []
    return [p for folder in ("tests", "benchmarks/tests") for p in (ROOT / folder).rglob(name)]


def test_every_path_the_docs_name_exists():
    named = [(doc, path, found) for doc in DOCS for path, found in repository_paths(doc)]
    assert len(named) > 200, f"only {len(named)} paths found: the pattern no longer finds the docs' paths"
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc, path, found in named if found is None]
    assert not missing, "\n".join(missing)


def test_every_test_the_docs_cite_is_defined():
    cited = [(doc, *test) for doc in DOCS for test in cited_tests(doc)]
    assert len(cited) > 50, f"only {len(cited)} tests found: the pattern no longer finds the docs' citations"
    undefined = []
    for doc, file, name, prefix in cited:
        pattern = rf"^\s*(?:async )?def {name}" + ("" if prefix else r"\b")
        if not any(re.search(pattern, f.read_text(), re.MULTILINE) for f in _test_files(file)):
            undefined.append(f"{doc.relative_to(ROOT)}: {file}::{name}{'...' if prefix else ''}")
    assert not undefined, "\n".join(undefined)


def test_the_pattern_finds_a_missing_path_and_passes_over_what_is_no_path(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "`kvsidecar/metrics.py` and `tests/unit/{daemon,client}/` exist, `kvsidecar/ssd.py` does not; "
        "`org/Model`, `10.0.0.0/16` and `DIR/kvsidecar.lock` are no paths; [link](missing.md#anchor)\n"
    )
    found = dict(repository_paths(doc))
    assert found.keys() == {"kvsidecar/metrics.py", "tests/unit/daemon", "tests/unit/client", "kvsidecar/ssd.py",
                            "missing.md"}  # fmt: skip
    assert {p for p, where in found.items() if where is None} == {"kvsidecar/ssd.py", "missing.md"}
