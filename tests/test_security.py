"""Two classes of hole that no test of behaviour finds, checked on the product's own sources and
on the listeners it opens:

- a module that turns bytes into objects by running code they name (pickle and its kin, the bug
  class behind the vLLM and SGLang ZMQ remote-code CVEs, and `torch.load`, `numpy.load` and
  `yaml.load` in their unsafe forms);
- a listener that takes connections from beyond this host when nobody asked it to.

Each check also runs on a bad example, which it must catch.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import ipaddress
import json
import os
import re
import socket
import sys
from pathlib import Path

import pytest

from pensieve.actors.ingress.http_actor import HttpConfig, HttpIngressActor, serve_metrics
from pensieve.actors.wire.bus import Bus
from pensieve.ops.cli import build_parser
from pensieve.ops.context import ServeOptions
from pensieve.ops.nats_accounts import write_server_config
from pensieve.ops.nats_server import EmbeddedNats, free_port

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("actors", "kernels", "models", "store", "ops")


def product_sources() -> list[Path]:
    return sorted(path for folder in PRODUCT for path in (ROOT / folder).rglob("*.py"))


def scan(check: type[_Names]) -> list[str]:
    """What `check` finds in every product module, as 'path:line: what'."""
    found = []
    for path in product_sources():
        for line in findings(check, path.read_text()):
            found.append(f"{path.relative_to(ROOT)}:{line}")
    return found


def findings(check: type[_Names], source: str) -> list[str]:
    visitor = check()
    visitor.visit(ast.parse(source))
    return list(visitor.found)


class _Names(ast.NodeVisitor):
    """Calls by the dotted name of what they call, through the module's imports
    (`import torch as t; t.load` is `torch.load`; `from yaml import load` is `yaml.load`)."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.aliases: dict[str, str] = {}

    def visit_Module(self, node: ast.Module) -> None:
        for inner in ast.walk(node):  # imports first, wherever they are
            if isinstance(inner, ast.Import):
                for alias in inner.names:
                    top = alias.name.partition(".")[0]
                    self.aliases[alias.asname or top] = alias.name if alias.asname else top
            elif isinstance(inner, ast.ImportFrom) and inner.module:
                for alias in inner.names:
                    self.aliases[alias.asname or alias.name] = f"{inner.module}.{alias.name}"
        self.generic_visit(node)

    def dotted(self, node: ast.expr) -> str:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            return f"{self.dotted(node.value)}.{node.attr}"
        return "?"


# ---- no module deserializes with pickle, marshal, torch.load, ... ------------------------------

# modules whose loading runs code named by the bytes loaded
UNSAFE_MODULES = {
    "pickle",
    "_pickle",
    "cPickle",
    "marshal",
    "shelve",
    "cloudpickle",
    "dill",
    "joblib",
    "jsonpickle",
}
UNSAFE_CALLS = {"yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "pandas.read_pickle"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader"}


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_constant(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


class UnsafeDeserialization(_Names):
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.partition(".")[0] in UNSAFE_MODULES:
                self.found.append(f"{node.lineno}: import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.partition(".")[0] in UNSAFE_MODULES:
            self.found.append(f"{node.lineno}: from {node.module} import ...")

    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func)
        problem = None
        if name in UNSAFE_CALLS:
            problem = name
        elif name == "torch.load" and not _is_constant(_keyword(node, "weights_only"), True):
            problem = "torch.load without weights_only=True"
        elif name == "numpy.load":
            allow = _keyword(node, "allow_pickle")
            if allow is not None and not _is_constant(allow, False):
                problem = "numpy.load with allow_pickle"
        elif name in ("yaml.load", "yaml.load_all"):
            loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if loader is None or self.dotted(loader).rpartition(".")[2] not in SAFE_YAML_LOADERS:
                problem = f"{name} without a safe Loader"
        elif name in ("__import__", "importlib.import_module") and node.args:
            module = node.args[0]
            if isinstance(module, ast.Constant) and str(module.value) in UNSAFE_MODULES:
                problem = f"{name}({module.value!r})"
        if _is_constant(_keyword(node, "trust_remote_code"), True):
            problem = "trust_remote_code=True (runs code shipped with a model)"
        if problem is not None:
            self.found.append(f"{node.lineno}: {problem}")
        self.generic_visit(node)


def test_no_module_deserializes_with_pickle_marshal_or_torch_load() -> None:
    assert len(product_sources()) > 50
    assert scan(UnsafeDeserialization) == []


@pytest.mark.parametrize(
    "source",
    [
        "import pickle\npickle.loads(data)",
        "from marshal import loads",
        "import cloudpickle",
        "import dill as d",
        "import shelve",
        "import torch\ntorch.load(path)",
        "import torch as t\nt.load(path, weights_only=False)",
        "from torch import load\nload(buffer)",
        "import numpy as np\nnp.load(path, allow_pickle=True)",
        "import yaml\nyaml.load(text)",
        "import yaml\nyaml.load(text, Loader=yaml.Loader)",
        "import yaml\nyaml.unsafe_load(text)",
        "import importlib\nimportlib.import_module('pickle')",
        "from transformers import AutoModel\nAutoModel.from_pretrained(p, trust_remote_code=True)",
    ],
)
def test_the_deserialization_check_catches(source: str) -> None:
    assert findings(UnsafeDeserialization, source)


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load(path, weights_only=True)",
        "import numpy as np\nnp.load(path)",
        "import numpy as np\nnp.load(path, allow_pickle=False)",
        "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
        "import yaml\nyaml.safe_load(text)",
        "import json\njson.loads(data)",
        "import msgspec\nmsgspec.json.decode(data)",
    ],
)
def test_the_deserialization_check_passes(source: str) -> None:
    assert findings(UnsafeDeserialization, source) == []


