"""Who may talk to Pensieve over NATS, decided by NATS itself.

Every process that connects takes its credentials from flags or the environment (read here and
nowhere else): a user and password, a token, an nkey seed, a credentials file, TLS files.
Secrets come from the environment or from files only, never from argv.

The nats-server that `pensieve serve` starts (unless --insecure) runs with accounts, generated under
<data-dir>/nats/ (a folder of mode 0700, every file in it 0600):

    service.password           the engine's actors: user `pensieve` of account `service`
    events.password            the scheduler's watch on closed connections (system account)
    tenants/<name>.password    tenant <name>: the bcrypt hash of user `tenant-<name>`'s
                               password (or <name>.nkey: its nkey's public key), in the
                               account named in tenants/<name>.account
    spare.account              the empty account the next tenant takes
    nats-server.conf           generated from the files above (JSON, which nats-server reads;
                               its shape: ops/nats_config.py)

    alice's account                                       account service
    publishes pensieve.v1.chat  ---(service import)--->  pensieve.tenant.alice.v1.chat
    subscribes _INBOX.alice.>   <--(streamed replies)--  the engine answers the reply subject

So the tenant is named by the subject NATS delivers (`tenant_of`), never by a field of the
request. Accounts share nothing but that import: a tenant cannot see another's requests or
replies, and only the service account holds the API and internal subjects.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import secrets
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pensieve.actors.wire.subjects import check_tenant_name, tenant_of, tenant_subject

if TYPE_CHECKING:  # the bus imports nats, which the command line's parser does without
    from pensieve.actors.wire.bus import ConnectOptions

__all__ = ["check_tenant_name", "tenant_of", "tenant_subject"]  # named here for the accounts

SERVICE_USER = "pensieve"
SERVICE_ACCOUNT = "service"
EVENTS_USER = "pensieve-events"  # of the system account: hears of closed connections
_USERINFO = re.compile(r"(\w+://)([^@/,\s]+)@")

# the environment variables, one per option; flags win over them
ENV_USER = "PENSIEVE_NATS_USER"
ENV_PASSWORD = "PENSIEVE_NATS_PASSWORD"
ENV_PASSWORD_FILE = "PENSIEVE_NATS_PASSWORD_FILE"
ENV_TOKEN = "PENSIEVE_NATS_TOKEN"
ENV_TOKEN_FILE = "PENSIEVE_NATS_TOKEN_FILE"
ENV_NKEY_SEED = "PENSIEVE_NATS_NKEY_SEED"
ENV_CREDS = "PENSIEVE_NATS_CREDS"
ENV_TLS_CA = "PENSIEVE_NATS_TLS_CA"
ENV_TLS_CERT = "PENSIEVE_NATS_TLS_CERT"
ENV_TLS_KEY = "PENSIEVE_NATS_TLS_KEY"
ENV_EVENTS_PASSWORD_FILE = "PENSIEVE_NATS_EVENTS_PASSWORD_FILE"


def redact_url(url: str) -> str:
    """`url` (or a comma-separated list of them) fit for a log: a password or token in it is
    replaced by ***."""

    def hide(match: re.Match[str]) -> str:
        user, colon, _ = match.group(2).partition(":")
        return f"{match.group(1)}{user}:***@" if colon else f"{match.group(1)}***@"

    return _USERINFO.sub(hide, url)


def new_secret() -> str:
    return secrets.token_urlsafe(24)  # 192 bits; URL-safe, so nothing to quote anywhere


# ---- one process's credentials ------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    ca: Path | None = None  # the server's CA (default: the system's)
    cert: Path | None = None  # this client's certificate, with its key
    key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--nats-tls-cert and --nats-tls-key go together")

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca)
        if self.cert is not None:
            context.load_cert_chain(self.cert, self.key)
        return context


@dataclass(frozen=True)
class NatsAuth:
    """How one process proves who it is to NATS: user and password, a token, an nkey seed file
    or a credentials file (one of these at most), and TLS files."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    nkey_seed: Path | None = None
    creds: Path | None = None
    tls: TlsFiles | None = None
    inbox_prefix: str = "_INBOX"

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise ValueError(
                f"a NATS user needs its password and a password its user: --nats-user or "
                f"${ENV_USER}, with ${ENV_PASSWORD} or --nats-password-file"
            )
        ways = [self.user, self.token, self.nkey_seed, self.creds]
        if sum(way is not None for way in ways) > 1:
            raise ValueError("NATS credentials: a user, a token, an nkey seed or a creds file")
        if (self.nkey_seed or self.creds) and importlib.util.find_spec("nkeys") is None:
            raise ValueError("an nkey seed or a creds file needs the nkeys package (pip install)")

    def connect_options(self) -> ConnectOptions:
        from pensieve.actors.wire.bus import ConnectOptions

        return ConnectOptions(
            user=self.user,
            password=self.password,
            token=self.token,
            nkeys_seed=None if self.nkey_seed is None else str(self.nkey_seed),
            user_credentials=None if self.creds is None else str(self.creds),
            tls=None if self.tls is None else self.tls.context(),
            inbox_prefix=self.inbox_prefix,
        )


