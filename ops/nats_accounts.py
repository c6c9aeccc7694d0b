"""The accounts of a nats-server run with authentication: the service's and each tenant's.

Their passwords and the server's configuration live under <data-dir>/nats/ (the layout and the
subjects are in ops/nats_auth.py). `EmbeddedNats(auth_data_dir=...)` starts a server from them;
`add_tenant` (`pensieve tenant add`) adds a tenant, and reloads a server running from them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pensieve.actors.bus import DISCONNECTS
from pensieve.actors.config import DEFAULTS
from pensieve.actors.subjects import PREFIX
from pensieve.ops.nats_auth import (
    SERVICE_ACCOUNT,
    SERVICE_USER,
    NatsAuth,
    check_tenant_name,
    new_secret,
    read_secret,
    tenant_subject,
)

logger = logging.getLogger("pensieve")

CONFIG = "nats-server.conf"
PID_FILE = "nats-server.pid"  # written by nats-server itself
SERVICE_PASSWORD = "service.password"
EVENTS_PASSWORD = "events.password"
EVENTS_USER = "pensieve-events"
SYSTEM_ACCOUNT = "system"
TENANTS = "tenants"
TENANT_ACCOUNT = "tenant-"  # + the tenant's name: its account, and its user's name
# the longest silence within one streamed answer (a turn queued for admission, say): past it
# the server forgets where the rest of the answer goes
RESPONSE_THRESHOLD = "10m"
RELOAD_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Tenant:
    name: str
    password: str = field(repr=False)
    wired: bool = True  # False: its account and user only, not yet its import (see `_reload`)

    @property
    def account(self) -> str:
        return TENANT_ACCOUNT + self.name  # also its user's: user names are server-wide

    @property
    def inbox_prefix(self) -> str:
        return f"_INBOX.{self.name}"

    def export(self) -> dict[str, Any]:
        """The service account's export of the client API to this tenant alone."""
        return {"service": tenant_subject(self.name, f"{PREFIX}.>"), "response_type": "stream",
                "response_threshold": RESPONSE_THRESHOLD, "accounts": [self.account]}  # fmt: skip

    def account_config(self) -> dict[str, Any]:
        """Its account: it publishes the plain API subjects, which its import maps to its own
        subjects of the service account, and subscribes to its own inbox only."""
        permissions = {"publish": {"allow": [f"{PREFIX}.>"]},
                       "subscribe": {"allow": [f"{self.inbox_prefix}.>"]}}  # fmt: skip
        user = {"user": self.account, "password": self.password, "permissions": permissions}
        api = {"account": SERVICE_ACCOUNT, "subject": tenant_subject(self.name, f"{PREFIX}.>")}
        # share: each request names the connection it came from (`bus.requester`)
        imports = [{"service": api, "to": f"{PREFIX}.>", "share": True}] if self.wired else []
        return {"users": [user], "imports": imports}

    def connect_kwargs(self, servers: list[str]) -> dict[str, Any]:
        """The keyword arguments of nats-py's `nats.connect()` for this tenant."""
        return {"servers": servers, "user": self.account, "password": self.password,
                "inbox_prefix": self.inbox_prefix}  # fmt: skip


