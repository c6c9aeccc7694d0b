"""The accounts of a nats-server run with authentication, kept on file: the service's, each
tenant's (the configuration's shape is in ops/nats_config.py).

They live under <data-dir>/nats/ (the layout and the subjects are in ops/nats_auth.py):
`EmbeddedNats(auth_data_dir=...)` starts a server from them; `add_tenant`, `rotate_tenant` and
`remove_tenant` (`pensieve tenant add|rotate|remove`) change the tenants, and reload a server
running from them.
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
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Any

from pensieve.actors.config import DEFAULTS
from pensieve.ops.nats_auth import (
    EVENTS_USER,
    SERVICE_USER,
    NatsAuth,
    check_tenant_name,
    new_secret,
    read_secret,
)
from pensieve.ops.nats_config import (
    RELOAD_USER,
    ServerConfig,
    Tenant,
    hash_password,
    is_password_hash,
    new_account,
    new_nkey,
)

logger = logging.getLogger("pensieve")

CONFIG = "nats-server.conf"
PID_FILE = "nats-server.pid"  # written by nats-server itself
SERVICE_PASSWORD = "service.password"
EVENTS_PASSWORD = "events.password"
SPARE = "spare.account"  # the name of the account the next tenant takes (see `_reload`)
# <name>.password (the bcrypt hash of its password) or <name>.nkey (its public key), and
# <name>.account
TENANTS = "tenants"
RELOAD_TIMEOUT_S = 10.0


class TenantAuth(Enum):
    """How a tenant logs in."""

    PASSWORD = "password"
    NKEY = "nkey"  # the server keeps only its public key; the seed is printed once


def nats_dir(data_dir: Path) -> Path:
    return data_dir.absolute() / "nats"


def write_server_config(data_dir: Path, listen: str, pid_file: bool) -> Path:
    """Write the configuration of a server on `listen` (host:port) from the files on file,
    making the service's password if there is none yet; returns its path. With `pid_file` the
    server records its pid, so that `add_tenant` can reload it."""
    with _locked(data_dir) as directory:
        config = replace(
            _on_file(directory), listen=listen, pid_file=directory / PID_FILE if pid_file else None
        )
        _write_private(directory / CONFIG, config.text())
    return directory / CONFIG


def service_connect_options(data_dir: Path) -> NatsAuth:
    """Who the engine's actors are to a server running from `data_dir`'s accounts."""
    return NatsAuth(user=SERVICE_USER, password=read_secret(nats_dir(data_dir) / SERVICE_PASSWORD))


def events_connect_options(data_dir: Path) -> NatsAuth:
    """Who the scheduler is to the same server's system account, to hear of closed
    connections (`Bus.on_disconnects`)."""
    return NatsAuth(user=EVENTS_USER, password=read_secret(nats_dir(data_dir) / EVENTS_PASSWORD))


def add_tenant(
    data_dir: Path,
    name: str,
    servers: str | None = None,
    auth: TenantAuth = TenantAuth.PASSWORD,
) -> dict[str, Any]:
    """Create tenant `name`: its password or nkey, and its account in the server's
    configuration, which a server running from `data_dir` takes before this returns. Returns the
    keyword arguments of `nats.connect()` for the tenant, at `servers` (comma-separated URLs;
    default: the server's own address)."""
    check_tenant_name(name)
    with _locked(data_dir) as directory:
        if (found := _login_file(directory, name)) is not None:
            raise ValueError(f"tenant {name} exists ({found})")
        _private_dir(directory / TENANTS)
        _write_private(directory / TENANTS / f"{name}.account", _on_file(directory).spare)
        _write_private(directory / SPARE, new_account())
        secret = _new_login(directory, name, auth)
        config = _take(data_dir, directory, f"tenant {name} added")
    return _connect_kwargs(config, name, servers, secret)


def rotate_tenant(data_dir: Path, name: str, servers: str | None = None) -> dict[str, Any]:
    """Give tenant `name` a new password or nkey, as `add_tenant` gives one: from when this
    returns its old one is refused, and the server has closed the connections made with it."""
    check_tenant_name(name)
    with _locked(data_dir) as directory:
        auth = TenantAuth(_existing(directory, name).suffix[1:])
        secret = _new_login(directory, name, auth)
        config = _take(data_dir, directory, f"tenant {name} has a new {auth.value}")
    return _connect_kwargs(config, name, servers, secret)


def remove_tenant(data_dir: Path, name: str) -> None:
    """Remove tenant `name`: from when this returns the server refuses it, and has closed its
    connections (their turns in flight are cancelled). Its conversations stay in the store,
    out of everyone's reach, until they expire; a tenant added later under the same name
    reaches them again."""
    check_tenant_name(name)
    with _locked(data_dir) as directory:
        _existing(directory, name).unlink()
        (directory / TENANTS / f"{name}.account").unlink(missing_ok=True)
        _take(data_dir, directory, f"tenant {name} removed")


def check_tenant(data_dir: Path, name: str) -> None:
    """ValueError unless tenant `name` is on file."""
    check_tenant_name(name)
    with _locked(data_dir) as directory:
        _existing(directory, name)


def list_tenants(data_dir: Path) -> list[str]:
    """The names of the tenants on file."""
    with _locked(data_dir) as directory:
        return [tenant.name for tenant in _on_file(directory).tenants]


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


def _new_login(directory: Path, name: str, auth: TenantAuth) -> str:
    """Write the bcrypt hash of tenant `name`'s new password, or its new nkey's public key;
    returns the password or the nkey's seed, which is kept nowhere."""
    path = directory / TENANTS / f"{name}.{auth.value}"
    if auth is TenantAuth.PASSWORD:
        password = new_secret()
        _write_private(path, hash_password(password))
        return password
    seed, public = new_nkey()
    _write_private(path, public)
    return seed


def _take(data_dir: Path, directory: Path, done: str) -> ServerConfig:
    """Write the configuration the files make, and have the server running from it (if any)
    take it."""
    config = _on_file(directory)
    pid = running_pid(data_dir)
    if pid is None:
        _write_private(directory / CONFIG, config.text())
        logger.info(
            "%s; no nats-server runs from %s: it takes this when it starts (one "
            "started otherwise: SIGHUP it)",
            done,
            directory,
        )
    else:
        _reload(directory, pid, config)
        logger.info("%s; nats-server (pid %d) reloaded", done, pid)
    return config


def _login_file(directory: Path, name: str) -> Path | None:
    """Where tenant `name`'s password or public key is (None: there is no such tenant)."""
    found = [directory / TENANTS / f"{name}.{auth.value}" for auth in TenantAuth]
    return next((path for path in found if path.exists()), None)


def _existing(directory: Path, name: str) -> Path:
    path = _login_file(directory, name)
    if path is None:
        raise ValueError(f"no tenant {name} (tenants: pensieve tenant list)")
    return path


def _connect_kwargs(
    config: ServerConfig, name: str, servers: str | None, secret: str
) -> dict[str, Any]:
    (tenant,) = [t for t in config.tenants if t.name == name]
    host, port = config.address
    urls = servers.split(",") if servers else [f"nats://{host}:{port}"]
    return tenant.connect_kwargs(urls, secret)


def _reload(directory: Path, pid: int, config: ServerConfig) -> None:
    """Make the nats-server `pid` run `config`, and wait until it does.

    nats-server (2.15) subscribes to the service imports of an account that a reload creates
    only at the next reload (its `configureAccounts` wires a new account's imports only when
    the server starts; a reload rewires those of the accounts it had already), and until then
    the tenant's requests find no responders. So the configuration always holds a spare
    account, empty, which the next tenant added takes (`add_tenant`): one reload gives it
    its user and its import. A tenant whose account the server does not have (added before
    there were spares) comes in two reloads: its account, with a throwaway password and no
    import, then its import and its own login."""
    try:
        loaded = set(json.loads((directory / CONFIG).read_text())["accounts"])
    except FileNotFoundError:
        loaded = set()
    unknown = [t for t in config.tenants if t.account not in loaded]
    if unknown:
        staged = tuple(
            replace(t, password=new_secret(), nkey="", wired=False) if t in unknown else t
            for t in config.tenants
        )
        _apply(directory, pid, replace(config, tenants=staged, marker=new_secret()))
    _apply(directory, pid, config)


def _apply(directory: Path, pid: int, config: ServerConfig) -> None:
    """Reload with `config`; returns once the server takes its marker's password (a reload
    takes a whole configuration, or none of it)."""
    _write_private(directory / CONFIG, config.text())
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    while not _takes(config.address, RELOAD_USER, config.marker):
        if time.monotonic() > deadline:
            raise OSError(
                f"nats-server (pid {pid}) did not take {directory / CONFIG} "
                f"within {RELOAD_TIMEOUT_S:.0f} s: see its log"
            )
        time.sleep(0.02)


def _takes(address: tuple[str, int], user: str, password: str) -> bool:
    """Whether the server at `address` takes `user`'s `password` (False while nothing
    listens there: a server that refused the reload may listen elsewhere)."""
    try:
        return _logs_in(address, user, password)
    except OSError:
        return False


def _logs_in(address: tuple[str, int], user: str, password: str) -> bool:
    """Whether the server takes `user`'s `password`: the client handshake (server INFO, client
    CONNECT, PING), to which it answers PONG, or -ERR and closes."""
    hello = json.dumps({"user": user, "pass": password, "verbose": False})
    with socket.create_connection(address, timeout=2.0) as sock, sock.makefile("rb") as lines:
        lines.readline()  # INFO {...}
        sock.sendall(f"CONNECT {hello}\r\nPING\r\n".encode())
        return lines.readline().startswith(b"PONG")


def _on_file(directory: Path) -> ServerConfig:
    """The configuration the files under `directory` make: the listen address and pid file of
    the last one written, the service's passwords and the spare's name (made now if missing),
    every tenant's login and account."""
    try:
        last = json.loads((directory / CONFIG).read_text())
    except FileNotFoundError:
        last = {}
    service, events, spare = (
        directory / SERVICE_PASSWORD,
        directory / EVENTS_PASSWORD,
        directory / SPARE,
    )
    for path, make in ((service, new_secret), (events, new_secret), (spare, new_account)):
        if not path.exists():
            _write_private(path, make())
    logins = sorted(
        path for auth in TenantAuth for path in (directory / TENANTS).glob(f"*.{auth.value}")
    )
    tenants = tuple(_tenant_on_file(path) for path in logins)
    pid_file = last.get("pid_file")
    return ServerConfig(
        last.get("listen", f"127.0.0.1:{DEFAULTS.nats_port}"),
        read_secret(service),
        read_secret(events),
        read_secret(spare),
        tenants,
        None if pid_file is None else Path(pid_file),
    )


def _tenant_on_file(login: Path) -> Tenant:
    """The tenant whose password's hash or public key is at `login`, in the account it took
    when it was added (one added before the spare accounts has none on file: its account is
    named as its user). A password kept in the clear (by an older version) is replaced by its
    hash here, and keeps working."""
    account = login.with_suffix(".account")
    kept = read_secret(account) if account.exists() else ""
    if login.suffix == ".nkey":
        return Tenant(login.stem, nkey=read_secret(login), account=kept)
    password = read_secret(login)
    if not is_password_hash(password):
        password = hash_password(password)
        _write_private(login, password)
    return Tenant(login.stem, password, account=kept)


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
