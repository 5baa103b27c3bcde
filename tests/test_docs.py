"""The docs cite the project's own files or public sources, never a path outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# A path a reader of the repository cannot open: the workplace's, or a sibling checkout's.
OUTSIDE = re.compile(r"\.\./shared|/work/|\breference/[\w.-]+\.md|\b(?:routing|engine)\.md §")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_cites_nothing_outside_the_repository(doc: Path) -> None:
    hits = [
        f"{doc.name}:{n}: {line.strip()}"
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert hits == []