@dataclass(frozen=True)
class ServerConfig:
    """A nats-server configuration with accounts: the service, and one per tenant."""

    listen: str  # host:port
    service_password: str = field(repr=False)
    events_password: str = field(repr=False)
    tenants: tuple[Tenant, ...] = ()
    pid_file: Path | None = None

    def text(self) -> str:
        service = {"users": [{"user": SERVICE_USER, "password": self.service_password}],
                   "exports": [t.export() for t in self.tenants if t.wired]}  # fmt: skip
        # the engine's user of the system account hears of closed connections, and no more
        watcher = {"user": EVENTS_USER, "password": self.events_password,
                   "permissions": {"publish": {"deny": [">"]},
                                   "subscribe": {"allow": [DISCONNECTS]}}}  # fmt: skip
        accounts: dict[str, Any] = {SERVICE_ACCOUNT: service, SYSTEM_ACCOUNT: {"users": [watcher]}}
        accounts.update((t.account, t.account_config()) for t in self.tenants)
        config: dict[str, Any] = {"listen": self.listen, "accounts": accounts,
                                  "system_account": SYSTEM_ACCOUNT}  # fmt: skip
        if self.pid_file is not None:
            config["pid_file"] = str(self.pid_file)
        return json.dumps(config, indent=2) + "\n"  # nats-server reads JSON as its own format

    @property
    def address(self) -> tuple[str, int]:
        """Where a client on this host reaches the server."""
        host, _, port = self.listen.rpartition(":")
        return ("127.0.0.1" if host in ("", "0.0.0.0") else host, int(port))


def nats_dir(data_dir: Path) -> Path:
    return data_dir.absolute() / "nats"


def write_server_config(data_dir: Path, listen: str, pid_file: bool) -> Path:
    """Write the configuration of a server on `listen` (host:port) from the passwords on file,
    making the service's if there is none yet; returns its path. With `pid_file` the server
    records its pid, so that `add_tenant` can reload it."""
    with _locked(data_dir) as directory:
        config = replace(_on_file(directory), listen=listen,
                         pid_file=directory / PID_FILE if pid_file else None)  # fmt: skip
        _write_private(directory / CONFIG, config.text())
    return directory / CONFIG


def service_connect_options(data_dir: Path) -> NatsAuth:
    """Who the engine's actors are to a server running from `data_dir`'s accounts."""
    return NatsAuth(user=SERVICE_USER, password=read_secret(nats_dir(data_dir) / SERVICE_PASSWORD))


def events_connect_options(data_dir: Path) -> NatsAuth:
    """Who the scheduler is to the same server's system account, to hear of closed
    connections (`Bus.on_disconnects`)."""
    return NatsAuth(user=EVENTS_USER, password=read_secret(nats_dir(data_dir) / EVENTS_PASSWORD))


def add_tenant(data_dir: Path, name: str, servers: str | None = None) -> dict[str, Any]:
    """Create tenant `name`: its password, and its account in the server's configuration, which
    a server running from `data_dir` takes before this returns. Returns the keyword arguments of
    `nats.connect()` for the tenant, at `servers` (comma-separated URLs; default: the server's
    own address)."""
    check_tenant_name(name)
    with _locked(data_dir) as directory:
        path = directory / TENANTS / f"{name}.password"
        if path.exists():
            raise ValueError(f"tenant {name} exists (its password is in {path})")
        _private_dir(path.parent)
        _write_private(path, new_secret())
        config = _on_file(directory)
        pid = running_pid(data_dir)
        if pid is None:
            _write_private(directory / CONFIG, config.text())
            logger.info("tenant %s added; no nats-server runs from %s: it takes the tenant when "
                        "it starts (or reload it twice, SIGHUP)", name, directory)  # fmt: skip
        else:
            _reload(directory, pid, config)
            logger.info("tenant %s added; nats-server (pid %d) reloaded", name, pid)
    (tenant,) = [t for t in config.tenants if t.name == name]
    host, port = config.address
    return tenant.connect_kwargs(servers.split(",") if servers else [f"nats://{host}:{port}"])


def reload_server(data_dir: Path, pid: int) -> None:
    """Make the nats-server `pid` take the accounts on file now."""
    with _locked(data_dir) as directory:
        _reload(directory, pid, _on_file(directory))


def running_pid(data_dir: Path) -> int | None:
    """The pid of the nats-server running from `data_dir`'s configuration, if one does (and
    this host has /proc to tell: a stale pid file must not send SIGHUP to whatever has its pid
    now, which SIGHUP would end)."""
    directory = nats_dir(data_dir)
    try:
        pid = int((directory / PID_FILE).read_text())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    ours = Path(os.fsdecode(argv[0])).name == "nats-server"
    return pid if ours and os.fsencode(directory / CONFIG) in argv else None


