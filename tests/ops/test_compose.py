"""compose.yaml, its GPU override and ops/Dockerfile agree with the code they run.

No container runs here (CI has no Docker daemon); these checks catch what would break the stack
silently: an engine command the CLI no longer accepts, services that do not point at each other,
a package folder the image does not copy.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from pensieve.ops.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / name).read_text())


def _command(service: dict[str, Any]) -> list[str]:
    """The service's command with `${VAR:-default}` replaced by its default."""
    command = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", service["command"])
    return shlex.split(command)


def _ports(service: dict[str, Any]) -> set[int]:
    return {int(p.split(":")[-1]) for p in service.get("ports", [])}


@pytest.mark.parametrize("files", [["compose.yaml"], ["compose.yaml", "ops/compose.gpu.yaml"]])
def test_the_engine_command_is_one_the_cli_accepts(files: list[str]) -> None:
    engine: dict[str, Any] = {}
    for name in files:  # an override replaces the keys it names
        engine.update(_load(name)["services"]["engine"])
    args = build_parser().parse_args(_command(engine))
    assert args.run.__name__ == "_serve"
    assert args.trace == "otlp" and str(args.data_dir) == "/data"
    assert args.device == ("cuda" if len(files) == 2 else "cpu")


def test_the_services_point_at_each_other() -> None:
    services = _load("compose.yaml")["services"]
    engine = services["engine"]
    args = build_parser().parse_args(_command(engine))
    host, port = args.nats_url.removeprefix("nats://").split(":")
    assert host in services and int(port) in _ports(services[host])
    collector = engine["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    host, port = collector.removeprefix("http://").split(":")
    assert host in services and int(port) in _ports(services[host])
    assert set(engine["depends_on"]) == {"nats", "jaeger"}
    assert any(v.endswith(":/data") for v in engine["volumes"])  # the LMDB store outlives it
    assert engine["build"]["dockerfile"] == "ops/Dockerfile"


def test_the_image_copies_every_package_folder() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert "\nCOPY . .\n" in (ROOT / "ops/Dockerfile").read_text()
    lines = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln[:1] not in "#"]
    assert lines[0] == "*"  # everything is left out but what is let in again
    let_in = {ln[1:] for ln in lines if ln.startswith("!")}
    assert folders | {"pyproject.toml", "README.md"} <= let_in, folders - let_in
