"""`pensieve serve` in a process of its own, joined to a nats-server it does not start: its engine
id read from its log, SIGKILL and SIGTERM. The many-engine tests and `benchmarks/bench_placement.py`
run engines this way."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from pensieve.ops.nats_server import death_signal_setter

ENGINE_ID = re.compile(r"this engine: pensieve\.v1\.engine\.([0-9a-f]{8})\.")


class EngineProcess:
    """`pensieve serve OPTIONS --nats-url URL --data-dir DATA_DIR`; `device`: the GPUs it sees."""

    def __init__(
        self, url: str, data_dir: Path, options: Sequence[str], device: str | None = None
    ) -> None:
        command = [
            *(sys.executable, "-m", "pensieve.ops.cli", "serve", *options),
            *("--nats-url", url, "--data-dir", str(data_dir)),
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        self.data_dir = data_dir
        self.proc = subprocess.Popen(
            command,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            # the caller killed (a benchmark or test stopped by hand) takes its engines with it
            preexec_fn=death_signal_setter(),  # noqa: PLW1509 (one libc call, resolved before)
        )
        self.lines: list[str] = []
        self.engine_id = ""
        self._ready = threading.Event()
        # read all along: a pipe nobody reads fills up and blocks the engine's log
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.lines.append(line)
            found = ENGINE_ID.search(line)
            if found and not self._ready.is_set():
                self.engine_id = found.group(1)
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 180.0) -> str:
        """Its engine id, once it serves; RuntimeError with its log's end if it does not."""
        if not self._ready.wait(timeout) or not self.engine_id:
            raise RuntimeError("engine not ready:\n" + self.log())
        return self.engine_id

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (it drains), then SIGKILL after `timeout`; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return "".join(self.lines[-60:])