def add_connect_args(parser: argparse.ArgumentParser) -> None:
    """The options that say who this process is to the NATS server (`nats_auth_from_args`)."""
    group = parser.add_argument_group(
        "NATS credentials",
        f"secrets only from files or the environment (${ENV_PASSWORD}, ${ENV_TOKEN})",
    )
    options = [
        ("--nats-user", "USER", f"user name (${ENV_USER})"),
        ("--nats-password-file", "FILE", f"the user's password (${ENV_PASSWORD_FILE})"),
        ("--nats-token-file", "FILE", f"an authentication token (${ENV_TOKEN_FILE})"),
        ("--nats-nkey-seed", "FILE", f"an nkey seed file (${ENV_NKEY_SEED}; needs nkeys)"),
        ("--nats-creds", "FILE", f"a .creds file of a JWT user (${ENV_CREDS}; needs nkeys)"),
        ("--nats-tls-ca", "FILE", f"CA of the server's certificate (${ENV_TLS_CA})"),
        ("--nats-tls-cert", "FILE", f"client certificate (${ENV_TLS_CERT})"),
        ("--nats-tls-key", "FILE", f"the client certificate's key (${ENV_TLS_KEY})"),
    ]
    for flag, metavar, text in options:
        group.add_argument(flag, metavar=metavar, help=text)
    for flag in ("--nats-password", "--nats-token"):  # else argparse takes them for *-file
        group.add_argument(flag, action=_RefuseSecret, help=argparse.SUPPRESS)


class _RefuseSecret(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        parser.error(
            f"{self.option_strings[0]} would show the secret to every user of this "
            f"host: use ${ENV_PASSWORD}, ${ENV_TOKEN} or a file"
        )


def nats_auth_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> NatsAuth | None:
    """The credentials that flags (first) and the environment give; None: none given."""
    url = getattr(args, "nats_url", None) or ""
    if redact_url(url) != url:
        raise ValueError(
            "--nats-url must not hold credentials (argv is visible to every user): use "
            f"--nats-user with ${ENV_PASSWORD} or --nats-password-file, or --nats-token-file"
        )

    def given(flag: str, env: str) -> str | None:
        return getattr(args, flag, None) or environ.get(env) or None

    def path(flag: str, env: str) -> Path | None:
        value = given(flag, env)
        return None if value is None else Path(value)

    password_file = path("nats_password_file", ENV_PASSWORD_FILE)
    token_file = path("nats_token_file", ENV_TOKEN_FILE)
    tls = TlsFiles(
        path("nats_tls_ca", ENV_TLS_CA),
        path("nats_tls_cert", ENV_TLS_CERT),
        path("nats_tls_key", ENV_TLS_KEY),
    )
    auth = NatsAuth(
        user=given("nats_user", ENV_USER),
        password=read_secret(password_file) if password_file else environ.get(ENV_PASSWORD),
        token=read_secret(token_file) if token_file else environ.get(ENV_TOKEN),
        nkey_seed=path("nats_nkey_seed", ENV_NKEY_SEED),
        creds=path("nats_creds", ENV_CREDS),
        tls=None if tls == TlsFiles() else tls,
    )
    return None if auth == NatsAuth() else auth


def add_events_args(parser: argparse.ArgumentParser) -> None:
    """The scheduler's watch on closed connections, on a NATS server you run
    (`events_auth_from_args`)."""
    parser.add_argument(
        "--nats-events-password-file",
        metavar="FILE",
        help=f"the password of user {EVENTS_USER} of the NATS server's system account "
        f"(`pensieve nats-config` writes it to DIR/nats/events.password; "
        f"${ENV_EVENTS_PASSWORD_FILE}): with it, a tenant's turns end when its connection "
        "closes. Default: none, they run to their end",
    )


def events_auth_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> NatsAuth | None:
    """Who the scheduler is to the system account, as flags or the environment say (None: it
    does not watch)."""
    path = getattr(args, "nats_events_password_file", None) or environ.get(ENV_EVENTS_PASSWORD_FILE)
    if not path:
        return None
    return NatsAuth(user=EVENTS_USER, password=read_secret(Path(path)))


def read_secret(path: Path) -> str:
    try:
        return path.read_text().rstrip("\r\n")
    except OSError as error:
        raise OSError(f"cannot read {path}: {error.strerror}") from None


# ---- the nats-server started here: accounts, or --insecure -----------------------------------


def add_embedded_args(parser: argparse.ArgumentParser) -> None:
    """--insecure: the nats-server started here asks nobody who they are."""
    group = parser.add_argument_group("NATS authentication of the nats-server started here")
    group.add_argument(
        "--insecure",
        action="store_true",
        help="no authentication (loopback only): anyone on this host reads and writes every "
        "conversation. Without it the server has accounts for the service and each tenant, "
        "generated into DATA_DIR/nats (0600); a tenant connects with the JSON line of "
        "`pensieve tenant add`",
    )


def auth_data_dir(args: argparse.Namespace, data_dir: Path) -> Path | None:
    """The data dir whose nats/ folder the nats-server started here takes its accounts from;
    None: it runs open (--insecure), or none is started (--nats-url)."""
    insecure = getattr(args, "insecure", False)
    if getattr(args, "nats_url", None):
        if insecure:
            raise ValueError(
                "--insecure is for the nats-server started here, and --nats-url "
                "starts none: use the NATS credentials options"
            )
        return None
    return None if insecure else data_dir
