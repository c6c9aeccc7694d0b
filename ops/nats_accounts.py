"""The accounts of a nats-server run with authentication: the service's and each tenant's.

Their passwords and the server's configuration live under <data-dir>/nats/ (the layout and the
subjects are in ops/nats_auth.py). `EmbeddedNats(auth_data_dir=...)` starts a server from them;
`add_tenant`, `rotate_tenant` and `remove_tenant` (`pensieve tenant add|rotate|remove`) change
the tenants, and reload a server running from them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
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
TENANT_USER = "tenant-"  # + the tenant's name: its user's name (user names are server-wide)
SPARE = "spare.account"  # the name of the account the next tenant takes (see `_reload`)
# the longest silence within one streamed answer (a turn queued for admission, say): past it
# the server forgets where the rest of the answer goes
RESPONSE_THRESHOLD = "10m"
RELOAD_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Tenant:
    name: str
    password: str = field(repr=False)
    account: str = ""  # its NATS account's name (default: its user's)
    wired: bool = True  # False: its account and user only, not yet its import (see `_reload`)

    def __post_init__(self) -> None:
        if not self.account:
            object.__setattr__(self, "account", self.user)

    @property
    def user(self) -> str:
        return TENANT_USER + self.name

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
        user = {"user": self.user, "password": self.password, "permissions": permissions}
        api = {"account": SERVICE_ACCOUNT, "subject": tenant_subject(self.name, f"{PREFIX}.>")}
        # share: each request names the connection it came from (`bus.requester`)
        imports = [{"service": api, "to": f"{PREFIX}.>", "share": True}] if self.wired else []
        return {"users": [user], "imports": imports}

    def connect_kwargs(self, servers: list[str]) -> dict[str, Any]:
        """The keyword arguments of nats-py's `nats.connect()` for this tenant."""
        return {"servers": servers, "user": self.user, "password": self.password,
                "inbox_prefix": self.inbox_prefix}  # fmt: skip


@dataclass(frozen=True)
class ServerConfig:
    """A nats-server configuration with accounts: the service, and one per tenant."""

    listen: str  # host:port
    service_password: str = field(repr=False)
    events_password: str = field(repr=False)
    spare: str  # an account with nothing in it yet, which the next tenant added takes
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
        accounts[self.spare] = {}
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
        path = _password_file(directory, name)
        if path.exists():
            raise ValueError(f"tenant {name} exists (its password is in {path})")
        _private_dir(path.parent)
        _write_private(path.with_suffix(".account"), _on_file(directory).spare)
        _write_private(directory / SPARE, _new_account())
        _write_private(path, new_secret())
        config = _take(data_dir, directory, f"tenant {name} added")
    return _connect_kwargs(config, name, servers)


def rotate_tenant(data_dir: Path, name: str, servers: str | None = None) -> dict[str, Any]:
    """Give tenant `name` a new password, as `add_tenant` gives one: from when this returns its
    old password is refused, and the server has closed the connections made with it."""
    check_tenant_name(name)
    with _locked(data_dir) as directory:
        _write_private(_existing(directory, name), new_secret())
        config = _take(data_dir, directory, f"tenant {name} has a new password")
    return _connect_kwargs(config, name, servers)


def remove_tenant(data_dir: Path, name: str) -> None:
    """Remove tenant `name`: from when this returns the server refuses its password, and has
    closed its connections (their turns in flight are cancelled). Its conversations stay in the
    store, out of everyone's reach, until they expire; a tenant added later under the same name
    reaches them again."""
    check_tenant_name(name)
    with _locked(data_dir) as directory:
        _existing(directory, name).unlink()
        _password_file(directory, name).with_suffix(".account").unlink(missing_ok=True)
        _take(data_dir, directory, f"tenant {name} removed")


def list_tenants(data_dir: Path) -> list[str]:
    """The names of the tenants on file."""
    with _locked(data_dir) as directory:
        return [tenant.name for tenant in _on_file(directory).tenants]


def _take(data_dir: Path, directory: Path, done: str) -> ServerConfig:
    """Write the configuration of the files on file, and have the server running from it (if
    any) take it."""
    config = _on_file(directory)
    pid = running_pid(data_dir)
    if pid is None:
        _write_private(directory / CONFIG, config.text())
        logger.info("%s; no nats-server runs from %s: it takes this when it starts (one "
                    "started otherwise: SIGHUP it)", done, directory)  # fmt: skip
    else:
        _reload(directory, pid, config)
        logger.info("%s; nats-server (pid %d) reloaded", done, pid)
    return config


