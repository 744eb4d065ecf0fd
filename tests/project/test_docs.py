"""Every reference to the project's docs points at a file in ``docs/`` and, where it names one, at a
section that exists; nothing cites documents that are not in the repository."""
from __future__ import annotations

from harness.paths import ROOT
import re
from pathlib import Path

SOURCES = [p for d in ("src", "tests", "bench", "examples") for p in (ROOT / d).rglob("*")
           if p.suffix in (".py", ".md", ".sh")] + [ROOT / "README.md", ROOT / ".ci" / "run"]
REF = re.compile(r"docs/(\w+)\.md(?:,? sections? (\d+)(?:(?: to |-| and |, )(\d+))*)?")


def _sections(doc: Path) -> set[int]:
    return {int(m) for m in re.findall(r"^## (\d+)\.", doc.read_text(encoding="utf-8"), re.M)}


def test_doc_references_resolve():
    bad = []
    for src in SOURCES:
        text = src.read_text(encoding="utf-8", errors="replace")
        for m in REF.finditer(text):
            doc = ROOT / "docs" / f"{m.group(1)}.md"
            if not doc.is_file():
                bad.append(f"{src.relative_to(ROOT)}: {m.group(0)} (no such file)")
                continue
            wanted = {int(g) for g in m.groups()[1:] if g}
            missing = wanted - _sections(doc)
            if missing:
                bad.append(f"{src.relative_to(ROOT)}: {m.group(0)} (no section {sorted(missing)})")
    assert not bad, "\n".join(bad)


def test_no_references_to_documents_outside_the_repository():
    this = Path(__file__).resolve()
    hits = [f"{p.relative_to(ROOT)}" for p in SOURCES if p.resolve() != this
            and re.search(r"\b(SPEC|DESIGN|DESIGN-NOTES)\.md\b", p.read_text(encoding="utf-8", errors="replace"))]
    assert not hits, hits


PATH_REF = re.compile(r"`((?:src|tests|bench|docs)/[\w/.\-]*)`")


def test_paths_named_in_the_docs_exist():
    """Every backticked repository path in README.md and docs/ (``src/gpupool/pool.py``) exists
    (``bench/out/`` holds what the benchmarks write)."""
    bad = [f"{doc.relative_to(ROOT)}: {m.group(1)}"
           for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
           for m in PATH_REF.finditer(doc.read_text(encoding="utf-8")) if not m.group(1).startswith("bench/out/") and not (ROOT / m.group(1)).exists()]
    assert not bad, "\n".join(bad)


def test_install_instructions_work_from_a_clone():
    """gpupool is on no package index: every ``pip install`` that the README, docs/, error messages, skip
    reasons and scripts give installs it from the clone (``pip install -e '.[extra]'``) with extras that
    pyproject.toml defines, never ``pip install 'gpupool[vllm]'``."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"])
    this = Path(__file__).resolve()
    bad = []
    for p in SOURCES + sorted((ROOT / "docs").glob("*.md")):
        if p.resolve() == this:
            continue
        for m in re.finditer(r"pip3? install\b([^`\n&;|)]*)", p.read_text(encoding="utf-8", errors="replace")):
            args = m.group(1)
            if re.search(r"""(^|\s)['"]?gpupool\b""", args):
                bad.append(f"{p.relative_to(ROOT)}: pip install{args} (gpupool is on no package index)")
            for group in re.findall(r"""\.\[([\w,]+)\]""", args):
                unknown = set(group.split(",")) - extras
                if unknown:
                    bad.append(f"{p.relative_to(ROOT)}: pip install{args} (no extra {sorted(unknown)})")
    assert not bad, "\n".join(bad)
