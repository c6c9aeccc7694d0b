"""compose.yaml, its GPU override and ops/Dockerfile agree with the code they run.

No container runs here (CI has no Docker daemon); these checks catch what would break the stack
silently: an engine command the CLI no longer accepts, services that do not point at each other,
a package folder the image does not copy.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pensieve.ops.cli import build_parser
from pensieve.ops.nats_server import find_binary

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / name).read_text())


def _command(service: dict[str, Any]) -> list[str]:
    """The service's command with `${VAR:-default}` and `${VAR-default}` replaced by the
    default."""
    command = re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", service["command"])
    return shlex.split(command)


def _ports(service: dict[str, Any]) -> set[int]:
    return {int(p.split(":")[-1]) for p in service.get("ports", [])}


ACTORS = ("ingress", "http", "tokenizer", "scheduler", "recompute-planner", "executor")


@pytest.mark.parametrize("files", [["compose.yaml"], ["compose.yaml", "ops/compose.gpu.yaml"]])
def test_each_actor_service_runs_that_actor_with_options_the_cli_accepts(files: list[str]) -> None:
    services: dict[str, dict[str, Any]] = {name: {} for name in ACTORS}
    for name in files:  # an override replaces the keys it names
        for actor, service in _load(name)["services"].items():
            services.setdefault(actor, {}).update(service)
    gpu = len(files) == 2
    for actor in ACTORS:
        args = build_parser().parse_args(_command(services[actor]))
        assert args.run.__name__ == "_actor" and args.name == actor
        assert args.trace == "otlp" and str(args.data_dir) == "/data"
        # each actor takes only the options it uses (the parser refused any other)
        assert args.device == ("cuda" if gpu and actor == "executor" else "cpu")
        assert args.model == ("smollm2" if actor not in ("ingress", "recompute-planner") else None)
    # the engine's tokenizers are their own service; only the executor holds the GPU
    assert _command(services["scheduler"])[:4] == ["actor", "scheduler", "--tokenizers", "0"]
    # the scheduler hears of closed tenant connections (their turns end) with and without GPUs
    scheduler = build_parser().parse_args(_command(services["scheduler"]))
    assert str(scheduler.nats_events_password_file) == "/data/nats/events.password"
    assert services["tokenizer"]["deploy"]["replicas"] == 2
    holding = [a for a in ACTORS if "resources" in services[a].get("deploy", {})]
    assert holding == (["executor"] if gpu else [])
    # the executor's disk tier, on a volume of its own; off with GPUs unless asked for
    tiers = build_parser().parse_args(_command(services["executor"]))
    assert tiers.disk_cache_dir == (None if gpu else "/disk")
    assert "pensieve-disk:/disk" in services["executor"]["volumes"]
    if gpu:  # PENSIEVE_TENSOR_PARALLEL splits the model over the executor's ranks
        executor = services["executor"]["command"]
        assert build_parser().parse_args(_command(services["executor"])).tensor_parallel == 1
        split = executor.replace("${PENSIEVE_TENSOR_PARALLEL:-1}", "2")
        assert build_parser().parse_args(_command({"command": split})).tensor_parallel == 2
        disk = "--disk-cache-dir /disk --disk-cache-gb 200"
        on = executor.replace("${PENSIEVE_DISK_ARGS:-}", disk)
        assert build_parser().parse_args(_command({"command": on})).disk_cache_gb == 200


def test_the_services_point_at_each_other_on_one_store() -> None:
    services = _load("compose.yaml")["services"]
    for actor in ACTORS:
        service = services[actor]
        args = build_parser().parse_args(_command(service))
        host, port = args.nats_url.removeprefix("nats://").split(":")
        assert host in services and int(port) in _ports(services[host])
        collector = service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        host, port = collector.removeprefix("http://").split(":")
        assert host in services and int(port) in _ports(services[host])
        # the scheduler stops before the executor: it has the KV tiers written back to disk
        after = {"executor"} if actor == "scheduler" else set()
        assert set(service["depends_on"]) == {"nats", "jaeger", *after}
        # one volume: its store names the engine every actor belongs to, and outlives them;
        # the executor's disk tier has one of its own
        disk = ["pensieve-disk:/disk"] if actor == "executor" else []
        assert service["volumes"] == ["pensieve-data:/data", *disk]
        assert service["build"]["dockerfile"] == "ops/Dockerfile"


def test_published_ports_are_bound_to_loopback() -> None:
    for service in _load("compose.yaml")["services"].values():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), port


def test_the_image_copies_every_package_folder() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert "\nCOPY . .\n" in (ROOT / "ops/Dockerfile").read_text()
    lines = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln[:1] not in "#"]
    assert lines[0] == "*"  # everything is left out but what is let in again
    let_in = {ln[1:] for ln in lines if ln.startswith("!")}
    assert folders | {"pyproject.toml", "README.md"} <= let_in, folders - let_in


def test_prometheus_scrapes_the_http_ingress_and_grafana_shows_the_dashboard() -> None:
    services = _load("compose.yaml")["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    (mounted,) = prometheus["volumes"]
    config = yaml.safe_load((ROOT / mounted.split(":")[0]).read_text())
    (job,) = config["scrape_configs"]
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host == "http" and int(port) in _ports(services["http"])
    assert job.get("metrics_path", "/metrics") == "/metrics"
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    provisioning = ROOT / next(k for k, v in mounts.items() if v == "/etc/grafana/provisioning")
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yaml").read_text())[
        "datasources"
    ]
    assert source["url"] == f"http://prometheus:{_ports(prometheus).pop()}"
    (provider,) = yaml.safe_load((provisioning / "dashboards/pensieve.yaml").read_text())[
        "providers"
    ]
    folder = provider["options"]["path"]
    dashboards = [k for k, v in mounts.items() if v.startswith(folder + "/")]
    assert dashboards == ["./ops/grafana/pensieve-dashboard.json"]
    panels = json.loads((ROOT / dashboards[0]).read_text())["panels"]
    assert {p["datasource"]["uid"] for p in panels} == {source["uid"]}


def test_compose_runs_the_nats_server_the_package_ships_and_jaeger_v2() -> None:
    """Both stacks, the single engine's and the many engines' cluster."""
    services = _load("compose.yaml")["services"]
    shipped = subprocess.run(
        [find_binary(), "--version"], capture_output=True, text=True, check=True
    ).stdout  # "nats-server: v2.15.1"
    version = shipped.split("v")[-1].strip()
    assert services["nats"]["image"] == f"nats:{version}-alpine"
    cluster = _load("ops/compose.engines.yaml")["services"]
    nodes = [s for name, s in cluster.items() if name.startswith("nats-")]
    assert nodes and all(node["image"] == f"nats:{version}-alpine" for node in nodes)
    image, tag = services["jaeger"]["image"].split(":")
    assert image == "jaegertracing/jaeger" and tag.split(".")[0] == "2"


def test_the_many_engine_stack_runs_two_engines_on_a_three_node_jetstream_cluster() -> None:
    services = _load("ops/compose.engines.yaml")["services"]
    nodes = {name: s for name, s in services.items() if name.startswith("nats-")}
    assert len(nodes) == 3
    for name, node in nodes.items():
        command = node["command"].split()
        assert "-js" in command and command[command.index("-n") + 1] == name
        routes = command[command.index("--routes") + 1].split(",")
        assert sorted(routes) == sorted(f"nats://{n}:6222" for n in nodes if n != name)
    engines = [s for name, s in services.items() if name.startswith("engine-")]
    assert len(engines) == 2
    stores = set()
    for engine in engines:
        args = build_parser().parse_args(_command(engine))
        assert args.run.__name__ == "_serve" and args.turn_log == "jetstream"
        assert args.nats_url.removeprefix("nats://").split(":")[0] in nodes
        stores.update(engine["volumes"])
    assert len(stores) == 2  # each engine its own store: the log is what they share
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert published and all(p.startswith("127.0.0.1:") for p in published)
