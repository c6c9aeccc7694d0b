"""`pensieve tenant` and `pensieve nats-config`: the accounts of the nats-server that
`pensieve serve` starts, and its configuration for a server run elsewhere."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from pensieve.actors.config import DEFAULTS
from pensieve.ops.cli_options import HelpFormatter, log_arg

TENANT_HELP = (
    "add, rotate, remove or list tenants: NATS accounts that reach only their own requests"
)
NATS_CONFIG_HELP = "write a nats-server configuration with the accounts, for a server run elsewhere"


def tenant_parser(commands: Any) -> None:
    tenant = commands.add_parser(
        "tenant",
        help=TENANT_HELP,
        description="Tenants of the nats-server that `pensieve serve` starts.",
    )
    actions = tenant.add_subparsers(required=True, metavar="ACTION")
    add = actions.add_parser(
        "add",
        help="create a tenant and print how it connects",
        description="Create tenant NAME and print (or with --out, write) one JSON line "
        '{"tenant": NAME, "nats": '
        '{...}, "http": {"api_key": ...}}, where "nats" is the keyword arguments of '
        "nats.connect() for it (servers, user and password or nkey seed, inbox prefix) and "
        '"api_key" its key for the HTTP API (kept only as a hash). A nats-server running '
        "from DIR is reloaded; one not yet started takes the tenant when it starts.",
        formatter_class=HelpFormatter,
    )
    add.add_argument("name", metavar="NAME", help="a-z 0-9 _ -, at most 64")
    add.add_argument(
        "--auth",
        choices=["password", "nkey"],
        default="password",
        help="how the tenant logs in: a password (kept in DIR), or an nkey, whose seed is in "
        "the printed line only and whose public key alone the server keeps (needs the nkeys "
        "package)",
    )
    _accounts_dir_arg(add)
    _tenant_url_arg(add)
    _out_arg(add)
    log_arg(add)
    add.set_defaults(run=_tenant_add)
    rotate = actions.add_parser(
        "rotate",
        help="give a tenant a new password and API key and print how it connects",
        description="Give tenant NAME a new password (or nkey, for a tenant with one) and HTTP "
        "API key, and print its JSON line, as `add` does. From when the command returns, a "
        "nats-server running from DIR refuses the old password and has closed the connections "
        "made with it, and the old API key is refused.",
        formatter_class=HelpFormatter,
    )
    rotate.add_argument("name", metavar="NAME", help="the tenant")
    _accounts_dir_arg(rotate)
    _tenant_url_arg(rotate)
    _out_arg(rotate)
    log_arg(rotate)
    rotate.set_defaults(run=_tenant_rotate)
    remove = actions.add_parser(
        "remove",
        help="remove a tenant: its credentials stop working",
        description="Remove tenant NAME. From when the command returns, a nats-server running "
        "from DIR refuses its password and has closed its connections (their turns in flight "
        "are cancelled), and its HTTP API key is refused; a server not yet started never "
        "takes it. Its conversations stay in "
        "the store, out of everyone's reach, until they expire; a tenant added again under "
        "the same name reaches them.",
        formatter_class=HelpFormatter,
    )
    remove.add_argument("name", metavar="NAME", help="the tenant")
    _accounts_dir_arg(remove)
    log_arg(remove)
    remove.set_defaults(run=_tenant_remove)
    listing = actions.add_parser(
        "list",
        help="list the tenants",
        description='One JSON line {"tenant": NAME} per tenant (no secrets).',
        formatter_class=HelpFormatter,
    )
    _accounts_dir_arg(listing)
    log_arg(listing)
    listing.set_defaults(run=_tenant_list)


def nats_config_parser(commands: Any) -> None:
    config = commands.add_parser(
        "nats-config",
        help=NATS_CONFIG_HELP,
        description="Write DIR/nats/nats-server.conf, with the accounts of the service and of "
        "each tenant, and the service's password (DIR/nats/service.password) if there is none, "
        "for a nats-server started elsewhere (compose.yaml): nats-server -c "
        "DIR/nats/nats-server.conf.",
        formatter_class=HelpFormatter,
    )
    _accounts_dir_arg(config)
    config.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default=f"127.0.0.1:{DEFAULTS.nats_port}",
        help="where the server listens (0.0.0.0:PORT: every interface, as in a container)",
    )
    log_arg(config)
    config.set_defaults(run=_nats_config)


def _accounts_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="the data dir of the engine, whose nats/ folder holds the accounts (default: "
        "that of pensieve serve)",
    )


def _tenant_url_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nats-url",
        metavar="URL",
        help="where the tenant connects (default: the server's own address)",
    )


def _out_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        type=Path,
        metavar="FILE",
        help="write the line to FILE, readable by you alone (mode 0600; replaced if there), "
        "instead of printing it",
    )


def _give(args: argparse.Namespace, line: dict[str, Any]) -> None:
    """The tenant's line: printed, or into --out's file, which is this user's alone from its
    first byte on (a shell's `> FILE` leaves it as readable as the umask lets)."""
    text = json.dumps(line) + "\n"
    if args.out is None:
        print(text, end="", flush=True)
        return
    path: Path = args.out
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)  # a leftover temporary file may be wider
        out.write(text)
    os.replace(temporary, path)
    print(
        f"pensieve: tenant {args.name}'s line in {path} (mode 0600): pensieve chat --tenant {path}",
        file=sys.stderr,
    )


