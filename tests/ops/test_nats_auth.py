"""NATS authentication and tenants, against a real nats-server: who may connect, what a tenant
reaches, and where secrets are never to be found."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import bcrypt
import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from pensieve.actors.config import DEFAULTS
from pensieve.actors.ingress.openai_api import OpenAIError
from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.incoming import REQUEST_INFO_HEADER, requester
from pensieve.actors.wire.subjects import CHAT, CONVERSATIONS_GET
from pensieve.ops.api_keys import ApiKeys
from pensieve.ops.chat import tenant_options
from pensieve.ops.cli import main
from pensieve.ops.nats_accounts import (
    add_tenant,
    nats_dir,
    service_connect_options,
    write_server_config,
)
from pensieve.ops.nats_auth import (
    NatsAuth,
    TlsFiles,
    add_connect_args,
    add_events_args,
    events_auth_from_args,
    nats_auth_from_args,
    redact_url,
    tenant_of,
    tenant_subject,
)
from pensieve.ops.nats_server import EmbeddedNats, find_binary, free_port

NUM_PARTS = 3  # messages in each streamed answer of the fake service


def tenant_add(data_dir: Path, name: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """`pensieve tenant add`: its one JSON line's connect kwargs; nothing secret on stderr."""
    assert main(["tenant", "add", name, "--data-dir", str(data_dir)]) == 0
    out, err = capsys.readouterr()
    (line,) = out.splitlines()
    printed = json.loads(line)
    assert printed["tenant"] == name
    assert printed["nats"]["password"] not in err
    return printed["nats"]


async def connect_tenant(kwargs: dict[str, Any], url: str, errors: list[Exception]) -> Client:
    async def on_error(error: Exception) -> None:
        errors.append(error)

    return await nats.connect(**{**kwargs, "servers": [url]}, error_cb=on_error)


@asynccontextmanager
async def fake_service(server: EmbeddedNats, received: list[Msg]) -> AsyncIterator[Bus]:
    """The service's identity answering every tenant's chat request with NUM_PARTS messages,
    each naming the tenant NATS delivered it from."""
    assert server.service_auth is not None
    bus = await Bus.connect(server.url, options=server.service_auth.connect_options())

    async def answer(msg: Msg) -> None:
        received.append(msg)
        for part in range(NUM_PARTS):
            await bus.client.publish(msg.reply, f"{tenant_of(msg.subject)} {part}".encode())

    await bus.client.subscribe(tenant_subject("*", CHAT), cb=answer)
    await bus.flush()
    try:
        yield bus
    finally:
        await bus.close()


async def ask(client: Client, subject: str = CHAT) -> list[bytes]:
    """One request, and every part of its streamed answer."""
    inbox = client.new_inbox()
    sub = await client.subscribe(inbox)
    await client.publish(subject, b"{}", reply=inbox)
    parts = [(await sub.next_msg(timeout=5)).data for _ in range(NUM_PARTS)]
    await sub.unsubscribe()
    return parts


def test_a_client_without_credentials_or_with_a_wrong_password_is_refused(tmp_path: Path) -> None:
    async def refused(url: str, **credentials: str) -> str:
        async def quiet(error: Exception) -> None:
            pass

        with pytest.raises(nats.errors.Error) as refusal:
            await nats.connect(url, allow_reconnect=False, error_cb=quiet, **credentials)
        return str(refusal.value)

    async def go(server: EmbeddedNats) -> None:
        assert "Authorization Violation" in await refused(server.url)
        wrong = {"user": "pensieve", "password": "not-the-password"}
        assert "Authorization Violation" in await refused(server.url, **wrong)

    with EmbeddedNats(auth_data_dir=tmp_path) as server:
        asyncio.run(go(server))


