"""The Dockerfile's promises (no Docker daemon here): non-root, slim, multi-stage, and a
build context that really contains what `pip install .` needs."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def stages() -> list[list[str]]:
    """Dockerfile instructions, grouped by FROM, continuation lines joined."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    result: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            result.append([])
        assert result, "instruction before the first FROM"
        result[-1].append(line)
    return result


def test_multi_stage_slim_non_root() -> None:
    build, runtime = stages()
    assert build[0].startswith("FROM python:3.11-slim AS ")
    assert runtime[0] == "FROM python:3.11-slim"
    assert "USER 65532:65532" in runtime
    # Nothing is compiled or installed in the runtime stage: it only copies the virtualenv.
    assert not any(line.upper().startswith("RUN ") for line in runtime)
    assert any(line.startswith("COPY --from=") for line in runtime)
    entry = next(line for line in runtime if line.startswith("ENTRYPOINT"))
    assert entry == 'ENTRYPOINT ["extproc"]'


def _context_files() -> list[Path]:
    patterns = [
        p.strip()
        for p in (REPO / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]

    def ignored(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(
            fnmatch.fnmatch(prefix, pattern)
            or fnmatch.fnmatch(parts[-1], pattern.removeprefix("**/"))
            for pattern in patterns
            for prefix in prefixes
        )

    files: list[Path] = []
    for root, dirs, names in os.walk(REPO):
        base = Path(root).relative_to(REPO).as_posix()
        prefix = "" if base == "." else base + "/"
        dirs[:] = [d for d in dirs if not ignored(prefix + d)]  # never descend into .venv
        files.extend(Path(root) / n for n in names if not ignored(prefix + n))
    return files


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_the_docker_build_context_builds_the_package(tmp_path: Path) -> None:
    context = tmp_path / "context"
    for path in _context_files():
        target = context / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    assert not (context / "tests").exists() and not (context / ".venv").exists()
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(context),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = wheels.glob("extproc_lb-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "extproc/cli.py" in names
    assert "extproc/discovery/kubernetes.py" in names
    assert "extproc/py.typed" in names
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names)