def _tenant_add(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.api_keys import new_api_key
    from pensieve.ops.nats_accounts import TenantAuth, add_tenant
    from pensieve.ops.serve import default_data_dir

    data_dir = args.data_dir or default_data_dir()
    nats = add_tenant(data_dir, args.name, args.nats_url, TenantAuth(args.auth))
    http = {"api_key": new_api_key(data_dir, args.name)}
    _give(args, {"tenant": args.name, "nats": nats, "http": http})
    return 0


def _tenant_rotate(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.api_keys import new_api_key
    from pensieve.ops.nats_accounts import check_tenant, rotate_tenant
    from pensieve.ops.serve import default_data_dir

    data_dir = args.data_dir or default_data_dir()
    check_tenant(data_dir, args.name)
    # the key first, as in `remove`: a failed NATS reload leaves no old key working (and the
    # new one unprinted: run rotate again)
    http = {"api_key": new_api_key(data_dir, args.name, replace=True)}
    nats = rotate_tenant(data_dir, args.name, args.nats_url)
    _give(args, {"tenant": args.name, "nats": nats, "http": http})
    return 0


def _tenant_remove(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.api_keys import remove_api_key
    from pensieve.ops.nats_accounts import remove_tenant
    from pensieve.ops.serve import default_data_dir

    data_dir = args.data_dir or default_data_dir()
    # the key first: a NATS reload that fails must not leave the HTTP API open to the tenant
    remove_api_key(data_dir, args.name)
    try:
        remove_tenant(data_dir, args.name)
    except OSError as error:
        raise OSError(
            f"tenant {args.name}: its API key is refused and its NATS login is gone from "
            f"{data_dir}, but the running nats-server did not take that ({error}); it takes "
            "the login until it does: fix its configuration and restart it"
        ) from None
    return 0


def _tenant_list(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.nats_accounts import list_tenants
    from pensieve.ops.serve import default_data_dir

    for name in list_tenants(args.data_dir or default_data_dir()):
        print(json.dumps({"tenant": name}), flush=True)
    return 0


def _nats_config(args: argparse.Namespace, started: float) -> int:
    from pensieve.ops.nats_accounts import write_server_config
    from pensieve.ops.serve import default_data_dir

    path = write_server_config(args.data_dir or default_data_dir(), args.listen, pid_file=False)
    print(
        f"pensieve: nats-server configuration in {path}; the service's password in "
        f"{path.parent / 'service.password'}",
        file=sys.stderr,
    )
    return 0