# ---- no listener binds beyond loopback unless asked --------------------------------------------

# every interface, as a whole string: "0.0.0.0", "0.0.0.0:4222", "::", "[::]:80"
WILDCARD = re.compile(r"(0\.0\.0\.0|::|\[::\])(:\d+)?")
LISTENERS = {"TCPSite", "run_app", "create_server", "start_server"}  # their host None: all


class WildcardAddresses(_Names):
    """Every wildcard address written into the code (a default, an argument, a constant), bar
    comparisons with one (a check of what was given), and every bind or aiohttp site to every
    interface by omission ("" or None)."""

    def visit_Compare(self, node: ast.Compare) -> None:
        pass  # `host in ("", "0.0.0.0")` looks at an address; it binds nothing

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and WILDCARD.fullmatch(node.value):
            self.found.append(f"{node.lineno}: {node.value!r}")

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        first = node.values[0] if node.values else None
        if isinstance(first, ast.Constant) and WILDCARD.fullmatch(str(first.value).rstrip(":")):
            self.found.append(f"{node.lineno}: f{str(first.value)!r}...")

    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func).rpartition(".")[2]
        host: ast.expr | None = None
        if name == "bind" and node.args and isinstance(node.args[0], ast.Tuple):
            host = node.args[0].elts[0] if node.args[0].elts else None
        elif name in LISTENERS:
            host = _keyword(node, "host") or (node.args[1] if len(node.args) > 1 else None)
            host = host or ast.Constant(None)
        if isinstance(host, ast.Constant) and host.value in ("", None):
            self.found.append(f"{node.lineno}: {name} on every interface (host {host.value!r})")
        self.generic_visit(node)


def test_no_code_names_a_wildcard_address() -> None:
    """Only what an operator gives (--http-host 0.0.0.0, compose.yaml's --listen) binds
    beyond loopback."""
    assert scan(WildcardAddresses) == []


@pytest.mark.parametrize(
    "source",
    [
        "HOST = '0.0.0.0'",
        "def serve(host='::'):\n    pass",
        "p.add_argument('--listen', default=f'0.0.0.0:{port}')",
        "command = ['nats-server', '-a', '0.0.0.0']",
        "config = {'http': '[::]:8222'}",
        "sock.bind(('', 8000))",
        "from aiohttp import web\nweb.TCPSite(runner, port=8000)",
        "site = TCPSite(runner, None, 8000)",
    ],
)
def test_the_wildcard_check_catches(source: str) -> None:
    assert findings(WildcardAddresses, source)


@pytest.mark.parametrize(
    "source",
    [
        "HOST = '127.0.0.1'",
        "is_any = host in ('', '0.0.0.0')",
        "help = 'address the HTTP port listens on (0.0.0.0: every interface)'",
        "sock.bind(('127.0.0.1', 0))",
        "web.TCPSite(runner, config.host, config.port)",
    ],
)
def test_the_wildcard_check_passes(source: str) -> None:
    assert findings(WildcardAddresses, source) == []


