"""`pensieve serve --disk-cache-dir` as a process: killed with SIGKILL while it writes its KV
tiers back on a SIGTERM, then started again on the same directories, every conversation goes
on with the greedy tokens of a server that was never stopped, and chunks the killed server had
written to disk serve the next turns (counted as `disk` in their usage). Real processes, a real
nats-server, HTTP through aiohttp."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pensieve.ops.nats_server import free_port

pytestmark = pytest.mark.slow

OPENINGS = [
    "Tell me about the harbour of Lyon and its old bridges over the river. " * 6,
    "Describe a morning at a bakery in a small town by the sea, step by step. " * 6,
    "Write about two cats on a boat and the storm they sail through at night. " * 6,
]
NEXT = ["And the museums?", "What do they bake at noon?", "How does it end?"]
# tiny tiers: each opening pushes the others' chunks down to the disk tier
TIERS = ["--gpu-cache-tokens", "256", "--cpu-cache-tokens", "64", "--admission-reserve", "0"]


@contextmanager
def server(data: Path, disk: Path | None) -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = free_port()
    command = [sys.executable, "-m", "pensieve.ops.cli", "serve", "smollm2", "--insecure"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--nats-port", str(free_port())]
    command += ["--data-dir", str(data), *TIERS, "--log-level", "info"]
    if disk is not None:
        command += ["--disk-cache-dir", str(disk), "--disk-cache-gb", "0.1"]
        command += ["--disk-read-gbps", "1e6"]  # read back every chunk on disk
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(proc, "OpenAI-compatible API on")
        yield proc, f"http://127.0.0.1:{port}/v1/chat/completions"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def wait_for(proc: subprocess.Popen[str], words: str) -> str:
    assert proc.stderr is not None
    said = ""
    while words not in said:
        line = proc.stderr.readline()
        assert line, said
        said += line
    return said


def turn(url: str, message: str, conv_id: str | None = None) -> dict[str, Any]:
    import aiohttp

    body: dict[str, Any] = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": message}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if conv_id is not None:
        body["conversation_id"] = conv_id

    async def post() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    return asyncio.run(post())


def tokens(reply: dict[str, Any]) -> list[int]:
    return reply["choices"][0]["token_ids"]


def test_a_server_killed_while_writing_back_continues_with_the_same_tokens(tmp_path) -> None:
    with server(tmp_path / "reference", None) as (_, url):  # never stopped
        firsts = [turn(url, text) for text in OPENINGS]
        seconds = [turn(url, t, f["conversation_id"]) for f, t in zip(firsts, NEXT, strict=True)]
        reference = [tokens(r) for r in firsts + seconds]
    disk = tmp_path / "disk"
    disk.mkdir()
    with server(tmp_path / "data", disk) as (proc, url):
        firsts = [turn(url, text) for text in OPENINGS]
        proc.send_signal(signal.SIGTERM)
        wait_for(proc, "disk tier: writing the KV tiers back")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    with server(tmp_path / "data", disk) as (proc, url):
        seconds = [turn(url, t, f["conversation_id"]) for f, t in zip(firsts, NEXT, strict=True)]
    assert [tokens(r) for r in firsts + seconds] == reference
    sources = [r["usage"]["prompt_tokens_details"]["prompt_sources"] for r in seconds]
    assert sum(s["disk"] for s in sources) >= 32, sources
