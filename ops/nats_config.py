"""The configuration of a nats-server with accounts: the service's, each tenant's, the system
account's watcher, and the spare (ops/nats_accounts.py keeps them on file and reloads a server).

    account service        user pensieve: the engine's actors; exports the API to each tenant
    account system         user pensieve-events: hears of closed connections, and no more
    account reload         user pensieve-reload: nothing; its password changes with every
                           configuration written, so a login with it says a reload took
    account <tenant's>     user tenant-<name> with a password (its bcrypt hash: the server
                           never sees the password itself), or an nkey: imports the API
    account <spare>        empty: the next tenant added takes it (see `nats_accounts._reload`)
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt

from pensieve.actors.wire.bus import DISCONNECTS
from pensieve.actors.wire.subjects import PREFIX
from pensieve.ops.nats_auth import EVENTS_USER, SERVICE_ACCOUNT, SERVICE_USER, tenant_subject

RELOAD_USER = "pensieve-reload"
SYSTEM_ACCOUNT = "system"
RELOAD_ACCOUNT = "reload"
TENANT_USER = "tenant-"  # + the tenant's name: its user's name (user names are server-wide)
# the longest silence within one streamed answer (a turn queued for admission, say): past it
# the server forgets where the rest of the answer goes
RESPONSE_THRESHOLD = "10m"
NOTHING = {"publish": {"deny": [">"]}, "subscribe": {"deny": [">"]}}
BCRYPT_COST = 11


@dataclass(frozen=True)
class Tenant:
    """A tenant, who logs in with a password (whose bcrypt hash alone the server knows) or with
    an nkey (whose public key alone it knows)."""

    name: str
    password: str = field(default="", repr=False)  # a bcrypt hash (see `hash_password`)
    nkey: str = ""  # the public key of its nkey ("": it has a password)
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
        return {
            "service": tenant_subject(self.name, f"{PREFIX}.>"),
            "response_type": "stream",
            "response_threshold": RESPONSE_THRESHOLD,
            "accounts": [self.account],
        }

    def account_config(self) -> dict[str, Any]:
        """Its account: it publishes the plain API subjects, which its import maps to its own
        subjects of the service account, and subscribes to its own inbox only."""
        permissions = {
            "publish": {"allow": [f"{PREFIX}.>"]},
            "subscribe": {"allow": [f"{self.inbox_prefix}.>"]},
        }
        login = {"nkey": self.nkey} if self.nkey else {"user": self.user, "password": self.password}
        api = {"account": SERVICE_ACCOUNT, "subject": tenant_subject(self.name, f"{PREFIX}.>")}
        # share: each request names the connection it came from (`incoming.requester`)
        imports = [{"service": api, "to": f"{PREFIX}.>", "share": True}] if self.wired else []
        return {"users": [{**login, "permissions": permissions}], "imports": imports}

    def connect_kwargs(self, servers: list[str], secret: str) -> dict[str, Any]:
        """The keyword arguments of nats-py's `nats.connect()` for this tenant, whose `secret`
        is its password or its nkey's private seed, neither kept anywhere."""
        login = {"nkeys_seed_str": secret} if self.nkey else {"user": self.user, "password": secret}
        return {"servers": servers, **login, "inbox_prefix": self.inbox_prefix}


@dataclass(frozen=True)
class ServerConfig:
    """A nats-server configuration with accounts (see the module's docstring)."""

    listen: str  # host:port
    service_password: str = field(repr=False)
    events_password: str = field(repr=False)
    spare: str  # an account with nothing in it yet, which the next tenant added takes
    tenants: tuple[Tenant, ...] = ()
    pid_file: Path | None = None
    marker: str = field(default_factory=lambda: secrets.token_urlsafe(16), repr=False)

    def text(self) -> str:
        service = {
            "users": [{"user": SERVICE_USER, "password": self.service_password}],
            "exports": [t.export() for t in self.tenants if t.wired],
        }
        watcher = {
            "user": EVENTS_USER,
            "password": self.events_password,
            "permissions": {"publish": {"deny": [">"]}, "subscribe": {"allow": [DISCONNECTS]}},
        }
        marker = {"user": RELOAD_USER, "password": self.marker, "permissions": NOTHING}
        accounts: dict[str, Any] = {
            SERVICE_ACCOUNT: service,
            SYSTEM_ACCOUNT: {"users": [watcher]},
            RELOAD_ACCOUNT: {"users": [marker]},
        }
        accounts.update((t.account, t.account_config()) for t in self.tenants)
        accounts[self.spare] = {}
        config: dict[str, Any] = {
            "listen": self.listen,
            "accounts": accounts,
            "system_account": SYSTEM_ACCOUNT,
        }
        if self.pid_file is not None:
            config["pid_file"] = str(self.pid_file)
        return json.dumps(config, indent=2) + "\n"  # nats-server reads JSON as its own format

    @property
    def address(self) -> tuple[str, int]:
        """Where a client on this host reaches the server."""
        host, _, port = self.listen.rpartition(":")
        return ("127.0.0.1" if host in ("", "0.0.0.0") else host, int(port))


def hash_password(password: str) -> str:
    """The bcrypt hash of `password`, which nats-server takes in place of the password itself
    (a hash begins "$2"; cost 11, as `nats server passwd` makes them)."""
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=BCRYPT_COST)).decode()


def is_password_hash(text: str) -> bool:
    return text.startswith("$2")


def new_account() -> str:
    return f"account-{secrets.token_hex(6)}"  # no tenant's: theirs begin with TENANT_USER


def new_nkey() -> tuple[str, str]:
    """A new user nkey: its private seed and its public key (needs the nkeys package)."""
    try:
        import nkeys  # type: ignore[import-untyped]
    except ImportError:
        raise ValueError(
            "a tenant with an nkey needs the nkeys package: pip install nkeys"
        ) from None
    seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key
    return bytes(seed).decode(), bytes(public).decode()