def _password_file(directory: Path, name: str) -> Path:
    return directory / TENANTS / f"{name}.password"


def _existing(directory: Path, name: str) -> Path:
    path = _password_file(directory, name)
    if not path.exists():
        raise ValueError(f"no tenant {name} (tenants: pensieve tenant list)")
    return path


def _connect_kwargs(config: ServerConfig, name: str, servers: str | None) -> dict[str, Any]:
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
    """Make the nats-server `pid` run `config`, and wait until it does: until every tenant new
    to it or with a new password logs in with it, and the old password of every tenant removed
    or given a new one is refused.

    nats-server (2.15) subscribes to the service imports of an account that a reload creates
    only at the next reload (its `configureAccounts` wires a new account's imports only when
    the server starts; a reload rewires those of the accounts it had already), and until then
    the tenant's requests find no responders. So the configuration always holds a spare
    account, empty, which the next tenant added takes (`add_tenant`): one reload gives it
    its user and its import. A tenant whose account the server does not have yet (added
    before there were spares) comes in two reloads: its account, with a throwaway password
    and no import, then its import and its own password."""
    loaded, accounts = _loaded(directory / CONFIG)
    names = {t.name for t in config.tenants}
    new = [t for t in config.tenants if t.name not in loaded]
    changed = [t for t in config.tenants if loaded.get(t.name, t.password) != t.password]
    refused = [Tenant(name, password) for name, password in loaded.items()
               if name not in names or any(t.name == name for t in changed)]  # fmt: skip
    unknown = [t for t in new if t.account not in accounts]
    if unknown:
        staged = tuple(replace(t, password=new_secret(), wired=False) if t in unknown else t
                       for t in config.tenants)  # fmt: skip
        first = [t for t in staged if not t.wired]
        _apply(directory, pid, replace(config, tenants=staged), first)
    _apply(directory, pid, config, new + changed, refused)


def _apply(
    directory: Path,
    pid: int,
    config: ServerConfig,
    logins: list[Tenant],
    refused: list[Tenant] | None = None,
) -> None:
    _write_private(directory / CONFIG, config.text())
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    waits = [(t, True) for t in logins] + [(t, False) for t in refused or []]
    for tenant, taken in waits:
        while _logs_in(config.address, tenant) != taken:
            if time.monotonic() > deadline:
                raise OSError(f"nats-server (pid {pid}) did not take {directory / CONFIG} "
                              f"within {RELOAD_TIMEOUT_S:.0f} s: see its log")  # fmt: skip
            time.sleep(0.02)


def _logs_in(address: tuple[str, int], tenant: Tenant) -> bool:
    """Whether the server takes `tenant`'s password: the client handshake (server INFO, client
    CONNECT, PING), to which it answers PONG, or -ERR and closes."""
    hello = json.dumps({"user": tenant.user, "pass": tenant.password, "verbose": False})
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
    service, events, spare = (directory / SERVICE_PASSWORD, directory / EVENTS_PASSWORD,
                              directory / SPARE)  # fmt: skip
    for path, make in ((service, new_secret), (events, new_secret), (spare, _new_account)):
        if not path.exists():
            _write_private(path, make())
    tenants = tuple(Tenant(path.stem, read_secret(path), _account_on_file(path))
                    for path in sorted((directory / TENANTS).glob("*.password")))  # fmt: skip
    pid_file = last.get("pid_file")
    return ServerConfig(last.get("listen", f"127.0.0.1:{DEFAULTS.nats_port}"),
                        read_secret(service), read_secret(events), read_secret(spare), tenants,
                        None if pid_file is None else Path(pid_file))  # fmt: skip


def _account_on_file(password: Path) -> str:
    """The account a tenant took when it was added ("": one added before the spare accounts,
    whose account is named as its user)."""
    path = password.with_suffix(".account")
    return read_secret(path) if path.exists() else ""


def _loaded(config: Path) -> tuple[dict[str, str], set[str]]:
    """Of the configuration at `config`: the tenants whose import it holds, with their
    passwords, and the names of all its accounts."""
    try:
        accounts = json.loads(config.read_text())["accounts"]
    except FileNotFoundError:
        return {}, set()
    wired = {user["user"].removeprefix(TENANT_USER): user["password"]
             for account in accounts.values() if account.get("imports")
             for user in account["users"]}  # fmt: skip
    return wired, set(accounts)


def _new_account() -> str:
    return f"account-{secrets.token_hex(6)}"  # no tenant's: theirs begin with TENANT_USER


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