def loopback(address: str) -> bool:
    """Whether `address` (a host, or host:port) is this host alone."""
    host = address
    if address.startswith("["):  # [v6]:port
        host = address[1:].partition("]")[0]
    elif address.count(":") == 1:  # v4:port, name:port
        host = address.partition(":")[0]
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name may resolve to anything; "" is every interface
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@pytest.mark.parametrize(
    ("address", "alone"),
    [
        ("127.0.0.1", True),
        ("127.0.0.1:4222", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]:8000", True),
        ("0.0.0.0", False),
        ("0.0.0.0:4222", False),
        ("", False),
        ("::", False),
        ("[::]:8222", False),
        ("10.1.2.3", False),
        ("example.com", False),
    ],
)
def test_loopback_tells_this_host_from_the_others(address: str, alone: bool) -> None:
    assert loopback(address) is alone


def test_every_default_address_is_loopback(tmp_path: Path) -> None:
    """The HTTP API's and /metrics' hosts, the nats-server `pensieve serve` starts and the one
    `pensieve nats-config` configures (with no monitoring, cluster, gateway, leaf node,
    websocket or MQTT port at all)."""
    assert loopback(HttpConfig(port=8000).host)
    options = {f.name: f.default for f in dataclasses.fields(ServeOptions)}
    assert loopback(str(options["metrics_host"]))
    parser = build_parser()
    for argv in (
        ["serve", "--model", "smollm2"],
        ["actor", "http", "--model", "smollm2", "--nats-url", "nats://127.0.0.1:4222"],
        ["nats-config"],
    ):
        args = vars(parser.parse_args(argv))
        hosts = {k: v for k, v in args.items() if k in ("http_host", "metrics_host", "listen")}
        assert hosts and all(loopback(str(v)) for v in hosts.values()), (argv, hosts)
    listen = vars(parser.parse_args(["nats-config"]))["listen"]
    config = json.loads(write_server_config(tmp_path, listen, pid_file=False).read_text())
    assert loopback(config["listen"])
    opened = {"http", "https", "cluster", "gateway", "leafnodes", "websocket", "mqtt"}
    assert not opened & set(config), config


# ---- the listeners the product opens, as the kernel sees them --------------------------------

needs_proc = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="reads the kernel's socket tables (/proc)"
)


def listening(pid: int | None = None, port: int | None = None) -> list[str]:
    """The local address of every listening TCP socket: of process `pid`, or on `port`."""
    inodes = None
    if pid is not None:
        inodes = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            (hex_address, hex_port), state, inode = fields[1].split(":"), fields[3], fields[9]
            if state != "0A" or (inodes is not None and inode not in inodes):  # 0A: LISTEN
                continue
            if port is not None and int(hex_port, 16) != port:
                continue
            found.append(_address(hex_address))
    return found


def _address(hex_address: str) -> str:
    """An address of /proc/net/tcp*, whose 32-bit words are each in the host's byte order."""
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


@needs_proc
@pytest.mark.parametrize(("host", "alone"), [("127.0.0.1", True), ("0.0.0.0", False)])
def test_the_socket_check_catches_a_listener_on_every_interface(host: str, alone: bool) -> None:
    with socket.socket() as sock:
        sock.bind((host, 0))
        sock.listen()
        found = listening(os.getpid(), sock.getsockname()[1])
    assert found and all(map(loopback, found)) is alone


@needs_proc
def test_the_nats_servers_pensieve_starts_listen_on_loopback_alone(tmp_path: Path) -> None:
    for server in (EmbeddedNats(), EmbeddedNats(auth_data_dir=tmp_path)):
        with server:
            assert server._process is not None
            found = listening(server._process.pid)
        assert found and all(map(loopback, found)), found


@needs_proc
def test_the_http_api_and_metrics_listen_on_loopback_alone() -> None:
    """The HTTP ingress and the /metrics port of their default configuration, started."""

    async def go(url: str) -> tuple[list[str], list[str]]:
        bus = await Bus.connect(url)
        actor = HttpIngressActor(bus, "0badc0de", HttpConfig(port=0), lambda key: None)
        await actor.start()
        try:
            assert actor.port is not None
            http = listening(os.getpid(), actor.port)
        finally:
            await actor.stop()
        port = free_port()
        host = {f.name: f.default for f in dataclasses.fields(ServeOptions)}["metrics_host"]
        async with serve_metrics(str(host), port, lambda: b""):
            metrics = listening(os.getpid(), port)
        return http, metrics

    with EmbeddedNats() as server:
        for found in asyncio.run(go(server.url)):
            assert found and all(map(loopback, found)), found