def _reload(directory: Path, pid: int, config: ServerConfig) -> None:
    """Make the nats-server `pid` run `config`. nats-server (2.15) leaves the service import
    of an account created by a reload unwired until the next reload (the tenant's requests find
    no responders), so a tenant new to the server comes in two: its account, with a throwaway
    password and no import, then its import and its own password. Each reload is awaited by
    logging in as the new tenants with that reload's password."""
    loaded = _wired_tenants(directory / CONFIG)
    new = [t for t in config.tenants if t.name not in loaded]
    if new:
        staged = tuple(Tenant(t.name, new_secret(), wired=False) if t in new else t
                       for t in config.tenants)  # fmt: skip
        first = [t for t in staged if not t.wired]
        _apply(directory, pid, replace(config, tenants=staged), first)
    _apply(directory, pid, config, new)


def _apply(directory: Path, pid: int, config: ServerConfig, logins: list[Tenant]) -> None:
    _write_private(directory / CONFIG, config.text())
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    for tenant in logins:
        while not _logs_in(config.address, tenant):
            if time.monotonic() > deadline:
                raise OSError(f"nats-server (pid {pid}) did not take {directory / CONFIG} "
                              f"within {RELOAD_TIMEOUT_S:.0f} s: see its log")  # fmt: skip
            time.sleep(0.02)


def _logs_in(address: tuple[str, int], tenant: Tenant) -> bool:
    """Whether the server takes `tenant`'s password: the client handshake (server INFO, client
    CONNECT, PING), to which it answers PONG, or -ERR and closes."""
    hello = json.dumps({"user": tenant.account, "pass": tenant.password, "verbose": False})
    with socket.create_connection(address, timeout=2.0) as sock, sock.makefile("rb") as lines:
        lines.readline()  # INFO {...}
        sock.sendall(f"CONNECT {hello}\r\nPING\r\n".encode())
        return lines.readline().startswith(b"PONG")


def _on_file(directory: Path) -> ServerConfig:
    """The configuration the files under `directory` make: the listen address and pid file of
    the last one written, the service's password (made now if missing), every tenant's."""
    try:
        last = json.loads((directory / CONFIG).read_text())
    except FileNotFoundError:
        last = {}
    service, events = directory / SERVICE_PASSWORD, directory / EVENTS_PASSWORD
    for path in (service, events):
        if not path.exists():
            _write_private(path, new_secret())
    tenants = tuple(Tenant(path.stem, read_secret(path))
                    for path in sorted((directory / TENANTS).glob("*.password")))  # fmt: skip
    pid_file = last.get("pid_file")
    return ServerConfig(last.get("listen", f"127.0.0.1:{DEFAULTS.nats_port}"),
                        read_secret(service), read_secret(events), tenants,
                        None if pid_file is None else Path(pid_file))  # fmt: skip


def _wired_tenants(config: Path) -> set[str]:
    """The tenants whose import the configuration at `config` holds."""
    try:
        accounts = json.loads(config.read_text())["accounts"]
    except FileNotFoundError:
        return set()
    return {name.removeprefix(TENANT_ACCOUNT) for name, account in accounts.items()
            if name.startswith(TENANT_ACCOUNT) and account["imports"]}  # fmt: skip


@contextlib.contextmanager
def _locked(data_dir: Path) -> Iterator[Path]:
    """`data_dir`'s nats/ folder (made, mode 0700), held against other writers of it."""
    directory = nats_dir(data_dir)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _private_dir(directory)
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield directory
    finally:
        os.close(fd)  # which lets the lock go


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, exist_ok=True)
    path.chmod(0o700)  # mkdir's mode is cut by the umask, and an older folder may be wider


def _write_private(path: Path, text: str) -> None:
    """Replace `path` with `text`, readable by this user only from the first byte on."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(text)
    os.replace(temporary, path)
