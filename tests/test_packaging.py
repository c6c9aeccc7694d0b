"""What `pip install` puts on a user's machine: the five packages, no benchmark code."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

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