def test_a_tenant_reaches_the_service_on_its_own_subject_with_the_plain_api(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    alice = tenant_add(tmp_path, "alice", capsys)  # before the server starts
    assert set(alice) == {"servers", "user", "password", "inbox_prefix"}

    async def go(server: EmbeddedNats) -> None:
        received: list[Msg] = []
        async with fake_service(server, received):
            client = await connect_tenant(alice, server.url, [])
            assert await ask(client) == [f"alice {part}".encode() for part in range(NUM_PARTS)]
            # the connection a request names is nats-server's word, not the client's
            inbox = client.new_inbox()
            sub = await client.subscribe(inbox)
            forged = {REQUEST_INFO_HEADER: '{"server": "elsewhere", "id": 1}'}
            await client.publish(CHAT, b"{}", reply=inbox, headers=forged)
            await sub.next_msg(timeout=5)
            await client.close()
        msg, again = received
        assert msg.subject == tenant_subject("alice", CHAT) == "pensieve.tenant.alice.v1.chat"
        sender = requester(dict(msg.headers or {}))
        assert sender is not None and sender == requester(dict(again.headers or {}))
        assert sender != "elsewhere/1"

    with EmbeddedNats(auth_data_dir=tmp_path) as server:
        asyncio.run(go(server))


def test_a_tenant_sees_nothing_of_another_and_cannot_answer_for_the_service(
    tmp_path: Path,
) -> None:
    alice, bob = add_tenant(tmp_path, "alice"), add_tenant(tmp_path, "bob")

    async def go(server: EmbeddedNats) -> None:
        received: list[Msg] = []
        async with fake_service(server, received) as service:
            internal = await service.client.subscribe("pensieve.internal.>")
            alices = await service.client.subscribe(tenant_subject("alice", CONVERSATIONS_GET))
            await service.flush()
            a_client = await connect_tenant(alice, server.url, [])
            refusals: list[Exception] = []
            b_client = await connect_tenant(bob, server.url, refusals)
            # bob listens everywhere it might overhear alice, or take her requests
            spies = [
                await b_client.subscribe(subject)
                for subject in (">", CHAT, "pensieve.tenant.>", f"{alice['inbox_prefix']}.>")
            ]
            await b_client.flush()
            assert await ask(a_client) == [f"alice {part}".encode() for part in range(NUM_PARTS)]
            # ... and speaks where only the service, or alice, may
            await b_client.publish("pensieve.internal.e1.executor.step", b"{}")
            await b_client.publish(tenant_subject("alice", CONVERSATIONS_GET), b"{}")
            await b_client.publish(f"{alice['inbox_prefix']}.forged", b"as the service")
            await b_client.flush()
            # what bob asks reaches the service as bob's, whatever the request says
            assert await ask(b_client) == [f"bob {part}".encode() for part in range(NUM_PARTS)]
            await asyncio.sleep(0.2)  # room for anything misrouted to arrive
            assert [spy.pending_msgs for spy in spies] == [0, 0, 0, 0]
            assert internal.pending_msgs == 0 and alices.pending_msgs == 0
            assert [tenant_of(msg.subject) for msg in received] == ["alice", "bob"]
            violations = " ".join(str(error) for error in refusals).lower()
            assert "permissions violation for subscription" in violations
            assert "permissions violation for publish" in violations
            await a_client.close()
            await b_client.close()

    with EmbeddedNats(auth_data_dir=tmp_path) as server:
        asyncio.run(go(server))


def test_a_tenant_added_while_the_server_runs_is_served_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tenant add` reloads the running server; a stream in flight meanwhile goes on."""
    alice = add_tenant(tmp_path, "alice")

    async def go(server: EmbeddedNats) -> None:
        assert server.service_auth is not None
        bus = await Bus.connect(server.url, options=server.service_auth.connect_options())
        added = asyncio.Event()

        async def answer(msg: Msg) -> None:
            await bus.client.publish(msg.reply, b"before")
            await added.wait()
            await bus.client.publish(msg.reply, b"after")

        await bus.client.subscribe(tenant_subject("alice", CHAT), cb=answer)
        await bus.flush()
        a_client = await connect_tenant(alice, server.url, [])
        inbox = a_client.new_inbox()
        sub = await a_client.subscribe(inbox)
        await a_client.publish(CHAT, b"{}", reply=inbox)
        assert (await sub.next_msg(timeout=5)).data == b"before"
        carol = await asyncio.to_thread(tenant_add, tmp_path, "carol", capsys)
        added.set()
        assert (await sub.next_msg(timeout=5)).data == b"after"
        await bus.close()
        received: list[Msg] = []
        async with fake_service(server, received):
            c_client = await connect_tenant(carol, server.url, [])
            assert await ask(c_client) == [f"carol {part}".encode() for part in range(NUM_PARTS)]
            await c_client.close()
        await a_client.close()

    with EmbeddedNats(auth_data_dir=tmp_path) as server:
        asyncio.run(go(server))


def test_a_removed_tenant_is_refused_and_a_rotated_one_takes_only_its_new_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tenant remove` and `tenant rotate`, before the server starts and while it runs: the
    old credentials connect no more, and their connections are closed."""
    alice, bob = tenant_add(tmp_path, "alice", capsys), tenant_add(tmp_path, "bob", capsys)
    tenant_add(tmp_path, "carol", capsys)
    assert main(["tenant", "remove", "carol", "--data-dir", str(tmp_path)]) == 0

    async def dropped(client: Client) -> bool:  # by the server; it does not get back in
        for _ in range(100):
            if not client.is_connected:
                await asyncio.sleep(0.5)
                connected = client.is_connected
                await client.close()
                return not connected
            await asyncio.sleep(0.02)
        return False

    async def go(server: EmbeddedNats) -> None:
        received: list[Msg] = []
        async with fake_service(server, received):
            assert await _refused(carol, server.url)
            a_client = await connect_tenant(alice, server.url, [])
            b_client = await connect_tenant(bob, server.url, [])
            assert await ask(b_client) == [f"bob {part}".encode() for part in range(NUM_PARTS)]
            rotated = await asyncio.to_thread(rotate, "alice")
            assert rotated["password"] != alice["password"]
            assert await _refused(alice, server.url) and await dropped(a_client)
            await asyncio.to_thread(main, ["tenant", "remove", "bob", "--data-dir", str(tmp_path)])
            assert await _refused(bob, server.url) and await dropped(b_client)
            again = await connect_tenant(rotated, server.url, [])
            assert await ask(again) == [f"alice {part}".encode() for part in range(NUM_PARTS)]
            await again.close()

    def rotate(name: str) -> dict[str, Any]:
        assert main(["tenant", "rotate", name, "--data-dir", str(tmp_path)]) == 0
        return dict(json.loads(capsys.readouterr().out)["nats"])

    carol = {**alice, "user": "tenant-carol"}  # any password: none is taken
    with EmbeddedNats(auth_data_dir=tmp_path) as server:
        asyncio.run(go(server))
    capsys.readouterr()
    assert main(["tenant", "list", "--data-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == ['{"tenant": "alice"}']
    assert main(["tenant", "remove", "bob", "--data-dir", str(tmp_path)]) == 2
    assert "no tenant bob" in capsys.readouterr().err


def test_a_tenant_added_to_a_server_run_elsewhere_is_served_after_one_reload(
    tmp_path: Path,
) -> None:
    """A nats-server started from `pensieve nats-config`'s file takes a tenant added meanwhile
    with one SIGHUP (the account the tenant takes is in the file it runs from already)."""
    port = free_port()
    config = write_server_config(tmp_path, f"127.0.0.1:{port}", pid_file=False)
    server = subprocess.Popen([find_binary(), "-c", str(config)], stderr=subprocess.DEVNULL)
    url = f"nats://127.0.0.1:{port}"

    async def go() -> None:
        service = service_connect_options(tmp_path).connect_options()
        bus = await Bus.connect(url, options=service)

        async def answer(msg: Msg) -> None:
            await bus.client.publish(msg.reply, tenant_of(msg.subject).encode())

        await bus.client.subscribe(tenant_subject("*", CHAT), cb=answer)
        await bus.flush()
        for name in ("alice", "bob"):
            kwargs = add_tenant(tmp_path, name)  # no server runs from tmp_path: none reloaded
            server.send_signal(signal.SIGHUP)
            client = await logged_in(kwargs, url)
            assert await answered(client, CHAT) == name.encode()
            await client.close()
        await bus.close()

    try:
        wait_for_port(port)
        asyncio.run(go())
    finally:
        server.terminate()
        server.wait()


async def logged_in(kwargs: dict[str, Any], url: str) -> Client:
    """A client of the tenant, once the server takes its password (after a reload)."""

    async def quiet(error: Exception) -> None:
        pass

    for _ in range(250):
        try:
            return await nats.connect(
                **{**kwargs, "servers": [url]}, allow_reconnect=False, error_cb=quiet
            )
        except (nats.errors.Error, OSError):  # refused; a refusal can also reset the socket
            await asyncio.sleep(0.02)
    raise AssertionError("the tenant never logged in")


async def answered(client: Client, subject: str) -> bytes:
    """The answer to a request of a tenant that logged in while its reload was under way:
    nats-server takes the new login (its users are swapped in) before it has moved the service's
    subscriptions onto the accounts the reload made again, and a request meanwhile is dropped.
    No other reload comes: the one sent must do."""
    for _ in range(10):
        try:
            return (await client.request(subject, b"{}", timeout=2)).data
        except nats.errors.TimeoutError:
            pass
    raise AssertionError(f"nothing answered {subject} after the reload")


def wait_for_port(port: int) -> None:
    for _ in range(250):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise AssertionError(f"nothing listens on {port}")


def test_a_tenant_with_an_nkey_connects_with_its_line_and_the_server_keeps_no_secret_of_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tenant add --auth nkey`: the line's seed logs in, before and while the server runs; the
    data dir holds the public key alone; `rotate` gives a new seed and the old one is refused."""

    def add(name: str) -> dict[str, Any]:
        assert main(["tenant", "add", name, "--auth", "nkey", "--data-dir", str(tmp_path)]) == 0
        line = json.loads(capsys.readouterr().out)
        assert set(line["nats"]) == {"servers", "nkeys_seed_str", "inbox_prefix"}
        return dict(line["nats"])

    alice = add("alice")
    stored = (nats_dir(tmp_path) / "tenants" / "alice.nkey").read_text()
    assert stored.startswith("U") and alice["nkeys_seed_str"].startswith("SU")
    for path in nats_dir(tmp_path).rglob("*"):
        assert not path.is_file() or alice["nkeys_seed_str"] not in path.read_text()
    line = tmp_path / "alice.json"
    line.write_text(json.dumps({"tenant": "alice", "nats": alice}))
    server_url, options = tenant_options(line)  # what `pensieve chat --tenant` reads
    assert options.nkeys_seed_str == alice["nkeys_seed_str"] and options.user is None

    async def go(server: EmbeddedNats) -> None:
        received: list[Msg] = []
        async with fake_service(server, received):
            for name, kwargs in (("alice", alice), ("bob", await asyncio.to_thread(add, "bob"))):
                client = await nats.connect(**{**kwargs, "servers": [server.url]})
                assert await ask(client) == [f"{name} {part}".encode() for part in range(NUM_PARTS)]
                await client.close()
            argv = ["tenant", "rotate", "alice", "--data-dir", str(tmp_path)]
            assert await asyncio.to_thread(main, argv) == 0
            rotated = json.loads(capsys.readouterr().out)["nats"]
            assert rotated["nkeys_seed_str"] != alice["nkeys_seed_str"]
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await nats.connect(**{**alice, "servers": [server.url]}, allow_reconnect=False)
            client = await nats.connect(**{**rotated, "servers": [server.url]})
            assert await ask(client) == [f"alice {part}".encode() for part in range(NUM_PARTS)]
            await client.close()

    with EmbeddedNats(auth_data_dir=tmp_path) as server:
        assert server_url == f"nats://127.0.0.1:{DEFAULTS.nats_port}"
        asyncio.run(go(server))


def test_secrets_stay_in_private_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Not in the server's argv, not in any log line; files 0600 in a folder of 0700."""
    caplog.set_level(logging.INFO, logger="pensieve")
    with EmbeddedNats(auth_data_dir=tmp_path) as server:
        assert server.service_auth is not None and server.service_auth.password
        tenant = add_tenant(tmp_path, "alice")
        assert server._process is not None
        argv = Path(f"/proc/{server._process.pid}/cmdline").read_bytes().decode()
    secrets = [server.service_auth.password, tenant["password"]]
    logged = caplog.text
    assert str(nats_dir(tmp_path)) in logged  # where the credentials are is said
    for secret in secrets:
        assert secret not in argv and secret not in logged
        assert secret not in repr(server.service_auth)
    folder = nats_dir(tmp_path)
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "tenants").stat().st_mode & 0o777 == 0o700
    files = [path for path in folder.rglob("*") if path.is_file()]
    assert {"nats-server.conf", "service.password", "alice.password"} <= {p.name for p in files}
    assert {path.name: path.stat().st_mode & 0o777 for path in files} == {
        path.name: 0o600 for path in files
    }


