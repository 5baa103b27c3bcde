"""The docs cite the project's own files or public sources, never a path outside the repository
(a reader of the published project has no `../shared` and no `/work`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "deploy").rglob("*.md")])
OUTSIDE = re.compile(r"(\.\./shared|/work/|shared/reference/)")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_doc_cites_a_path_outside_the_repository(path: Path) -> None:
    hits = [
        f"{path.name}:{i}: {line.strip()}"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert hits == []
