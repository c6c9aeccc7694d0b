"""The disk tier with the executor apart from the scheduler: in processes of their own
(`pensieve actor`, as the compose stack runs them), and in one process over the bus
(`pensieve serve --step-channel nats`); a real nats-server, the real SmolLM2 on the CPU and the
tier's files in `tmp_path`.

Tiers so small that each opening pushes the others' chunks off the GPU and the CPU tier: a
conversation's next turn reads its history back from the executor's disk. Then the engine
stops cleanly (the scheduler first: it has the executor write the KV tiers back), starts again
on the same directory, and the next turns read the histories written back. Every turn's greedy
tokens equal those of the stateless in-process reference, a run without the tier."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import orjson
import pytest

from pensieve.actors.wire import subjects
from pensieve.ops.nats_server import EmbeddedNats, free_port
from tests.ops.serving import stateless_references

pytestmark = pytest.mark.slow

OPENINGS = [
    "Tell me about the harbour of Lyon and its old bridges over the river. " * 6,
    "Describe a morning at a bakery in a small town by the sea, step by step. " * 6,
    "Write about two cats on a boat and the storm they sail through at night. " * 6,
]
NEXT = ["And the museums?", "What do they bake at noon?", "How does it end?"]
MAX_TOKENS = 6
MODEL = ["--model", "smollm2"]
# 8 GPU blocks and 2 CPU slots; every chunk on disk is read back rather than recomputed
TIERS = ["--gpu-cache-tokens", "256", "--cpu-cache-tokens", "64"]
DISK = ["--disk-cache-gb", "0.1", "--disk-read-gbps", "1e6"]
OPTIONS = {
    "executor": [*MODEL, *TIERS, *DISK, "--cpu-threads", "1"],
    "scheduler": [*MODEL, "--admission-reserve", "0", "--tokenizers", "0"],
    "tokenizer": [*MODEL, "--tokenizers", "1"],
    "ingress": [],
    "recompute-planner": [],
}


class Process:
    """A `pensieve` command in a subprocess, its log in a file (read for the lines it says)."""

    def __init__(self, name: str, args: list[str], logs: Path, ready: str = "ready on") -> None:
        self.name, self.ready = name, ready
        self.log = logs / f"{name}-{time.monotonic_ns()}.log"
        command = [sys.executable, "-m", "pensieve.ops.cli", *args, "--log-level", "info"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(command, stderr=log, env=env)

    def said(self) -> str:
        return self.log.read_text()

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while self.ready not in self.said():
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.said()}"
            assert time.monotonic() < deadline, f"{self.name} not ready:\n{self.said()}"
            time.sleep(0.2)

    def stop(self) -> int:
        """SIGTERM, and its exit status (killed if it takes over a minute)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def actor(name: str, url: str, data: Path, logs: Path, *extra: str) -> Process:
    args = ["actor", name, *OPTIONS[name], "--nats-url", url, "--data-dir", str(data), *extra]
    return Process(name, args, logs, "serving on" if name == "scheduler" else "ready on")


async def turn(url: str, message: str, conv_id: str | None = None) -> dict[str, Any]:
    client = await nats.connect(url)
    try:
        body: dict[str, Any] = {"message": message, "max_tokens": MAX_TOKENS}
        if conv_id is not None:
            body["conversation_id"] = conv_id
        reply = orjson.loads((await client.request(subjects.CHAT, orjson.dumps(body), 120)).data)
    finally:
        await client.close()
    assert "error" not in reply, reply
    return dict(reply)


CHATS = [[opening, then] for opening, then in zip(OPENINGS, NEXT, strict=True)]
Turns = dict[tuple[int, int], dict[str, Any]]  # (chat, turn) -> its reply


def across_a_restart(url: str, start: Callable[[], list[Process]]) -> Turns:
    """a and b open, a goes on (its history partly pushed down to disk by b's), c opens (its
    chunks still on the GPU at the stop); the engine that `start` starts (the scheduler last)
    stops cleanly, the scheduler first, and starts again; b and c go on."""
    replies: Turns = {}

    async def turns(which: list[tuple[int, int]]) -> None:
        for i, j in which:
            conv_id = replies[(i, 0)]["conversation_id"] if j else None
            replies[(i, j)] = await turn(url, CHATS[i][j], conv_id)

    engine = start()
    try:
        asyncio.run(turns([(0, 0), (1, 0), (0, 1), (2, 0)]))
    finally:
        codes = [p.stop() for p in reversed(engine)]
    scheduler = engine[-1]
    assert codes == [0] * len(engine), [p.said() for p in engine]
    assert "chunks written back" in scheduler.said(), scheduler.said()
    engine = start()
    try:
        asyncio.run(turns([(1, 1), (2, 1)]))
    finally:
        codes = [p.stop() for p in reversed(engine)]
    assert codes == [0] * len(engine), [p.said() for p in engine]
    return replies


def check(replies: Turns, reference: list[list[list[int]]]) -> None:
    """The greedy tokens of a run without the tier, and histories read back from disk."""
    for (i, j), reply in replies.items():
        assert reply["token_ids"] == reference[i][j], (i, j)
    from_disk = {key: r["usage"]["prompt_sources"]["disk"] for key, r in replies.items()}
    # a's history partly from disk before the restart; b's and c's whole (121 prompt tokens:
    # 3 full chunks, and a 4th with the reply) after it, c's written back at the clean stop
    assert from_disk[(0, 1)] >= 32, from_disk
    assert from_disk[(1, 1)] >= 96 and from_disk[(2, 1)] >= 96, from_disk


@pytest.fixture(scope="module")
def reference(smollm2, smollm2_chat, tmp_path_factory) -> list[list[list[int]]]:
    folder = tmp_path_factory.mktemp("chats")
    return stateless_references(smollm2, smollm2_chat, CHATS, MAX_TOKENS, folder)


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The engine's store, the disk tier's directory, and the processes' logs."""
    made = tmp_path / "data", tmp_path / "disk", tmp_path / "logs"
    for folder in made[1:]:
        folder.mkdir()
    return made


def test_actors_in_processes_of_their_own_read_histories_from_disk_across_a_restart(
    reference, folders
) -> None:
    data, disk, logs = folders
    with EmbeddedNats() as server:
        url = server.url
        front = [actor(n, url, data, logs) for n in ("ingress", "tokenizer", "recompute-planner")]

        def start() -> list[Process]:
            started = [
                actor("executor", url, data, logs, "--disk-cache-dir", str(disk)),
                actor("scheduler", url, data, logs),
            ]
            for process in started:
                process.wait_ready()
            return started

        try:
            for process in front:
                process.wait_ready()
            replies = across_a_restart(url, start)
        finally:
            codes = [process.stop() for process in front]
    assert codes == [0] * len(front)
    check(replies, reference)


def test_serve_over_the_step_channel_reads_histories_from_disk_across_a_restart(
    reference, folders
) -> None:
    data, disk, logs = folders
    port = free_port()
    args = ["serve", "smollm2", "--insecure", "--nats-port", str(port), "--data-dir", str(data)]
    args += ["--step-channel", "nats", *TIERS, *DISK, "--disk-cache-dir", str(disk)]
    args += ["--admission-reserve", "0"]

    def start() -> list[Process]:
        serve = Process("serve", args, logs, "pensieve: serving on")
        serve.wait_ready()
        return [serve]

    check(across_a_restart(f"nats://127.0.0.1:{port}", start), reference)