def test_tenant_subjects_are_named_by_nats_not_by_the_client() -> None:
    assert tenant_subject("alice", CHAT) == "pensieve.tenant.alice.v1.chat"
    assert tenant_subject("*", CONVERSATIONS_GET) == "pensieve.tenant.*.v1.conversations.get"
    assert tenant_of("pensieve.tenant.alice.v1.conversations.get") == "alice"
    assert tenant_of(CHAT) is None and tenant_of("pensieve.tenant.alice") is None
    for bad in ("", "Alice", "a.b", "a>", "*"):
        with pytest.raises(ValueError):
            add_tenant(Path("unused"), bad)
    with pytest.raises(ValueError):
        tenant_subject("alice", "pensieve.internal.e1.executor.step")


def test_urls_in_logs_hide_passwords_and_tokens() -> None:
    assert redact_url("nats://u:secret@h:4222") == "nats://u:***@h:4222"
    both = "nats://tok@h:4222,tls://v:p@g:4223"
    assert redact_url(both) == "nats://***@h:4222,tls://v:***@g:4223"
    assert redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nats-url")
    add_connect_args(parser)
    add_events_args(parser)
    return parser.parse_args(argv)


def test_credentials_come_from_flags_files_and_the_environment(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("from-file\n")
    assert nats_auth_from_args(_parse(), {}) is None
    env = {"PENSIEVE_NATS_USER": "u", "PENSIEVE_NATS_PASSWORD": "from-env"}
    assert nats_auth_from_args(_parse(), env) == NatsAuth("u", "from-env")
    flags = _parse("--nats-user", "v", "--nats-password-file", str(secret))
    assert nats_auth_from_args(flags, env) == NatsAuth("v", "from-file")  # flags win
    token = nats_auth_from_args(_parse(), {"PENSIEVE_NATS_TOKEN": "t"})
    assert token is not None and token.connect_options().token == "t"
    for flag in ("--nats-password", "--nats-token"):  # no flag takes a secret itself
        with pytest.raises(SystemExit):
            _parse(flag, "x")
    with pytest.raises(ValueError, match="must not hold credentials"):
        nats_auth_from_args(_parse("--nats-url", "nats://u:p@h:4222"), {})
    with pytest.raises(ValueError, match="needs its password"):
        nats_auth_from_args(_parse("--nats-user", "u"), {})
    with pytest.raises(ValueError, match="a user, a token"):
        nats_auth_from_args(_parse(), {**env, "PENSIEVE_NATS_TOKEN": "t"})
    with pytest.raises(ValueError, match="go together"):
        TlsFiles(cert=secret)
    # the scheduler's watch on closed connections: a user of the system account
    assert events_auth_from_args(_parse(), {}) is None
    watch = NatsAuth("pensieve-events", "from-file")
    assert events_auth_from_args(_parse("--nats-events-password-file", str(secret)), {}) == watch
    assert events_auth_from_args(_parse(), {"PENSIEVE_NATS_EVENTS_PASSWORD_FILE": str(secret)}) == (
        watch
    )


def _self_signed(folder: Path, name: str, ip: str | None = None) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    command = [
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-days",
        "1",
        "-subj",
        f"/CN={name}",
        "-keyout",
        str(key),
        "-out",
        str(cert),
    ]
    if ip is not None:
        command += ["-addext", f"subjectAltName=IP:{ip}"]
    subprocess.run(command, check=True, capture_output=True, timeout=30)
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="makes its certificates with openssl")
def test_a_client_with_the_ca_and_a_client_certificate_connects_over_tls(tmp_path: Path) -> None:
    server_cert, server_key = _self_signed(tmp_path, "server", ip="127.0.0.1")
    client_cert, client_key = _self_signed(tmp_path, "client")
    port = free_port()
    command = [
        find_binary(),
        "-a",
        "127.0.0.1",
        "-p",
        str(port),
        "--tlsverify",
        "--tlscert",
        str(server_cert),
        "--tlskey",
        str(server_key),
        "--tlscacert",
        str(client_cert),
    ]
    url = f"tls://127.0.0.1:{port}"

    async def go() -> None:
        auth = NatsAuth(tls=TlsFiles(ca=server_cert, cert=client_cert, key=client_key))
        bus = await asyncio.wait_for(Bus.connect(url, options=auth.connect_options()), 10)

        async def echo(msg: Msg) -> None:
            await bus.client.publish(msg.reply, msg.data)

        await bus.client.subscribe("t.echo", cb=echo)
        assert (await bus.client.request("t.echo", b"over tls", timeout=5)).data == b"over tls"
        await bus.close()
        without_cert = NatsAuth(tls=TlsFiles(ca=server_cert)).connect_options().tls
        with pytest.raises(Exception):  # noqa: B017 (the TLS alert surfaces as various errors)
            await nats.connect(url, tls=without_cert, allow_reconnect=False, connect_timeout=3)

    server = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        asyncio.run(go())
    finally:
        server.terminate()
        server.wait(timeout=10)


async def _refused(kwargs: dict[str, Any], url: str) -> bool:
    """Whether the server at `url` refuses the login in `kwargs` (connect kwargs)."""

    async def quiet(error: Exception) -> None:
        pass

    try:
        client = await nats.connect(
            **{**kwargs, "servers": [url]}, allow_reconnect=False, error_cb=quiet
        )
    except nats.errors.Error as error:
        return "Authorization Violation" in str(error)
    await client.close()
    return False


def test_a_tenant_password_is_kept_and_configured_only_as_its_bcrypt_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tenant gets its password once; the data dir and the server's configuration hold
    its bcrypt hash, which nats-server checks it against. A password an older version kept in
    the clear is hashed at the next change, and keeps working."""
    with EmbeddedNats(auth_data_dir=tmp_path) as server:
        alice = tenant_add(tmp_path, "alice", capsys)
        bob = tenant_add(tmp_path, "bob", capsys)
        kept = nats_dir(tmp_path) / "tenants" / "bob.password"
        kept.write_text("an-older-clear-password\n")  # as an older version kept it
        server.reload()
        bob = {**bob, "password": "an-older-clear-password"}
        config = json.loads((nats_dir(tmp_path) / "nats-server.conf").read_text())
        users = [u for a in config["accounts"].values() for u in a.get("users", [])]
        hashes = {u["user"]: u["password"] for u in users if u["user"].startswith("tenant-")}
        assert set(hashes) == {"tenant-alice", "tenant-bob"}
        for name, tenant in (("alice", alice), ("bob", bob)):
            assert bcrypt.checkpw(tenant["password"].encode(), hashes[f"tenant-{name}"].encode())
        files = b"".join(p.read_bytes() for p in nats_dir(tmp_path).rglob("*") if p.is_file())
        assert alice["password"].encode() not in files
        assert b"an-older-clear-password" not in files

        async def go() -> None:
            for tenant in (alice, bob):
                client = await nats.connect(**{**tenant, "servers": [server.url]})
                await client.flush()
                await client.close()
                assert await _refused({**tenant, "password": hashes[tenant["user"]]}, server.url)

        asyncio.run(go())


def test_a_tenant_removed_while_the_reload_fails_keeps_neither_its_key_nor_its_login(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tenant remove` revokes the HTTP API key before the NATS login: a nats-server that does
    not take the new configuration (here: its listen address was edited, which it cannot
    reload) fails the command, which says so, with the key refused already; once the server
    runs from the data dir again, the login is refused as well."""
    with EmbeddedNats(auth_data_dir=tmp_path) as server:
        assert main(["tenant", "add", "alice", "--data-dir", str(tmp_path)]) == 0
        printed = json.loads(capsys.readouterr().out)
        alice, key = printed["nats"], printed["http"]["api_key"]
        keys = ApiKeys(tmp_path)
        assert keys.tenant(key) == "alice"
        path = nats_dir(tmp_path) / "nats-server.conf"
        edited = json.loads(path.read_text())
        edited["listen"] = f"127.0.0.1:{free_port()}"
        path.write_text(json.dumps(edited))
        assert main(["tenant", "remove", "alice", "--data-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "API key is refused" in err and "did not take" in err, err
        with pytest.raises(OpenAIError):
            keys.tenant(key)
    with EmbeddedNats(auth_data_dir=tmp_path) as server:
        assert asyncio.run(_refused(alice, server.url))
        with pytest.raises(OpenAIError):
            ApiKeys(tmp_path).tenant(key)


def test_tenant_add_and_rotate_write_a_line_only_its_user_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--out FILE`: the line goes into FILE, mode 0600 whatever the umask (a shell's `>`
    makes it 0644), nothing secret on the terminal; `rotate --out` replaces it with a line that
    connects where the old one is refused."""
    data, line = tmp_path / "data", tmp_path / "me.json"
    old_umask = os.umask(0o022)
    try:
        assert main(["tenant", "add", "me", "--data-dir", str(data), "--out", str(line)]) == 0
        out, err = capsys.readouterr()
        assert line.stat().st_mode & 0o777 == 0o600
        first = json.loads(line.read_text())
        assert out == "" and first["nats"]["password"] not in err and str(line) in err
        line.chmod(0o644)  # rotate replaces even a file made wider since
        assert main(["tenant", "rotate", "me", "--data-dir", str(data), "--out", str(line)]) == 0
        assert line.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old_umask)
    second = json.loads(line.read_text())
    assert second["nats"]["password"] != first["nats"]["password"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    async def go(url: str) -> None:
        assert await _refused(first["nats"], url)
        server, connect = tenant_options(line)
        bus = await Bus.connect(url, options=connect)
        await bus.close()

    with EmbeddedNats(auth_data_dir=data) as server:
        asyncio.run(go(server.url))


def test_chat_and_bench_refused_say_so_and_name_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sharegpt20: Path
) -> None:
    """`pensieve chat` and `pensieve bench` against a server that asks who connects, without
    credentials or with a tenant's old ones: the first refusal ends the command with what was
    refused and what to pass (they retried for 10 s, then said no server answers, or nothing)."""
    alice = tmp_path / "alice.json"
    assert main(["tenant", "add", "alice", "--data-dir", str(tmp_path), "--out", str(alice)]) == 0
    old = alice.read_text()
    assert main(["tenant", "rotate", "alice", "--data-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    stale = tmp_path / "stale.json"
    stale.write_text(old)
    with EmbeddedNats(auth_data_dir=tmp_path) as server:
        url = ["--nats-url", server.url]
        bench = ["bench", str(sharegpt20), "--num-conversations", "1"]
        runs = {
            "chat, anonymous": (["chat", *url], "without credentials", "--tenant FILE"),
            "bench, anonymous": ([*bench, *url], "without credentials", "--tenant FILE"),
            "chat, stale": (
                ["chat", *url, "--tenant", str(stale)],
                "user 'tenant-alice'",
                "rotate",
            ),
            "bench, stale": (
                [*bench, *url, "--tenant", str(stale)],
                "user 'tenant-alice'",
                "rotate",
            ),
        }
        for name, (args, who, fix) in runs.items():
            done = subprocess.run(
                [sys.executable, "-m", "pensieve.ops.cli", *args],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
            )
            said = done.stderr.strip().splitlines()[-1]
            assert done.returncode == 2, (name, done.stderr)
            assert "refused" in said and who in said and "authorization" in said, (name, said)
            assert fix in said and "Authorization Violation" not in done.stderr, (name, said)
